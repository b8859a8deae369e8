"""SIGTERM of a real ``python -m vllm.entrypoints.openai.api_server`` with kvtier: a clean stop.

One server (tiny model, write-back so the stop has dirty chunks to flush), one request, SIGTERM.
The stop must end with kvtier's flush line and no ERROR from vLLM, and the worker process that
logged the flush must be gone within 1 s of it.  Before the fix the worker spent over 5 s in the
interpreter's final garbage collection of the heap vLLM unfreezes at shutdown, vLLM's executor
sent SIGTERM and SIGKILL, and when the stop passed ``--shutdown-timeout`` the API server logged
``ERROR … AsyncLLM output_handler failed … EngineDeadError``
(:mod:`kvtier.integrations.vllm.process_exit`).

Judges a 1 s bound: marked ``engine`` only, not ``shares_cpu``.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.engine

FLUSH_LINE = re.compile(r"\(Worker pid=(\d+)\).*kvtier: rank 0 shutdown flush wrote (\d+) dirty chunks")


def _gone(pid: int) -> bool:
    """The process has exited (a zombie its parent has not reaped yet counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_sigterm_ends_with_the_flush_line_no_error_and_the_worker_gone_within_a_second(
        tiny_model: Path, tmp_path: Path) -> None:
    from kvtier.launch.serve import Server, ServerSpec, transfer_config
    from kvtier.launch.testmodel import random_prompt

    kvtier = {"disk_path": str(tmp_path / "disk"), "disk_gib": 0.5, "cpu_gib": 0.25, "write_mode": "write-back"}
    spec = ServerSpec(model=str(tiny_model), max_model_len=2048, kv_cache_bytes=256 << 20, load_format=None,
                      kv_transfer_config=transfer_config(kvtier), memory_fraction=0.1, enforce_eager=True,
                      shutdown_timeout_s=30)
    log_path = tmp_path / "server.log"
    server = Server(spec, log_path).start(600)
    try:
        server.complete(random_prompt(7, 400), max_tokens=4)  # 3 whole chunks, dirty in write-back mode
        started = len(log_path.read_text(errors="replace"))
        stopper = threading.Thread(target=server.stop, kwargs={"grace_s": 60.0})
        stopper.start()
        flushed_at = worker = None
        deadline = time.monotonic() + 90.0
        while flushed_at is None and time.monotonic() < deadline:
            found = FLUSH_LINE.search(log_path.read_text(errors="replace")[started:])
            if found:
                flushed_at, worker, written = time.monotonic(), int(found[1]), int(found[2])
            time.sleep(0.02)
        assert flushed_at is not None and worker is not None, f"no flush line after SIGTERM:\n{server.log_tail(30)}"
        assert written >= 3, "the write-back chunks were not flushed"
        while not _gone(worker) and time.monotonic() - flushed_at < 10.0:
            time.sleep(0.02)
        exit_s = time.monotonic() - flushed_at
        stopper.join(120.0)
    finally:
        server.stop()
    after = log_path.read_text(errors="replace")[started:]
    assert exit_s < 1.0, f"the worker exited {exit_s:.1f} s after kvtier's flush line"
    errors = [line for line in after.splitlines() if " ERROR " in line or "EngineDeadError" in line]
    assert errors == [], "\n".join(errors)
    assert "workers still running" not in after and "force killing" not in after, after
    assert server.exit_reason() == "exited with code 0", server.exit_reason()
