"""`kvtier bench run`'s verdict agrees with its meters, through the real CLI against the real local
server of tests/bench/sse_server.py: counters that did not move are ``inconclusive`` (as kvtier doctor
says), not "no reuse: hit rate 0.0%"; a --baseline of another workload is refused in one sentence."""

import json
import subprocess
import sys

import pytest

from tests.bench.test_bench_failures import WORKLOAD, bench_run, error_line


@pytest.mark.parametrize("server", [["--frozen-counters"]], indirect=True)
def test_counters_that_did_not_move_are_inconclusive_not_no_reuse(server, tmp_path):
    _, url = server
    out = bench_run(url, "--out", str(tmp_path / "run"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "hit rate - (engine -: 0/0 tokens" in out.stdout
    text = " ".join(out.stdout.split())  # rich wraps at the terminal's width
    assert ("verdict: inconclusive: the server's vllm:prefix_cache_queries did not move between the scrapes (0 prompt "
            "tokens counted), so the hit rate cannot be read; check that --url is the server the requests went to and "
            "that it exports vLLM's prefix-cache counters results:") in text, out.stdout
    assert "no reuse" not in text
    # no hit rate, no figures a later run could be judged against
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["figures"] is None


def test_a_moving_counter_still_gets_its_verdict(server):
    _, url = server
    out = bench_run(url)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "inconclusive" not in out.stdout and "verdict: unjudged: hit rate" in out.stdout, out.stdout


def test_a_baseline_of_another_workload_is_refused_before_any_request(server, tmp_path):
    _, url = server
    base = bench_run(url, "--out", str(tmp_path / "base"))
    assert base.returncode == 0, base.stdout + base.stderr
    summary = tmp_path / "base" / "summary.json"
    other = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "run", "--url", url, "--workload",
                            "multi-round", "--num-sessions", "2", "--num-rounds", "2", "--system-len", "8",
                            "--question-len", "4", "--answer-len", "3", "--think-time", "0", "--vocab-size", "500",
                            "--no-progress", "--baseline", str(summary), "--out", str(tmp_path / "mr")],
                           capture_output=True, text=True, timeout=90, check=False)
    assert error_line(other) == (f"error: --baseline {summary} is a run of the prefix-repetition workload, this is "
                                 "multi-round: TTFTs of different workloads cannot be compared; give a baseline run "
                                 "with --workload multi-round")
    assert not (tmp_path / "mr").exists()  # refused before the run started
    same = bench_run(url, "--baseline", str(summary))
    assert same.returncode == 0 and "verdict: " in same.stdout and "unjudged" not in same.stdout, same.stdout
    assert WORKLOAD[1] == "prefix-repetition"
