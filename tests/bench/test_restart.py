"""``bench compare --restart-replica-at``: one replica restarted mid-run, against two real local
HTTP servers (tests/bench/sse_server.py, which remembers the prompts it was sent in its process's
memory, as a cpu tier does, and counts prefix hits over them), the restarted one stopped with
SIGTERM and started again on the same port while the workload goes on; and its report.  The same
on real vLLM servers with the node tier: tests/bench/test_live_replicas.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvtier.bench.arms import make_arm
from kvtier.bench.client import ClientOptions, run_workload
from kvtier.bench.compare import ArmOutcome, CompareResult
from kvtier.bench.meters import MetricsSnapshot, deltas, scrape
from kvtier.bench.prefix_repetition import prefix_repetition_workload
from kvtier.bench.replicas import replica_deltas, sum_deltas
from kvtier.bench.report import compare_json, markdown, restart_rows
from kvtier.bench.restart import RestartHook, RestartPlan, Router
from kvtier.bench.workload import TokenSpace
from kvtier.launch.serve import ServerSpec
from tests.bench import sse_server

TOKENS = TokenSpace(seed=0, low=10, high=500)
LATE_S = 6.0
"""When the last two requests are sent, seconds after the run's start (the restart takes < 1 s)."""


def _start(port: int, gap_s: float) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, sse_server.__file__, str(port), "--gap", str(gap_s)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"sse_server on port {port} did not answer")


def _run(w, urls: tuple[str, str], hook: RestartHook, max_concurrency: int):
    """The workload over the two replicas, replica 0 restarted by ``hook``."""
    return run_workload(w, ClientOptions(urls[0], "m", max_concurrency=max_concurrency, progress=False,
                                         replica_urls=urls), restart=hook)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_restarted_replica_is_drained_stopped_started_and_its_turns_go_to_the_live_one(tmp_path: Path) -> None:
    # A B A B A B A B over two replicas: A is replica 0's, B replica 1's; replica 0 streams slowly (1 s a
    # request), so with 3 in flight its requests 0 and 2 are still streaming when request 4 is due
    w = prefix_repetition_workload(TOKENS, num_requests=8, prefix_len=40, suffix_len=5, num_prefixes=2, output_len=5)
    w = type(w)(name=w.name, params=w.params, requests=w.requests[:6] + tuple(
        type(r)(r.request_id, r.prompt_token_ids, r.max_tokens, arrival_s=LATE_S) for r in w.requests[6:]))
    slow, fast = _start(port0 := _free_port(), 0.2), _start(port1 := _free_port(), 0.005)
    procs = [slow, fast]
    urls = (f"http://127.0.0.1:{port0}", f"http://127.0.0.1:{port1}")
    scrapes: list[MetricsSnapshot] = []

    def restart(i: int) -> None:  # as ReplicaSet.restart does with a vLLM server: scrape, SIGTERM, start, scrape
        scrapes.append(scrape(urls[i]))
        procs[i].terminate()
        procs[i].wait(timeout=30)
        procs[i] = _start(port0, 0.2)
        scrapes.append(scrape(urls[i]))

    plan = RestartPlan.at_fraction(0.5, len(w.requests))
    assert (plan.replica, plan.at_request) == (0, 4)
    try:
        before = [scrape(u) for u in urls]
        run = _run(w, urls, RestartHook(plan, restart, drain_timeout_s=30.0), max_concurrency=3)
        after = [scrape(u) for u in urls]
    finally:
        _stop(procs)

    # the planned restart failed no request: request 2, in flight on replica 0 when the restart began,
    # finished before it got SIGTERM
    assert run.aborted is None and run.summary().num_failed == 0, run.failure_text()
    event = run.restart
    assert event is not None and event.error is None and event.back_s is not None
    assert slow.returncode == -15  # the first replica 0 ended by the SIGTERM, not killed
    ends = {r.request_id: r.start_s + (r.e2e_s or 0.0) for r in run.results}
    assert event.began_s < ends["prefix-2"] <= event.stopped_s
    # its turn while it was down (request 4, A) went to the live replica; the late ones came back to it
    assert event.rerouted == ("prefix-4",) and event.back_s < LATE_S
    assert [r.replica for r in run.results] == [0, 1, 0, 1, 1, 1, 0, 1]
    assert [r.request_id for r in run.after_restart()] == ["prefix-6"]

    # replica 0's counters restarted from zero: summed over its two lives they count all its prompts;
    # its memory was lost, so after the restart A (seen twice before) was no hit
    restarts = {0: (scrapes[0], scrapes[1])}
    per_replica = replica_deltas(before, after, restarts)
    lens = {r.request_id: r.prompt_len for r in w.requests}
    assert per_replica[0].prefix_queries == lens["prefix-0"] + lens["prefix-2"] + lens["prefix-6"]
    assert per_replica[1].prefix_queries == sum(lens[f"prefix-{k}"] for k in (1, 3, 4, 5, 7))
    again = deltas(scrapes[1], after[0])
    assert (again.prefix_queries, again.prefix_hits) == (lens["prefix-6"], 0)
    assert per_replica[0].prefix_hits >= 40  # before the restart, request 2 hit A's prefix

    # the report: the restart figures per arm, in the table, the JSON and report.md
    engine = ServerSpec(model="m", max_model_len=1024, cache_tokens=2048)
    outcome = ArmOutcome(make_arm("kvtier", tmp_path), tmp_path / "kvtier.log", 1.0, run, sum_deltas(per_replica),
                         None, replica_meters=tuple(per_replica), restart_meters=again)
    result = CompareResult(workload=w, engine=engine, outcomes=(outcome,), replicas=2, restart=plan)
    figures = compare_json(result)["restart"]
    assert (figures["replica"], figures["at_request"], figures["fraction"]) == (0, 4, 0.5)
    arm = figures["arms"]["kvtier"]
    assert arm["restart_hit_rate"] == 0.0 and arm["restart_requests"] == 1 and arm["restart_rerouted"] == 1
    assert arm["restart_down_s"] == pytest.approx(event.back_s - event.began_s)
    (row,) = restart_rows(result)
    assert row.cells[:5] == ("kvtier", f"{event.back_s - event.began_s:.1f} s", "1", "1", "0.0%")
    page = markdown(result, None, "kvtier bench compare --replicas 2 --restart-replica-at 0.5")
    assert "replica 0 restarted once 4 of 8 requests were sent (--restart-replica-at 0.5)" in page
    assert "| " + " | ".join(row.cells) + " |" in page
    assert compare_json(result)["arms"]["kvtier"]["request_per_s"] == pytest.approx(run.summary().request_per_s)


