"""Ctrl-C (SIGINT) ends a command with one line on stderr, as SIGTERM does: ``bench run`` and
``simulate`` exited 130 without a word.  ``bench run --out DIR`` then says what DIR holds: the run
stopped before requests.json and summary.json, so it holds only metrics-before.txt."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.bench.sse_server import launch

KVTIER = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
          "sys.argv[0] = 'kvtier'; runpy.run_module('kvtier.cli.main', run_name='__main__')")
"""``kvtier`` with Python's Ctrl-C handler and SIGINT unblocked, as a shell's foreground command has them,
even if the test runner's process ignores or blocks SIGINT (both are inherited across exec)."""


def _signal_state(pid: int) -> str:
    """The process's signal masks from /proc (blocked, ignored, caught, pending), for a failure's message."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as exc:
        return f"(no /proc status: {exc})"
    return " ".join(line.replace("\t", "") for line in lines if line.startswith(("SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd")))


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", KVTIER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for(ready, what: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        assert proc.poll() is None, f"the command ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within 60 s"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return kids


def test_ctrl_c_to_bench_run_says_so_and_what_out_holds(tmp_path) -> None:
    server, url = launch("--gap", "0.5")
    out = tmp_path / "run"
    try:
        proc = _start("bench", "run", "--url", url, "--workload", "prefix-repetition", "--num-requests", "2",
                      "--prefix-len", "8", "--suffix-len", "4", "--num-prefixes", "1", "--output-len", "100",
                      "--vocab-size", "500", "--no-progress", "--out", str(out))
        _wait_for((out / "metrics-before.txt").is_file, "metrics-before.txt", proc)
        time.sleep(0.5)  # the requests are being streamed (50 s each)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        server.kill()
        server.wait()
    assert proc.returncode == 130
    assert "Traceback" not in err
    assert err.splitlines() == [
        "kvtier: stopped by SIGINT (Ctrl-C); exiting with 130",
        (f"kvtier: --out {out} holds only metrics-before.txt (the run was cut short before requests.json, "
         "summary.json and metrics-after.txt were written); run it again with --force to replace it")]
    assert sorted(p.name for p in out.iterdir()) == ["metrics-before.txt"]


def test_ctrl_c_to_simulate_says_so() -> None:
    proc = _start("simulate", "--trace", "bundled", "--kv-bytes-per-token", "100000", "--engine-gib", "1",
                  "--cpu-gib", "1,2,4,8,16,32,64,128", "--workers", "2")
    _wait_for(lambda: len(_children(proc.pid)) >= 2, "replay processes", proc)  # in the sweep, trace read
    state = _signal_state(proc.pid)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, f"SIGINT sent with {state}; stderr: {err[-2000:]}"
    assert err.splitlines() == ["kvtier: stopped by SIGINT (Ctrl-C); exiting with 130"]
