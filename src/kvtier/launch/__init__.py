"""Launchers for tools and tests, with no tie to the connector: a vLLM OpenAI server started and
stopped as a child process (:mod:`~kvtier.launch.serve`) and small test models with dummy weights
(:mod:`~kvtier.launch.testmodel`).  Neither imports vLLM or torch in this process.
"""
