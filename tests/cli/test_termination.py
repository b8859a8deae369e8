"""SIGTERM/SIGHUP end a kvtier command the way Ctrl-C does: its ``finally`` blocks run (breaker F8).

The end-to-end case (``bench compare`` stops its vLLM server and private redis-server) is in
tests/bench/test_replicas.py; this one covers a signal that arrives while a child is being started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

from tests.processes import pids_mentioning

SCRIPT = """
import os, signal, subprocess, sys, threading, time
from kvtier.cli.termination import exit_on_termination
guard = exit_on_termination()  # held: the handlers live as long as the block
guard.__enter__()
# SIGTERM arrives while Popen() waits for the child's exec (its preexec_fn sleeps): a handler that
# raised there would lose the child's handle, and the child would run on in its own session.
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
proc = None
try:
    proc = subprocess.Popen(["sleep", sys.argv[1]], preexec_fn=lambda: time.sleep(1.0),
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("started", flush=True)
    time.sleep(30)
finally:
    if proc is not None:
        proc.kill()
        proc.wait()
        print("stopped the child", flush=True)
"""


def test_sigterm_while_a_child_starts_still_stops_the_child() -> None:
    marker = f"60.{uuid.uuid4().int % 10**12:012d}"  # the child's `sleep` time: unique to this test run
    result = subprocess.run([sys.executable, "-c", SCRIPT, marker], check=False, capture_output=True, text=True, timeout=60)
    leaked = pids_mentioning(marker)
    for pid in leaked:  # ours: clean up before asserting
        os.kill(pid, signal.SIGKILL)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "kvtier: stopped by SIGTERM" in result.stderr
    assert result.stdout.split() == ["started", "stopped", "the", "child"]
    assert leaked == []
