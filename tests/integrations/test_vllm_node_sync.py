"""Synchronous node-tier hits (issue 38: a node load costs about what a cpu-tier load does): a hit
planned in the cpu tier and the node pool only is loaded on the engine's thread, before the
forward (:func:`~kvtier.integrations.vllm.worker.syncload.load_now`), the pin's round
trip bounded by ``shared_deadline_s``.  A real pool owner, two real stores (engine A saves, engine B
loads), real tensors as the KV caches; the engine-level check is
tests/integrations/test_vllm_node_tier.py's sync test."""

from __future__ import annotations

import time

import torch

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.protocol import LoadJob
from kvtier.integrations.vllm.scheduler.pages import HybridPlan
from kvtier.integrations.vllm.scheduler.setup import sync_tiers
from kvtier.integrations.vllm.scheduler.side import SyncBudget
from kvtier.integrations.vllm.scheduler.steps import IndexMirror, PagePlanner
from kvtier.integrations.vllm.worker.direct import DirectTargets
from kvtier.integrations.vllm.worker.loader import LoadPath
from kvtier.integrations.vllm.worker.side import AsyncLoader
from kvtier.integrations.vllm.worker.syncload import load_now
from tests.integrations.test_vllm_loader import BLOCK, CHUNK, NS
from tests.integrations.test_vllm_node_direct import _engine, _saved
from tests.node_servers import NodeServer

DEADLINE_S = 0.25  # shared_deadline_s's default


def _sync_engine(server: NodeServer) -> tuple[TieredStore, AsyncLoader, dict[str, torch.Tensor]]:
    """Engine B as an engine runs it: the default deadlines, a short breaker probe, direct reads."""
    _, copiers, _, caches = _engine(server, 1)
    config = KVTierConfig.from_dict({"chunk_tokens": CHUNK, "cpu_gib": 8 * copiers.page_bytes / GiB,
                                     "tiers": ["cpu", "node"], "node_socket": server.socket,
                                     "node_breaker_probe_s": 0.5})
    store = TieredStore(config, NS, copiers.page_bytes)
    loader = AsyncLoader(LoadPath(store, copiers, CHUNK, partial=True, wait_s=5.0, direct=DirectTargets.of(store, copiers),
                                  sync_within_s=config.shared_deadline_s), threads=1)
    return store, loader, caches


def _job(chain: list[bytes], plan: HybridPlan) -> LoadJob:
    """Tokens 16..192 (chunks 0-2, planned in the node tier) into B's blocks 13..23 (block 12: its own)."""
    pages = PagePlanner(plan, IndexMirror(1)).load_pages(chain, [[12, *range(13, 24)]], BLOCK, 3 * CHUNK)
    return LoadJob("r", pages, BLOCK, 3 * CHUNK, ("node",) * 3, sync=True)


def test_a_sync_node_hit_lands_in_the_blocks_exactly_on_the_callers_thread(node_server: NodeServer) -> None:
    """``load_now`` of a node-planned hit: every block equal to A's, none unfilled, nothing in
    flight afterwards (no finished_recving to report), counted as node tokens, not promoted."""
    a, src, chain, plan = _saved(node_server)
    b, loader, dst = _sync_engine(node_server)
    try:
        errors, first_unfilled = load_now(loader.path, _job(chain, plan))
        assert (errors, first_unfilled) == (set(), None)
        for layer, t in src.items():
            for s, d in zip(range(2, 13), range(13, 24)):
                assert torch.equal(dst[layer][d], t[s]), (layer, s, d)
        assert loader.take() == (set(), set(), set()) and loader.num_inflight == 0
        assert b.stats().loaded_tokens["node"] == 3 * CHUNK - BLOCK
        assert [b.cpu.contains(ChunkKey(k)) for k in chain[:3]] == [False, False, False]
        b.check_integrity()
    finally:
        loader.shutdown()
        a.close()
        b.close()


