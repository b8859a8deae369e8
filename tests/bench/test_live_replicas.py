"""``bench compare --replicas 2`` on real vLLM servers (tiny model, dummy weights) and a real
redis-server: two kvtier replicas with local tiers only against two sharing one Redis; and two
sharing the node pool (``kvtier-node``) whose owner the comparison starts.

Workload: 3 prefixes of 1,024 tokens + 64-token suffixes, A B C A B C, one request in flight, so
with round robin over two replicas every prefix comes back on the replica that did NOT compute
it (A: replica 0 then 1; B: 1 then 0; C: 0 then 1).  Without a shared tier nothing can serve it
there (each replica's own tiers hold only what it computed; the test once ran a ``kvtier`` arm of
two such replicas beside the shared one to show its zero hits: two server starts, ~40 s of CI, for
what the round robin's order above already implies); with Redis, each returning prefix's 8 whole
chunks (1,024 tokens) come from what the other replica wrote.  The node-pool test also restarts replica 0 mid-run (``--restart-replica-at``): after
its restart it loads the next prefix it is sent from the pool.  Functional checks only; speed is in
docs/benchmarks.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_layout import WORKER_IN_ENGINE_CORE

# exact counts only, every deadline a minute: it may run beside another engine test
pytestmark = [pytest.mark.engine, pytest.mark.shares_cpu]


def test_two_replicas_reuse_each_others_prefixes_only_through_redis(tmp_path: Path, redis_server,
                                                                    key_prefix: str) -> None:
    from kvtier.bench.arms import make_arm
    from kvtier.bench.compare import run_compare, warmup_workload
    from kvtier.bench.prefix_repetition import prefix_repetition_workload
    from kvtier.bench.report import compare_json
    from kvtier.bench.workload import vocab_token_space
    from kvtier.launch.serve import ServerSpec
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="none")
    tokens = vocab_token_space(seed=0, vocab_size=2048)
    workload = prefix_repetition_workload(tokens, num_requests=6, prefix_len=1024, suffix_len=64, num_prefixes=3,
                                          output_len=2)
    spec = ServerSpec(model=str(model), max_model_len=2048, cache_tokens=2048, enforce_eager=True,
                      env=WORKER_IN_ENGINE_CORE)  # one start-up import less per server (tests/engine_layout.py)
    # generous deadlines: a loaded 2-core machine (another engine test beside it) must not turn a lookup into a miss
    kvtier = {"cpu_gib": 0.05, "redis_key_prefix": key_prefix, "shared_deadline_s": 60.0, "redis_timeout_s": 60.0}
    arms = [make_arm("kvtier-redis", tmp_path, kvtier, redis_server.url)]
    result = run_compare(arms, workload, spec, tmp_path / "out", warmup=warmup_workload(tokens), max_concurrency=1,
                         stall_timeout_s=180.0, start_timeout_s=600.0, progress=False, replicas=2)

    (shared,) = result.outcomes
    assert shared.ok, shared.failure
    assert [r.replica for r in shared.run.results] == [0, 1, 0, 1, 0, 1]  # type: ignore[union-attr]
    assert len(shared.replica_meters) == 2 and all(p.is_file() for p in shared.replica_logs)
    assert [m.prefix_queries for m in shared.replica_meters] == [3 * 1088, 3 * 1088]
    # no prefix came back to the replica that computed it: the engines' own caches served nothing
    assert [m.prefix_hits for m in shared.replica_meters] == [0, 0]
    # shared Redis: replica 0 loads B (computed by replica 1), replica 1 loads A and C (computed by 0)
    assert [m.external_hits for m in shared.replica_meters] == [1024, 2 * 1024]
    assert shared.meters is not None and shared.meters.external_hits == 3 * 1024
    assert shared.meters.prefix_hit_rate == pytest.approx(3 * 1024 / (6 * 1088))
    figures = compare_json(result)["per_replica"]
    assert [r["external_hit_tokens"] for r in figures["kvtier-redis"]] == [1024, 2048]
    # the run's keys were deleted afterwards; nothing outside its prefix was touched
    assert not list(redis_server.client().scan_iter(match=f"{key_prefix}*".encode()))


BACK_WITHIN_S = 600.0
"""How long the restarted replica 0 may take to answer again (the comparison's start timeout): its
turn after the restart waits for it (``RestartPlan.hold``), so the test waits no longer than the
restart takes.  A restart is a server start: 34 s into the run on the CI machine kind; a small8
replica restarted beside a busy one took 62-99 s (docs/benchmarks.md run R).  Before the hold,
the last two requests were sent at a fixed 90 s, idling about 50 s."""


def test_two_replicas_reuse_each_others_prefixes_through_the_node_pool_the_bench_starts(tmp_path: Path) -> None:
    """The ``kvtier-node`` arm: the comparison starts one ``kvtier node serve`` for the run, both
    replicas use its pool, and it is stopped (its pool deleted) afterwards, its log beside theirs.

    With a planned restart (``--restart-replica-at 0.5``, held): replica 0 is restarted (SIGTERM,
    same server started again) once A B C were sent; the fourth request (A) goes to replica 1 as
    before, the fifth (B, replica 0's turn) waits until replica 0 answers again and is sent there
    (the plan's hold: nothing is rerouted), and the restarted replica 0 loads B
    from the pool: its cpu tier is gone, the pool is not.  Its counters start from zero on
    restart, so the replica's figures are summed over its two lives."""
    from kvtier.bench.arms import make_arm
    from kvtier.bench.compare import run_compare, warmup_workload
    from kvtier.bench.prefix_repetition import prefix_repetition_workload
    from kvtier.bench.report import compare_json
    from kvtier.bench.restart import RestartPlan
    from kvtier.bench.shared_node import NodePool
    from kvtier.bench.workload import vocab_token_space
    from kvtier.launch.serve import ServerSpec
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="none")
    tokens = vocab_token_space(seed=0, vocab_size=2048)
    workload = prefix_repetition_workload(tokens, num_requests=6, prefix_len=1024, suffix_len=64, num_prefixes=3,
                                          output_len=2)
    plan = RestartPlan.at_fraction(0.5, len(workload.requests), hold=True)
    assert plan.replica == 0 and plan.at_request == 3
    spec = ServerSpec(model=str(model), max_model_len=2048, cache_tokens=2048, enforce_eager=True,
                      env=WORKER_IN_ENGINE_CORE)  # one start-up import less per server (tests/engine_layout.py)
    kvtier = {"cpu_gib": 0.05, "shared_deadline_s": 60.0, "shared_transfer_deadline_s": 60.0, "node_timeout_s": 60.0}
    pool = NodePool.make(0.0625)
    try:
        arm = make_arm("kvtier-node", tmp_path, kvtier, node_config=pool.extra_config())
        result = run_compare([arm], workload, spec, tmp_path / "out", warmup=warmup_workload(tokens),
                             max_concurrency=1, stall_timeout_s=180.0, start_timeout_s=BACK_WITHIN_S, progress=False,
                             replicas=2, node_pool=pool, restart=plan)
    finally:
        pool.remove()
    (shared,) = result.outcomes
    assert shared.ok, shared.failure
    # the planned restart: replica 0 stopped after A B C, started again; B and C were sent once it was back
    event = shared.run.restart  # type: ignore[union-attr]
    assert event is not None and event.error is None and event.back_s is not None, event
    assert event.down_s is not None and event.rerouted == (), event
    sent = {r.request_id: r.start_s for r in shared.run.results}  # type: ignore[union-attr]
    assert sent["prefix-4"] >= event.back_s and sent["prefix-5"] >= event.back_s, (sent, event)
    assert [r.request_id for r in shared.run.after_restart()] == ["prefix-4"]  # type: ignore[union-attr]
    assert (tmp_path / "out" / "kvtier-node-r0-restarted.log").is_file()
    assert (tmp_path / "out" / "kvtier-node-r0.metrics-restart-before.txt").is_file()
    # after the restart replica 0 computed nothing of B: all of its 1,024 prefix tokens came from the pool
    assert shared.restart_meters is not None and shared.restart_meters.prefix_queries == 1088
    assert shared.restart_meters.external_hits == 1024
    restart_json = compare_json(result)["restart"]
    assert restart_json["at_request"] == 3
    assert restart_json["arms"]["kvtier-node"]["restart_hit_rate"] == pytest.approx(1024 / 1088)
    assert restart_json["arms"]["kvtier-node"]["restart_requests"] == 1
    assert [r.replica for r in shared.run.results] == [0, 1, 0, 1, 0, 1]  # type: ignore[union-attr]
    assert [m.prefix_queries for m in shared.replica_meters] == [3 * 1088, 3 * 1088]
    # one pool: replica 0 loads B (computed by replica 1), replica 1 loads A and C (computed by 0)
    assert [m.external_hits for m in shared.replica_meters] == [1024, 2 * 1024]
    assert shared.meters is not None and shared.meters.external_hits == 3 * 1024
    figures = compare_json(result)["per_replica"]
    assert [r["external_hit_tokens"] for r in figures["kvtier-node"]] == [1024, 2048]
    # the receipts say the node tier served them, and agree with the metrics
    assert shared.receipts is not None and shared.receipts.receipts.tiers() == {"node": 3 * 1024}
    assert shared.receipts.notes() == []
    # the owner's log is beside the servers'; it was stopped and its pool is gone
    log = tmp_path / "out" / "kvtier-node.node.log"
    assert log.is_file() and all(p.parent == log.parent for p in shared.replica_logs)
    assert not pool.dir.exists()
