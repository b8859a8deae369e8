"""The process layout of the ``vllm serve`` servers started by the operator-tool tests (bench, doctor).

vLLM's CPU platform runs an api_server as three processes: the API server, the engine core, and the
worker (the ``mp`` executor, started with ``spawn``; vllm/platforms/cpu.py, v0.32.0, ``OMP requires
the MP executor``), unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: then the worker runs inside the
engine-core process (the ``uni`` executor) and the server starts one import of torch and vLLM
sooner.  Measured on the 2-core CI machine kind (one api_server: the tiny test model,
tests/integrations/vllm_helpers.py's live_spec, a kvtier cpu tier; the two layouts alternating): 34.6
and 42.7 s to the first answer with the default layout, 23.2 and 25.2 s with the worker in the
engine core, the same greedy completions.

:data:`WORKER_IN_ENGINE_CORE` is for tests whose subject is an operator tool (what ``kvtier bench``,
``kvtier doctor`` and ``kvtier trace record`` read and report) or the receipts a server returns
(tests/integrations/test_vllm_receipts.py), every server of one test alike.  The connector's own tests
(tests/integrations: the two connector halves meeting only through vLLM's per-step messages,
SIGTERM/SIGKILL of workers and engines, shutdown flushes, tensor-parallel ranks) keep vLLM's default
layout."""

from __future__ import annotations

WORKER_IN_ENGINE_CORE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""Environment of a server whose worker runs in its engine-core process (see the module docstring)."""