def test_a_stalled_owner_costs_a_sync_load_at_most_the_deadline_then_nothing(node_server: NodeServer) -> None:
    """The owner SIGSTOPped: each synchronous load gives up within ``shared_deadline_s`` (its
    blocks unfilled: vLLM recomputes them) until ``node_breaker_failures`` (3) such loads open the
    breaker; the next costs no wait at all.  Resumed, a probe after ``node_breaker_probe_s``
    serves the hit again, exactly."""
    a, src, chain, plan = _saved(node_server)
    b, loader, dst = _sync_engine(node_server)
    every_block = set(range(13, 24))
    try:
        assert load_now(loader.path, _job(chain, plan)) == (set(), None)  # connected, pool mapped
        node_server.pause()
        for _ in range(3):
            t0 = time.perf_counter()
            errors, first_unfilled = load_now(loader.path, _job(chain, plan))
            took_s = time.perf_counter() - t0
            assert (errors, first_unfilled) == (every_block, 0)
            assert DEADLINE_S * 0.9 <= took_s < DEADLINE_S + 0.2, took_s
        t0 = time.perf_counter()
        assert load_now(loader.path, _job(chain, plan)) == (every_block, 0)
        assert time.perf_counter() - t0 < 0.05  # the breaker is open: a miss at once
        node_server.resume()
        time.sleep(1.0)  # past node_breaker_probe_s (and the client's timeout of its stalled call)
        for layer in dst.values():
            layer[13:24].zero_()
        deadline = time.monotonic() + 10.0
        while load_now(loader.path, _job(chain, plan)) != (set(), None):  # the probe may meet the stale call's end
            assert time.monotonic() < deadline
            time.sleep(0.5)
        for layer, t in src.items():
            for s, d in zip(range(2, 13), range(13, 24)):
                assert torch.equal(dst[layer][d], t[s]), (layer, s, d)
        b.check_integrity()
    finally:
        node_server.resume()
        loader.shutdown()
        a.close()
        b.close()


def test_a_dead_owner_is_a_sync_miss_at_once(node_server: NodeServer) -> None:
    """The owner SIGKILLed: a synchronous load misses without waiting (connection refused)."""
    a, _src, chain, plan = _saved(node_server)
    b, loader, _dst = _sync_engine(node_server)
    try:
        node_server.kill()
        t0 = time.perf_counter()
        assert load_now(loader.path, _job(chain, plan)) == (set(range(13, 24)), 0)
        assert time.perf_counter() - t0 < 0.1
    finally:
        loader.shutdown()
        a.close()
        b.close()


def test_node_pool_hits_are_offered_synchronously_only_where_configured(node_server: NodeServer) -> None:
    """The scheduler's budget: cpu + node hits are promised a synchronous load by default; with
    ``sync_shared_loads: false``, or a redis tier (no answer from host memory), only cpu hits are."""
    base = {"chunk_tokens": CHUNK, "cpu_gib": 1.0}
    node = KVTierConfig.from_dict(base | {"tiers": ["cpu", "node"], "node_socket": node_server.socket})
    off = KVTierConfig.from_dict(base | {"tiers": ["cpu", "node"], "node_socket": node_server.socket,
                                         "sync_shared_loads": False})
    redis = KVTierConfig.from_dict(base | {"tiers": ["cpu", "redis"], "redis_url": "redis://127.0.0.1:1"})
    assert sync_tiers(node) == {"cpu", "node"}
    assert sync_tiers(off) == sync_tiers(redis) == {"cpu"}
    budget = SyncBudget(1 << 20, 1, sync_tiers(node), CHUNK)
    assert budget.offer("r", ["cpu", "node", "node"], 0, 3 * CHUNK)
    assert not budget.offer("s", ["cpu", "node", "disk"], 0, 3 * CHUNK)
    assert not SyncBudget(1 << 20, 1, sync_tiers(off), CHUNK).offer("r", ["cpu", "node"], 0, 2 * CHUNK)
