"""``SIGSTOP`` a test server and wait until every one of its threads has stopped.

``send_signal(SIGSTOP)`` returns before the kernel has stopped the process: a request already on
its way can still be answered (seen under load: an s3 read of a "stalled" server came back a
hit).  A stall test must begin only once nothing of the server runs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def stop_and_wait(pid: int, timeout_s: float = 5.0) -> None:
    """Send ``SIGSTOP`` to ``pid`` and wait (at most ``timeout_s``) until all its threads show
    state ``T`` in ``/proc/PID/task/*/stat``.

    Raises:
        TimeoutError: a thread still runs after ``timeout_s``.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_state(stat) in ("T", "t") for stat in Path(f"/proc/{pid}/task").glob("*/stat")):
            return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} did not stop within {timeout_s} s of SIGSTOP")


def _state(stat: Path) -> str:
    try:
        text = stat.read_text()
    except OSError:  # a thread that exited meanwhile
        return "T"
    return text[text.rindex(")") + 2]  # the field after "(comm)"
