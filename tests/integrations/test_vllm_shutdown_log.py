"""The backport of vLLM PR #49000 (issue #48745) that kvtier's plugin installs in the API server
(:mod:`kvtier.integrations.vllm.shutdown_log`), on vLLM's own ``AsyncLLM`` class and logger: the
output handler's ``EngineDeadError`` record is dropped once ``AsyncLLM.shutdown`` has begun, and
logged as before until then (a real engine death stays an ERROR).  No engine is started."""

from __future__ import annotations

import logging


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_the_output_handler_error_is_an_error_until_the_stop_begins_and_not_after() -> None:
    from vllm.v1.engine import async_llm
    from vllm.v1.engine.exceptions import EngineDeadError

    from kvtier.integrations.vllm.shutdown_log import install

    assert install() is True and install() is True  # idempotent
    vllm_log = logging.getLogger(async_llm.__name__)

    def handler_fails(error: Exception) -> None:  # what AsyncLLM's output_handler does with it
        try:
            raise error
        except Exception:  # noqa: BLE001 - as vLLM's output_handler catches it
            vllm_log.exception("AsyncLLM output_handler failed.")

    seen = _Records()
    vllm_log.addHandler(seen)
    try:
        handler_fails(EngineDeadError())  # the engine died while serving: still an ERROR
        assert [r.levelname for r in seen.records] == ["ERROR"]
        async_llm.AsyncLLM.shutdown(object.__new__(async_llm.AsyncLLM))  # the stop begins (nothing to stop)
        handler_fails(EngineDeadError())  # the race of issue #48745: dropped
        handler_fails(RuntimeError("other"))  # any other failure: still logged
        assert [(r.levelname, type(r.exc_info[1]).__name__ if r.exc_info else None) for r in seen.records] == [
            ("ERROR", "EngineDeadError"), ("ERROR", "RuntimeError")]
    finally:
        vllm_log.removeHandler(seen)
