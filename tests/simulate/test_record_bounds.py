"""``kvtier trace record`` against real local HTTP servers (tests/bench/sse_server.py): an existing
trace is never destroyed (refused without --force; replaced only once a request was recorded; kept
when recording fails to start), a trickling server cannot hold the recording past --duration-s or a
request past --timeout-s, and a bad --listen port is one sentence (break test F-trace-3/4/5)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.launch.serve import free_port
from kvtier.simulate.record import TraceRecorder
from kvtier.tools.mooncake import iter_records
from tests.bench.sse_server import launch

OLD = '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [0]}\n'


@pytest.fixture()
def server() -> Iterator[str]:
    proc, url = launch()
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture()
def trickle() -> Iterator[str]:
    """Answers every completion with headers, then one byte every 0.2 s (never ends)."""
    proc, url = launch("--trickle", "/v1/completions")
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture()
def kept(tmp_path: Path) -> Path:
    path = tmp_path / "keep.jsonl"
    path.write_text(OLD)
    return path


def _record(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["trace", "record", *args])
    return result.exit_code, result.output


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".part"))


def test_an_existing_out_is_refused_without_force(server: str, kept: Path) -> None:
    code, output = _record("--url", server, "--out", str(kept), "--listen", f"127.0.0.1:{free_port()}",
                           "--duration-s", "1")
    assert code == 2 and "already exists" in output and "--force" in output
    assert kept.read_text() == OLD


def test_a_taken_port_or_a_dead_server_leaves_out_as_it_was(server: str, kept: Path) -> None:
    taken = server.rsplit(":", 1)[1]  # the server's own port is in use
    code, output = _record("--url", server, "--out", str(kept), "--listen", f"127.0.0.1:{taken}", "--force",
                           "--duration-s", "1")
    assert code == 2 and "cannot listen on" in output and "free port" in output
    assert kept.read_text() == OLD and _leftovers(kept.parent) == []
    code, output = _record("--url", f"http://127.0.0.1:{free_port()}", "--out", str(kept), "--force",
                           "--listen", f"127.0.0.1:{free_port()}", "--duration-s", "1")
    assert code == 2 and "cannot reach the server" in output
    assert kept.read_text() == OLD and _leftovers(kept.parent) == []


@pytest.mark.parametrize("port", ["99999", "0"])
def test_a_port_out_of_range_is_one_sentence(server: str, tmp_path: Path, port: str) -> None:
    code, output = _record("--url", server, "--out", str(tmp_path / "t.jsonl"), "--listen", f"127.0.0.1:{port}")
    assert code == 2 and f"--listen port {port} is out of range" in output and "1 to 65535" in output
    assert "Traceback" not in output and not (tmp_path / "t.jsonl").exists()


def test_out_is_replaced_only_once_a_request_was_recorded(server: str, kept: Path) -> None:
    nothing = TraceRecorder(server, kept, block_tokens=4, timeout_s=30).start()
    nothing.close()
    assert not nothing.kept and kept.read_text() == OLD and _leftovers(kept.parent) == []

    recorder = TraceRecorder(server, kept, block_tokens=4, timeout_s=30).start()
    try:
        answer = httpx.post(f"http://127.0.0.1:{recorder.port}/v1/completions", timeout=30,
                            json={"model": "m", "prompt": list(range(1, 11)), "max_tokens": 3})
        assert answer.status_code == 200 and "data: [DONE]" in answer.text
        assert kept.read_text() == OLD  # nothing replaced while recording
    finally:
        recorder.close()
    assert recorder.kept and _leftovers(kept.parent) == []
    (kept.parent / "fresh").write_text("")
    assert kept.stat().st_mode == (kept.parent / "fresh").stat().st_mode  # a new file's usual mode, not 0600
    records = list(iter_records(kept, block_tokens=4))
    assert [(r.input_length, r.output_length, len(r.hash_ids)) for r in records] == [(10, 3, 3)]


def test_close_ends_a_request_still_in_flight(trickle: str, tmp_path: Path) -> None:
    recorder = TraceRecorder(trickle, tmp_path / "t.jsonl", timeout_s=600).start()
    outcome: list[object] = []

    def ask() -> None:
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{recorder.port}/v1/completions", timeout=120,
                              json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}) as answer:
                outcome.append(answer.status_code)
                answer.read()
            outcome.append("complete")
        except httpx.HTTPError as exc:
            outcome.append(exc)

    client = threading.Thread(target=ask)
    client.start()
    time.sleep(1.0)
    recorder.close()
    client.join(60)
    assert not client.is_alive(), "close() left the trickled request running"
    assert outcome[0] == 200 and isinstance(outcome[-1], httpx.RemoteProtocolError)  # a cut answer, not a whole one
    assert not recorder.kept and not (tmp_path / "t.jsonl").exists()


def test_a_trickling_server_cannot_hold_the_recording(trickle: str, kept: Path) -> None:
    """--timeout-s bounds each proxied request in all, --duration-s ends the recording on time."""
    port = free_port()
    command = [sys.executable, "-m", "kvtier.cli.main", "trace", "record", "--url", trickle, "--out", str(kept),
               "--force", "--listen", f"127.0.0.1:{port}", "--duration-s", "4", "--timeout-s", "1"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        outcome: list[object] = []
        listening_by = time.monotonic() + 60  # the CLI's start: seconds on a loaded 2-core machine
        while time.monotonic() < listening_by:
            try:
                with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                                  json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}) as answer:
                    outcome.append(answer.status_code)
                    answer.read()
                outcome.append("complete")
                break
            except httpx.ConnectError:
                time.sleep(0.05)  # the proxy is not listening yet
            except httpx.HTTPError as exc:
                outcome.append(exc)
                break
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert outcome[0] == 200 and isinstance(outcome[-1], httpx.RemoteProtocolError)  # cut after --timeout-s
    assert proc.returncode == 0, output
    assert b"no request recorded" in output and b"still holds its previous trace" in output
    assert kept.read_text() == OLD and _leftovers(kept.parent) == []


def test_a_gz_out_is_written_gzipped(server: str, tmp_path: Path) -> None:
    out = tmp_path / "live.jsonl.gz"
    recorder = TraceRecorder(server, out, block_tokens=4, timeout_s=30).start()
    try:
        answer = httpx.post(f"http://127.0.0.1:{recorder.port}/v1/completions", timeout=30,
                            json={"model": "m", "prompt": list(range(1, 11)), "max_tokens": 3})
        assert answer.status_code == 200
    finally:
        recorder.close()
    assert out.read_bytes()[:2] == b"\x1f\x8b"  # gzip magic: readable by simulate, which goes by the name
    assert [(r.input_length, r.output_length) for r in iter_records(out, block_tokens=4)] == [(10, 3)]


def _recording(server: str, out: Path, port: int) -> subprocess.Popen[bytes]:
    """`trace record` started as a script's `cmd &` starts it: SIGINT inherited ignored."""
    command = [sys.executable, "-m", "kvtier.cli.main", "trace", "record", "--url", server, "--out", str(out),
               "--listen", f"127.0.0.1:{port}", "--block-tokens", "4"]
    return subprocess.Popen(["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _one_request(port: int) -> None:
    by = time.monotonic() + 60  # the CLI's start: seconds on a loaded 2-core machine
    while True:
        try:
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                                json={"model": "m", "prompt": list(range(1, 11)), "max_tokens": 3})
            assert answer.status_code == 200
            return
        except httpx.ConnectError:
            assert time.monotonic() < by, "the recording proxy did not listen within 60 s"
            time.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_background_recording_stops_on_sigint_or_sigterm_and_keeps_its_lines(server: str, tmp_path: Path,
                                                                                signum: int) -> None:
    """Started in the background from a script (SIGINT ignored), `trace record` ignored `kill -INT` and
    could only be killed (new user 5): it takes SIGINT back, and on SIGINT or SIGTERM writes what it
    recorded and says so."""
    out, port = tmp_path / "bg.jsonl", free_port()
    proc = _recording(server, out, port)
    try:
        _one_request(port)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    # Ctrl-C is the recording's ordinary end (exit 0); SIGTERM ends it as it ends every kvtier command
    assert proc.returncode == (0 if signum == signal.SIGINT else 128 + signum), stderr
    assert f"{out}: 1 requests recorded".encode() in stdout, stdout
    assert [(r.input_length, r.output_length) for r in iter_records(out, block_tokens=4)] == [(10, 3)]
    assert _leftovers(tmp_path) == []


def test_a_killed_recording_leaves_its_lines_in_the_part_file_it_named(server: str, tmp_path: Path) -> None:
    """SIGKILL cannot be caught: each line is flushed to the .part file the start line names as it is
    recorded, so a kill loses at most a line being written."""
    out, port = tmp_path / "killed.jsonl", free_port()
    proc = _recording(server, out, port)
    try:
        _one_request(port)
        time.sleep(0.5)  # the line is written once the answer was sent (a /tokenize call after it)
        proc.kill()
        stdout, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    (part,) = _leftovers(tmp_path)
    assert f"each line goes to {tmp_path / part} as it is recorded".encode() in stdout, stdout
    assert not out.exists()
    assert [(r.input_length, r.output_length) for r in iter_records(tmp_path / part, block_tokens=4)] == [(10, 3)]


def test_a_client_that_resets_its_connection_prints_no_traceback(server: str, tmp_path: Path,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """A client dropping its connection by a reset (a fresh-user tester saw socketserver's traceback,
    ``ConnectionResetError``, twice during a normal ``bench run`` through the recorder): nothing printed,
    and the recorder goes on recording."""
    import socket
    import struct

    recorder = TraceRecorder(server, tmp_path / "r.jsonl", block_tokens=4, timeout_s=30).start()
    try:
        for _ in range(3):  # a request cut part-way, then a reset (SO_LINGER 0) instead of a close
            sock = socket.create_connection(("127.0.0.1", recorder.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mo")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        time.sleep(0.5)
        answer = httpx.post(f"http://127.0.0.1:{recorder.port}/v1/completions", timeout=30,
                            json={"model": "m", "prompt": list(range(1, 11)), "max_tokens": 3})
        assert answer.status_code == 200
    finally:
        recorder.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err, err
    assert recorder.recorded == 1