def test_a_held_plan_sends_the_restarted_replicas_turns_to_it_once_it_answers_again() -> None:
    # A B C A B C over two replicas, one request at a time; replica 0 restarts once 3 were sent.  With
    # hold, its next turn (request 4) waits for it instead of going to replica 1, and nothing is rerouted
    w = prefix_repetition_workload(TOKENS, num_requests=6, prefix_len=40, suffix_len=5, num_prefixes=3, output_len=2)
    procs = [_start(port0 := _free_port(), 0.005), _start(port1 := _free_port(), 0.005)]
    urls = (f"http://127.0.0.1:{port0}", f"http://127.0.0.1:{port1}")

    def restart(i: int) -> None:
        procs[i].terminate()
        procs[i].wait(timeout=30)
        time.sleep(1.0)  # down a while: request 4 is due meanwhile
        procs[i] = _start(port0, 0.005)

    plan = RestartPlan.at_fraction(0.5, len(w.requests), hold=True)
    assert (plan.replica, plan.at_request, plan.hold) == (0, 3, True)
    try:
        run = _run(w, urls, RestartHook(plan, restart, drain_timeout_s=30.0), max_concurrency=1)
    finally:
        _stop(procs)
    assert run.aborted is None and run.summary().num_failed == 0, run.failure_text()
    event = run.restart
    assert event is not None and event.error is None and event.back_s is not None and event.rerouted == ()
    assert [r.replica for r in run.results] == [0, 1, 0, 1, 0, 1]
    assert [r.request_id for r in run.after_restart()] == ["prefix-4"]
    held = next(r for r in run.results if r.request_id == "prefix-4")
    assert held.start_s >= event.back_s > event.stopped_s + 1.0


def _free_port() -> int:
    from kvtier.launch.serve import free_port

    return free_port()


def test_the_router_sends_a_down_replicas_turns_round_robin_over_the_live_ones() -> None:
    ids = [f"r{k}" for k in range(9)]
    router = Router(3, ids, RestartPlan(replica=1, at_request=2, fraction=0.25))
    picked = []
    for rid in ids:
        if router.restart_due():
            assert router.sent == 2
        picked.append(router.pick(rid))
        router.done(picked[-1])
    # from the third request on replica 1 is down: its turns (r4, r7) alternate over 0 and 2
    assert picked == [0, 1, 2, 0, 0, 2, 0, 2, 2]
    assert router.rerouted == ["r4", "r7"] and router.in_flight == [0, 0, 0]
    assert not router.restart_due()  # once only


@pytest.mark.parametrize(("fraction", "requests", "message"), [
    (0.0, 10, "--restart-replica-at 0 must be a share of the workload's requests strictly between 0 and 1"),
    (1.0, 10, "--restart-replica-at 1 must be a share"),
    (float("nan"), 10, "--restart-replica-at nan must be a share"),
    (0.5, 1, "--restart-replica-at needs a workload of 2 requests or more (it has 1)"),
])
def test_a_plan_that_cannot_run_is_refused_in_one_sentence(fraction: float, requests: int, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RestartPlan.at_fraction(fraction, requests)


def test_the_restart_point_keeps_one_request_before_and_one_after() -> None:
    assert RestartPlan.at_fraction(0.001, 300).at_request == 1
    assert RestartPlan.at_fraction(0.5, 300).at_request == 150
    assert RestartPlan.at_fraction(0.999, 300).at_request == 299
