"""A helper server process on this host (``rclone serve s3``, ``redis-server``) for a benchmark
or a test: wait until it answers, stop it.  What each server is started with stays with its
caller (:mod:`kvtier.bench.shared_s3`, :mod:`kvtier.bench.shared_redis`, ``tests/s3_servers.py``);
this module holds only what they did alike.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.core.errors import ServerStartError

POLL_S = 0.05
"""Seconds between two readiness checks."""


def http_answers(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether an HTTP server answers ``GET /`` on ``host:port`` within ``timeout_s`` seconds (any
    status: it is up, whatever it thinks of an unsigned request)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            return s.recv(12).startswith(b"HTTP/1.")
    except OSError:
        return False


def wait_until_answers(proc: subprocess.Popen[bytes], answers: Callable[[], bool], timeout_s: float, name: str,
                       log_path: Path, log_lines: int = 0) -> None:
    """Call ``answers()`` every :data:`POLL_S` seconds until it returns true, at most ``timeout_s``
    seconds (a check that blocks counts against that time).

    Raises:
        ServerStartError: ``proc`` exited first, or nothing answered in time; one line naming
            ``name`` and ``log_path`` (and, with ``log_lines``, the log's last lines joined by ``|``).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"{name} exited with code {proc.returncode} at start-up; see {log_path}"
                                   f"{_log_tail(log_path, log_lines)}")
        if answers():
            return
        time.sleep(POLL_S)
    raise ServerStartError(f"{name} did not answer within {timeout_s:g} s; see {log_path}"
                           f"{_log_tail(log_path, log_lines)}")


def _log_tail(path: Path, num_lines: int) -> str:
    if num_lines <= 0:
        return ""
    try:
        lines = path.read_text(errors="replace").splitlines()[-num_lines:]
    except OSError:
        return " (no log)"
    return ": " + " | ".join(line.strip() for line in lines)


def stop_process(proc: subprocess.Popen[bytes] | None, grace_s: float = 10.0) -> None:
    """Stop ``proc`` if it still runs: ``SIGCONT`` (a stopped process cannot handle the next
    signal), ``SIGTERM``, then ``SIGKILL`` after ``grace_s`` seconds; returns once it is gone."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)
