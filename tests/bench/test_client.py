"""The streaming client against a real local HTTP server: timings, sessions, a dying and a hanging server."""

import itertools
import subprocess
import sys
import time

import httpx
import pytest

from kvtier.bench.client import ClientOptions, run_workload
from kvtier.bench.multi_round import multi_round_workload
from kvtier.bench.prefix_repetition import prefix_repetition_workload
from kvtier.bench.results import NOT_SENT
from kvtier.bench.workload import TokenSpace

TOKENS = TokenSpace(seed=0, low=10, high=500)


def exit_reason(proc):
    return lambda: None if proc.poll() is None else f"engine exited with code {proc.returncode}"


def test_times_every_token(server):
    proc, url = server
    w = prefix_repetition_workload(TOKENS, num_requests=4, prefix_len=10, suffix_len=5, num_prefixes=2, output_len=5)
    run = run_workload(w, ClientOptions(url, "m", max_concurrency=2, progress=False), exit_reason(proc))
    assert run.aborted is None
    assert [r.request_id for r in run.results] == [r.request_id for r in w.requests]
    for r in run.results:
        assert r.ok and r.output_tokens == 5 and r.prompt_tokens == 15
        assert len(r.itl_s) == 4  # one gap per token after the first
        assert 0.015 < r.ttft_s < r.e2e_s
        # The gaps are when the client read each token: a client starved on a loaded machine reads
        # several at once (a gap near 0, then a long one), so no single gap is bounded by the server's
        # 0.02 s pacing.  What holds under any load: every gap is a time within the stream, together
        # they span first token to last, and the request lasted the server's 5 paced tokens.
        assert all(gap >= 0 for gap in r.itl_s)
        assert sum(r.itl_s) <= r.e2e_s - r.ttft_s
        assert r.e2e_s > 5 * 0.02 - 0.005
    summary = run.summary()
    assert summary.num_ok == 4 and summary.ttft_s is not None
    assert summary.output_tok_per_s == pytest.approx(20 / run.duration_s)


def test_sessions_wait_for_the_previous_turn_plus_think_time(server):
    proc, url = server
    w = multi_round_workload(TOKENS, num_sessions=2, num_rounds=3, system_len=5, question_len=3, answer_len=3,
                             think_time_s=0.3, session_interval_s=0.1)
    run = run_workload(w, ClientOptions(url, "m", progress=False), exit_reason(proc))
    by_id = {r.request_id: r for r in run.results}
    for s in range(2):
        turns = [by_id[f"session-{s}-turn-{t}"] for t in range(3)]
        assert turns[0].start_s >= 0.1 * s
        for a, b in itertools.pairwise(turns):
            assert b.start_s >= a.start_s + a.e2e_s + 0.3 - 0.01


@pytest.mark.parametrize("server", [["--die-on", "3"]], indirect=True)
def test_a_dying_server_stops_the_run_and_names_the_request(server):
    proc, url = server
    w = prefix_repetition_workload(TOKENS, num_requests=8, prefix_len=10, suffix_len=5, num_prefixes=2, output_len=4)
    run = run_workload(w, ClientOptions(url, "m", max_concurrency=1, progress=False), exit_reason(proc))
    assert run.aborted == "engine exited with code 3"
    assert run.failed_at == ("prefix-2",)
    assert [r.ok for r in run.results[:2]] == [True, True]
    assert not run.results[2].ok
    assert all(r.error.startswith(NOT_SENT) for r in run.results[3:])
    assert run.summary().num_not_sent == 5


@pytest.mark.parametrize("server", [["--hang-on", "2"]], indirect=True)
def test_a_hanging_server_is_reported_as_hung(server):
    proc, url = server
    w = prefix_repetition_workload(TOKENS, num_requests=4, prefix_len=10, suffix_len=5, num_prefixes=2, output_len=4)
    options = ClientOptions(url, "m", max_concurrency=1, stall_timeout_s=1.0, abort_on_stall=True, progress=False)
    t0 = time.perf_counter()
    run = run_workload(w, options, exit_reason(proc))
    assert time.perf_counter() - t0 < 10
    assert run.aborted is not None and run.aborted.startswith("engine hung: request prefix-1")
    assert run.failed_at == ("prefix-1",)
    assert run.results[1].error.startswith("stall")
    assert all(r.error.startswith(NOT_SENT) for r in run.results[2:])


def test_bench_run_prefix_repetition_is_a_bounded_closed_loop_by_default(server):
    _, url = server
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "run", "--url", url, "--workload",
                          "prefix-repetition", "--num-requests", "12", "--prefix-len", "8", "--suffix-len", "4",
                          "--num-prefixes", "3", "--output-len", "3", "--vocab-size", "500", "--no-progress"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "closed loop: at most 4 requests in flight" in out.stdout
    # labelled as what it is, so that doctor's server-side figure does not contradict it
    assert "TTFT (client)" in out.stdout and "from sending each request to its first streamed token" in \
        " ".join(out.stdout.split())
    metrics = httpx.get(url + "/metrics", timeout=5).text
    assert "sse_max_in_flight 4" in metrics  # 12 requests, never more than 4 at once (and the bound was reached)
