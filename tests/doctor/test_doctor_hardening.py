"""Regression tests for ``kvtier doctor`` inputs found by the breaker: corrupt or swapped recordings,
non-finite options, bad URLs, and hostile servers (a slow trickle, an endless body)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from kvtier.core.errors import UserError
from kvtier.doctor import parse_metrics
from kvtier.tools.scrape import MAX_BODY_BYTES, fetch_metrics

DATA = Path(__file__).parent / "data" / "kvtier-cpu"
BEFORE = (DATA / "before.txt").read_text()
AFTER = (DATA / "after.txt").read_text()


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "doctor", *args], capture_output=True,
                          text=True, check=False, timeout=60,
                          env={"COLUMNS": "200", "PATH": "/usr/bin",  # the kvtier under test, not another install
                               **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})})


def _set(text: str, metric: str, value: str) -> str:
    return re.sub(rf"^({re.escape(metric)}\{{.*\}}) .*$", rf"\g<1> {value}", text, flags=re.MULTILINE)


def test_swapped_files_are_refused_in_one_sentence():
    """Two recordings of one server process (the same process_start_time_seconds) given AFTER then BEFORE
    printed the later file's lifetime counters as the interval's, then a warning naming two causes
    (fresh-user tester): the order is plain, so it is refused, naming the order to give."""
    after, before = str(DATA / "after.txt"), str(DATA / "before.txt")
    proc = doctor("--from-files", after, before, "--json")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"error: the files are in the wrong order: {after} was recorded after {before} (the same "
                           f"server process, every counter at or above {before}'s); give --from-files {before} "
                           f"{after}.\n")


def test_counters_going_back_across_a_restart_are_inconclusive_and_say_why(tmp_path):
    """A server restarted between the scrapes (another process_start_time_seconds) has its counters go back
    too: not a swap to refuse, a reading that cannot be judged."""
    restarted = tmp_path / "restarted.txt"
    restarted.write_text(re.sub(r"^process_start_time_seconds .*$", "process_start_time_seconds 1.8e+09", BEFORE,
                                flags=re.MULTILINE))
    proc = doctor("--from-files", str(DATA / "after.txt"), str(restarted), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["verdict"] == "inconclusive"
    assert any("went backwards" in c["message"] and "wrong order" in c["message"] for c in data["checks"])


def test_files_have_no_invented_interval():
    data = json.loads(doctor("--from-files", str(DATA / "before.txt"), str(DATA / "after.txt"), "--json").stdout)
    assert data["interval_s"] is None
    text = doctor("--from-files", str(DATA / "before.txt"), str(DATA / "after.txt")).stdout
    assert "interval unknown" in text and "interval 10 s" not in text


def test_tiny_sample_is_inconclusive(tmp_path):
    small = _set(_set(AFTER, "vllm:prefix_cache_queries_total", "300.0"), "vllm:external_prefix_cache_queries_total",
                 "300.0")
    small = _set(small, "vllm:external_prefix_cache_hits_total", "200.0")
    path = tmp_path / "after.txt"
    path.write_text(small)
    data = json.loads(doctor("--from-files", str(DATA / "before.txt"), str(path), "--json").stdout)
    assert data["verdict"] == "inconclusive"
    assert any("Too small a sample" in c["message"] for c in data["checks"])


@pytest.mark.parametrize("metric, value, words", [
    ("vllm:external_prefix_cache_hits_total", "99999999", "> queries"),
    ("vllm:prefix_cache_queries_total", "NaN", "impossible for a counter"),
    ("vllm:prefix_cache_queries_total", "+Inf", "impossible for a counter"),
    ("vllm:prefix_cache_hits_total", "-5", "impossible for a counter"),
])
def test_impossible_counters_exit_2(tmp_path, metric, value, words):
    path = tmp_path / "after.txt"
    path.write_text(_set(AFTER, metric, value))
    proc = doctor("--from-files", str(DATA / "before.txt"), str(path))
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr


def test_help_and_type_lines_without_samples_are_not_vllm_metrics():
    text = "\n".join(ln for ln in AFTER.splitlines() if not ln.startswith("vllm:prefix_cache_queries")) + "\n"
    assert "# TYPE vllm:prefix_cache_queries_total counter" in text
    with pytest.raises(UserError, match="no vllm:prefix_cache_queries samples"):
        parse_metrics(text, "after")


@pytest.mark.parametrize("args, words", [
    (["--expect-offload-gib", "inf"], "--expect-offload-gib"),
    (["--expect-offload-gib", "nan"], "--expect-offload-gib"),
    (["--expect-offload-gib", "1e300"], "--expect-offload-gib must be from 0 to 1,048,576 GiB"),
    # past float range, --tp crashed the check against --expect-offload-gib with an OverflowError (clifix2)
    (["--expect-offload-gib", "8", "--tp", "1" + "0" * 400], "--tp must be a whole number of GPUs from 1 to 1,024"),
    (["--tp", "1000000000000"], "--tp must be a whole number of GPUs from 1 to 1,024, got 1,000,000,000,000."),
    (["--url", "http://[::1"], "not a valid URL"),
    (["--url", "http://127.0.0.1:99999"], "not a valid URL"),
    (["--url", "http://127.0.0.1:9", "--timeout", "nan"], "--timeout"),
    (["--url", "http://127.0.0.1:9", "--timeout", "-1"], "--timeout"),
    # past any real wait: a reachable server's scrape ended in "OverflowError: timestamp out of range" (tester3)
    (["--url", "http://127.0.0.1:9", "--timeout", "1e300"], "--timeout must be in (0, 86400] seconds, got 1e+300."),
    (["--url", "http://127.0.0.1:9", "--interval", "nan"], "--interval"),
    (["--url", "http://127.0.0.1:9", "--interval", "inf"], "--interval"),
    (["--url", "http://127.0.0.1:9", "--interval", "1e300"], "--interval"),
])
def test_bad_options_exit_2_with_one_line(args, words):
    if "--url" not in args:
        args = ["--from-files", str(DATA / "before.txt"), str(DATA / "after.txt"), *args]
    proc = doctor(*args)
    assert proc.returncode == 2, proc.stdout
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


class _Hostile(BaseHTTPRequestHandler):
    mode: ClassVar[str] = "trickle"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        try:
            if self.mode == "trickle":  # a line every 0.2 s for 20 s: each read is quick, the whole is not
                for _ in range(100):
                    self.wfile.write(b"#\n")
                    self.wfile.flush()
                    time.sleep(0.2)
            else:  # endless body
                line = b"# " + b"x" * 65534 + b"\n"
                while True:
                    self.wfile.write(line)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def hostile_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()


def test_timeout_bounds_the_whole_scrape(hostile_server):
    _Hostile.mode = "trickle"
    start = time.monotonic()
    with pytest.raises(UserError, match="within 1 s"):
        fetch_metrics(hostile_server, timeout_s=1.0)
    assert time.monotonic() - start < 3.0  # per-read timeouts alone would wait the full 20 s


def test_endless_body_is_capped(hostile_server):
    _Hostile.mode = "endless"
    with pytest.raises(UserError, match=f"more than {MAX_BODY_BYTES >> 20} MiB"):
        fetch_metrics(hostile_server, timeout_s=30.0)


def test_the_sample_output_in_docs_doctor_md_is_the_commands():
    """docs/doctor.md's example was stale (an older layout, figures the command no longer prints; fresh-user
    tester): the block is the command it names, run on the recording it names, line for line."""
    import shlex

    text = (Path(__file__).parents[2] / "docs" / "doctor.md").read_text()
    block = text.split("## Example", 1)[1].split("```\n", 2)[1]
    command, *shown = block.splitlines()
    args = shlex.split(command.removeprefix("$ kvtier doctor "))
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "doctor", *args], capture_output=True, text=True,
                          check=False, timeout=60, cwd=Path(__file__).parents[2],
                          env={"COLUMNS": "2000", "PATH": "/usr/bin",
                               **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == shown


def test_file_mode_advice_fits_file_mode(tmp_path):
    """--interval is refused with --from-files, so an inconclusive reading of two files says to record them
    further apart; a file that is not Prometheus text is not asked whether it is a URL."""
    same = doctor("--from-files", str(DATA / "before.txt"), str(DATA / "before.txt"), "--json")
    assert same.returncode == 0, same.stderr
    messages = " ".join(c["message"] for c in json.loads(same.stdout)["checks"])
    assert "No prompt tokens between the scrapes" in messages
    assert "--interval" in messages and "use a longer --interval" not in messages
    assert "record the two snapshots further apart" in messages
    bad = tmp_path / "bad.txt"
    bad.write_text("this is { not prometheus\n")
    proc = doctor("--from-files", str(bad), str(DATA / "after.txt"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is not Prometheus text" in proc.stderr and "/metrics URL" not in proc.stderr
    assert "curl -s http://HOST:PORT/metrics > FILE" in proc.stderr


class _RootMetrics(BaseHTTPRequestHandler):
    """A server with vLLM's layout: /metrics at the root, /v1/... for the OpenAI API, 404 elsewhere."""

    def do_GET(self):
        body = AFTER.encode() if self.path == "/metrics" else b'{"detail":"Not Found"}'
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_an_api_url_with_v1_says_to_give_the_server_root():
    """``--url http://HOST:PORT/v1`` (the OpenAI base URL operators have at hand) answered only 'HTTP 404; is this
    the vLLM server's URL?' (new-operator finding): the sentence names the root URL to give instead."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RootMetrics)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        proc = doctor("--url", f"{root}/v1", "--interval", "0.1")
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == (f"error: {root}/v1 answered HTTP 404: a URL with a path is scraped as given, and vLLM "
                               f"serves its metrics at the server's root; give {root} (kvtier adds /metrics).\n")
        assert fetch_metrics(root) == AFTER  # the URL it names is one that works
    finally:
        server.shutdown()
