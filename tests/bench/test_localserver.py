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


IGNORES_SIGTERM = ("import signal, sys, time\n"
                   "signal.signal(signal.SIGTERM, lambda *a: print('SIGTERM', flush=True))\n"
                   "{serve}\n"
                   "time.sleep(float(sys.argv[1]))\n")


def _server(tmp_path: Path, code: str, *args: str):
    from kvtier.launch.serve import Server, ServerSpec

    server = Server(ServerSpec(model="toy", max_model_len=2048), tmp_path / "server.log")
    # a toy in vllm serve's place (its argv only); "{port}" in args: the port the server was given
    server.command = [sys.executable, "-c", code, *(a.format(port=server.port) for a in args)]
    return server.launch()


def test_a_server_that_never_answered_is_killed_after_a_short_grace_not_the_minute(tmp_path: Path) -> None:
    """vLLM ignores SIGTERM while it starts: a Ctrl-C during ``bench compare``'s start-up waited the
    whole 60 s grace (fresh-user tester); a server that never answered has served nothing to flush."""
    import time

    from kvtier.launch.serve import NOT_READY_GRACE_S

    server = _server(tmp_path, IGNORES_SIGTERM.format(serve=""), "600")
    time.sleep(1.0)
    start = time.monotonic()
    server.stop()
    took = time.monotonic() - start
    assert server.exit_reason() == "was killed by signal 9" and "SIGTERM" in server.log_tail()
    assert NOT_READY_GRACE_S <= took < NOT_READY_GRACE_S + 8, took


def test_a_server_that_answers_gets_its_whole_grace_to_stop(tmp_path: Path) -> None:
    """One that answers ``/v1/models`` may hold unflushed KV (write-back): it is given the grace asked
    for, and here ends by itself 8 s after SIGTERM, before the SIGKILL would come."""
    serve = ("import http.server, threading\n"
             "class H(http.server.BaseHTTPRequestHandler):\n"
             "    def do_GET(self):\n"
             "        self.send_response(200); self.send_header('Content-Length', '2'); self.end_headers()\n"
             "        self.wfile.write(b'{}')\n"
             "    def log_message(self, *a): pass\n"
             "httpd = http.server.HTTPServer(('127.0.0.1', int(sys.argv[2])), H)\n"
             "threading.Thread(target=httpd.serve_forever, daemon=True).start()\n"
             "def later(*a):\n"
             "    print('SIGTERM', flush=True); threading.Timer(8.0, lambda: __import__('os')._exit(0)).start()\n"
             "signal.signal(signal.SIGTERM, later)\n")
    server = _server(tmp_path, IGNORES_SIGTERM.format(serve=serve), "600", "{port}")
    wait_until_answers(server._proc, server._answers, 20.0, "toy server", server.log_path)
    server.stop(grace_s=30.0)
    assert server.exit_reason() == "exited with code 0"
