"""kvtier.launch.localserver, the wait and stop that the bench's private servers (rclone serve s3,
redis-server) and the tests' servers share, against real child processes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.core.errors import ServerStartError
from kvtier.launch.localserver import http_answers, stop_process, wait_until_answers
from kvtier.launch.serve import free_port


def spawn(code: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)


def test_a_server_that_exits_is_one_line_naming_its_code_and_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = spawn("print('bind: address in use'); raise SystemExit(3)", log)
    with pytest.raises(ServerStartError) as err:
        wait_until_answers(proc, lambda: False, 20.0, "toy server", log, log_lines=1)
    message = str(err.value)
    assert "toy server exited with code 3 at start-up" in message and str(log) in message
    assert message.endswith(": bind: address in use") and "\n" not in message


def test_a_server_that_never_answers_is_refused_at_the_bound_and_stopped_even_when_paused(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = spawn("import time; time.sleep(120)", log)
    try:
        with pytest.raises(ServerStartError, match=r"toy server did not answer within 0.3 s; see "):
            wait_until_answers(proc, lambda: http_answers("127.0.0.1", free_port()), 0.3, "toy server", log)
        proc.send_signal(signal.SIGSTOP)  # a stopped process must still be stopped
        stop_process(proc, grace_s=10.0)
        assert proc.returncode == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_http_server_answers_and_the_wait_returns(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    proc = spawn(f"import http.server as h; h.HTTPServer(('127.0.0.1', {port}), h.BaseHTTPRequestHandler)"
                 ".serve_forever()", log)
    try:
        wait_until_answers(proc, lambda: http_answers("127.0.0.1", port), 20.0, "toy server", log)
        assert http_answers("127.0.0.1", port)
    finally:
        stop_process(proc)
    assert proc.poll() is not None and not http_answers("127.0.0.1", port)
