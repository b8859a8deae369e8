"""Let a vLLM process whose connector has shut down exit without walking its whole heap again.

Why: vLLM freezes the garbage collector's view of an engine's heap after start-up (``gc.freeze``,
``freeze_gc_heap`` in vllm/v1/worker/gpu_worker.py and vllm/v1/engine/core.py, v0.32.0) and
unfreezes it at shutdown (``Worker.shutdown`` and ``EngineCore.shutdown`` call ``gc.unfreeze()``
so that an engine deleted in-process frees its memory).  A worker process then runs a full
collection in ``GPUModelRunner._cleanup_profiling_kv_cache`` and, exiting through
``Py_FinalizeEx``, more of them, each walking the whole unfrozen heap: about 700,000 objects
of torch, vLLM, sympy and the rest for the tiny test model, more for a real one.  Measured on
the 2-core test machine (tests/integrations/test_vllm_serve.py's first stop): the worker was still
collecting 5 s after kvtier's flush line, vLLM's executor then sent SIGTERM (which the worker
ignores once it is shutting down) and SIGKILL 4 s later, and the engine core spent its own
seconds the same way; when the stop passed the API server's ``--shutdown-timeout``, its process
manager force-killed the engine core and the API server logged
``ERROR … AsyncLLM output_handler failed … EngineDeadError`` (vllm/v1/engine/async_llm.py,
vllm/v1/engine/utils.py ``CoreEngineProcManager.shutdown``).  A server without a connector
pays the same collections; vLLM itself skips the last one for the engine core on ROCm
(``gc.freeze()`` in ``EngineCore.run_engine_core``: "skip another slow cyclic-GC scan during
finalization; process exit reclaims it").

What :func:`skip_exit_collection` does, once the connector's ``shutdown()`` has run:

- in a vLLM worker process (``multiprocessing`` names it ``VllmWorker-<rank>``,
  vllm/v1/executor/multiproc_executor.py), which exits when its shutdown returns, the heap is
  frozen at once, so the collections left in vLLM's teardown and at exit skip it;
- in any process, an ``atexit`` hook freezes the heap when the interpreter exits (Python runs
  ``atexit`` hooks before its final collections, Python/pylifecycle.c ``Py_FinalizeEx``).

The operating system reclaims the memory either way.  An engine deleted in-process (``del
llm``, the tests' engines) is still collected normally: its process is no worker process and
has not exited.  Only objects held in reference cycles at exit skip their finalizers, which
Python never promised to run at exit.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import threading

__all__ = ["WORKER_PROCESS_PREFIX", "skip_exit_collection"]

WORKER_PROCESS_PREFIX = "VllmWorker-"
"""Name vLLM gives its worker processes (vllm/v1/executor/multiproc_executor.py, v0.32.0)."""

_lock = threading.Lock()
_registered = False


def skip_exit_collection() -> None:
    """Freeze the heap now in a vLLM worker process, and at interpreter exit in any process
    (see the module docstring).  Idempotent, thread-safe; call it at the end of a shutdown."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(gc.freeze)
            _registered = True
    if multiprocessing.parent_process() is not None and \
            multiprocessing.current_process().name.startswith(WORKER_PROCESS_PREFIX):
        gc.freeze()
