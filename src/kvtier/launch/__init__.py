"""Launchers for tools and tests, with no tie to the connector: a vLLM OpenAI server started and
stopped as a child process (:mod:`~kvtier.launch.serve`), small test models with dummy weights
(:mod:`~kvtier.launch.testmodel`), and the wait and stop of a helper server such as ``rclone
serve s3`` or ``redis-server`` (:mod:`~kvtier.launch.localserver`).  None imports vLLM or torch in
this process.
"""
