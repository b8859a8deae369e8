"""The spurious ``ERROR … AsyncLLM output_handler failed … EngineDeadError`` of a graceful stop.

vLLM's ``AsyncLLM.shutdown`` (vllm/v1/engine/async_llm.py, v0.32.0) stops the engine-core client
before it cancels its output handler; the client's cleanup cancels its socket task, which hands
the handler an ``EngineDeadError``; when the event loop runs that before the handler's own
cancellation, the handler logs the error with a traceback although the stop went well.  A race,
reported as vLLM issue #48745; fixed upstream by PR #49000 (a ``_shutdown_initiated`` flag set
first thing in ``shutdown``; the handler then logs that case at DEBUG).  Measured here: once a
kvtier worker exits within a second of its flush (:mod:`kvtier.integrations.vllm.process_exit`),
the engine core stops within about a second of SIGTERM and the race was lost in 2 of 3 stops.

:func:`install` backports that fix to a vLLM without it, in the API server of an engine that uses
kvtier (called by the plugin's pre-flight, :mod:`kvtier.integrations.vllm.plugin`): ``shutdown``
marks the stop as begun, and a filter on vLLM's ``async_llm`` logger turns exactly that record
(message ``AsyncLLM output_handler failed.``, exception ``EngineDeadError``, stop begun) into one
DEBUG line of kvtier.  An ``EngineDeadError`` before the stop, or any other exception, is
logged by vLLM as before.  A vLLM that has the fix (``AsyncLLM._shutdown_initiated``) is left as is.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["install"]

log = logging.getLogger(__name__)

_MARK = "_kvtier_shutdown_race_fix"
_stopping = threading.Event()


class _ShutdownRaceFilter(logging.Filter):
    """Drops vLLM's output-handler error record when it is the shutdown race (see the module)."""

    def __init__(self, dead_error: type[BaseException]) -> None:
        super().__init__()
        self.dead_error = dead_error

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if _stopping.is_set() and isinstance(exc, self.dead_error) and \
                record.getMessage().startswith("AsyncLLM output_handler failed"):
            log.debug("kvtier: vLLM's output handler saw the engine's own stop (vLLM #48745); not an error")
            return False
        return True


def install() -> bool:
    """Backport vLLM PR #49000 into this process (idempotent); ``False`` when vLLM is absent or
    already has the fix."""
    try:
        from vllm.v1.engine import async_llm
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:
        return False
    engine = async_llm.AsyncLLM
    if hasattr(engine, "_shutdown_initiated"):
        return False
    if getattr(engine, _MARK, False):
        return True
    original = engine.shutdown

    def shutdown(self: Any, *args: Any, **kwargs: Any) -> None:
        _stopping.set()
        original(self, *args, **kwargs)

    engine.shutdown = shutdown  # type: ignore[method-assign]
    logging.getLogger(async_llm.__name__).addFilter(_ShutdownRaceFilter(EngineDeadError))
    setattr(engine, _MARK, True)
    return True
