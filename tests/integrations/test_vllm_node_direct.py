"""The worker's loader reading node-tier hits straight into the engine's blocks
(:mod:`kvtier.integrations.vllm.worker.direct`, issue 38): a real pool owner, two real stores
(engine A saves, engine B loads), real tensors as the KV caches, the scheduler's own page
planning, no engine.  The engine-level check (outputs equal to vLLM's prefix cache, a flipped
pool byte recomputed) is tests/integrations/test_vllm_node_tier.py."""

from __future__ import annotations

import torch

from kvtier.core import envelope
from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.keys import ChunkKey, chunk_keys, request_root
from kvtier.core.store import TieredStore
from kvtier.core.tiers.node import protocol
from kvtier.core.tiers.node.tier import NodeTier
from kvtier.core.tiers.wrappers import unwrap
from kvtier.integrations.vllm.cache_groups import GroupKind, GroupSpec
from kvtier.integrations.vllm.protocol import LoadJob
from kvtier.integrations.vllm.scheduler.pages import HybridPlan
from kvtier.integrations.vllm.scheduler.steps import IndexMirror, PagePlanner
from kvtier.integrations.vllm.worker.copy import GroupCopiers
from kvtier.integrations.vllm.worker.direct import DirectTargets
from kvtier.integrations.vllm.worker.layout import detect_layout
from kvtier.integrations.vllm.worker.loader import LoadPath
from kvtier.integrations.vllm.worker.side import AsyncLoader
from tests.integrations.test_vllm_loader import BLOCK, CHUNK, NS, NUM_BLOCKS, _caches
from tests.node_servers import NodeServer
from tests.redis_servers import wait_until


def _engine(server: NodeServer, seed: int) -> tuple[TieredStore, GroupCopiers, HybridPlan, dict[str, torch.Tensor]]:
    """One engine's store (cpu over the node tier) and copiers over a KV cache of random blocks."""
    caches = _caches(seed)
    layout = detect_layout(caches, NUM_BLOCKS, "TEST")
    plan = HybridPlan([GroupSpec(0, GroupKind.FULL, BLOCK, tuple(caches), page_bytes=layout.block_bytes)], CHUNK, 0)
    copiers = GroupCopiers(plan.groups, CHUNK, {0: layout}, caches)
    config = KVTierConfig.from_dict({"chunk_tokens": CHUNK, "cpu_gib": 8 * copiers.page_bytes / GiB,
                                     "tiers": ["cpu", "node"], "node_socket": server.socket,
                                     "shared_deadline_s": 5.0, "shared_transfer_deadline_s": 5.0,
                                     "node_timeout_s": 5.0})
    return TieredStore(config, NS, copiers.page_bytes), copiers, plan, caches


def _saved(server: NodeServer) -> tuple[TieredStore, dict[str, torch.Tensor], list[bytes], HybridPlan]:
    """Engine A saves chunks 0-2 of a four-chunk prompt from its blocks 1..12 into the pool."""
    store, copiers, plan, src = _engine(server, 0)
    chain = [bytes(k) for k in chunk_keys(request_root(NS), list(range(4 * CHUNK)), CHUNK)]
    for page in PagePlanner(plan, IndexMirror(1)).save_pages(chain, 0, 3, [list(range(1, 13))], [], 4 * CHUNK):
        handle = store.prepare_store([ChunkKey(page.key)])
        copiers.save([(page, handle.buffers[0])])
        store.complete_store(handle, True)
    assert store.flush(30.0) and wait_until(lambda: store.stats().tiers["node"].num_chunks >= 3, timeout_s=30)
    return store, src, chain, plan


def _load(store: TieredStore, copiers: GroupCopiers, plan: HybridPlan, chain: list[bytes],
          direct: DirectTargets | None) -> tuple[set[int], set[str]]:
    """B loads tokens 16..256 into its blocks 13..27 (block 12 is its own first 16 tokens); chunk 3
    was never saved.  Returns the blocks reported unfilled and the requests finished."""
    pages = PagePlanner(plan, IndexMirror(1)).load_pages(chain, [[12, *range(13, 28)]], BLOCK, 4 * CHUNK)
    return _run(AsyncLoader(LoadPath(store, copiers, CHUNK, partial=True, wait_s=5.0, direct=direct), threads=1),
                LoadJob("r", pages, BLOCK, 4 * CHUNK, ("node",) * 4))


def _run(loader: AsyncLoader, job: LoadJob) -> tuple[set[int], set[str]]:
    """``job`` (request ``r``) through ``loader`` until it ends: the blocks reported unfilled and the
    requests finished."""
    loader.submit(job)
    finished: set[str] = set()
    errors: set[int] = set()

    def ended() -> bool:
        done, errs, _failed = loader.take()
        finished.update(done)
        errors.update(errs)
        return "r" in finished
    assert wait_until(ended, timeout_s=20)
    loader.shutdown()
    return errors, finished


def test_node_hits_land_in_the_blocks_exactly_and_are_not_promoted(node_server: NodeServer) -> None:
    """Chunk 0 from its second slot (blocks 13..15 <- 2..4), chunks 1 and 2 whole (16..23 <- 5..12),
    every layer, read from the pool into B's blocks: equal to A's; chunk 3's blocks reported
    unfilled; none of the three in B's cpu tier (one copy, no promotion); B's counters say node."""
    a, src, chain, plan = _saved(node_server)
    b, copiers, _, dst = _engine(node_server, 1)
    direct = DirectTargets.of(b, copiers)
    assert direct is not None
    try:
        errors, finished = _load(b, copiers, plan, chain, direct)
        assert finished == {"r"} and errors == set(range(24, 28))
        for layer, t in src.items():
            for s, d in zip(range(2, 13), range(13, 24)):
                assert torch.equal(dst[layer][d], t[s]), (layer, s, d)
        assert [b.cpu.contains(ChunkKey(k)) for k in chain[:3]] == [False, False, False]
        assert b.stats().loaded_tokens["node"] == 3 * CHUNK - BLOCK
        b.check_integrity()
    finally:
        a.close()
        b.close()


def test_a_flipped_pool_byte_ends_the_load_before_that_chunk(node_server: NodeServer) -> None:
    """A byte of chunk 1's payload flipped in the pool: B's load keeps chunk 0 (exact), reports
    chunks 1-3's blocks unfilled (vLLM recomputes them, whatever they hold), counts one corrupt
    chunk of the node tier, and leaves no lease behind."""
    a, src, chain, plan = _saved(node_server)
    b, copiers, _, dst = _engine(node_server, 1)
    try:
        inner = unwrap(a.index.shared[0].tier)
        assert isinstance(inner, NodeTier)
        reply, pool, serial = inner.client.call(protocol.Pin(bytes(inner.namespace), [chain[1]], []))
        (lease, page, nbytes, _gen), = reply.leases
        pool.value(page, nbytes)[envelope.FIXED_BYTES + nbytes // 3] ^= 0x20
        inner.client.release_later(serial, [lease])
        errors, finished = _load(b, copiers, plan, chain, DirectTargets.of(b, copiers))
        assert finished == {"r"} and errors == set(range(16, 28))
        for layer, t in src.items():
            for s, d in zip(range(2, 5), range(13, 16)):
                assert torch.equal(dst[layer][d], t[s]), (layer, s, d)
        assert b.stats().tiers["node"].corrupt_chunks == 1
        assert b.stats().loaded_tokens["node"] == CHUNK - BLOCK
        for engine in (a, b):  # releases ride on an engine's next message; sent now
            client = unwrap(engine.index.shared[0].tier).client  # type: ignore[attr-defined]
            client.flush()
        assert wait_until(lambda: node_server.stats().leases == 0, timeout_s=15), node_server.stats()
    finally:
        a.close()
        b.close()


def test_direct_reads_apply_only_where_the_store_has_the_node_tier(
        node_server: NodeServer) -> None:
    """A store over the node tier gets direct targets; one without a shared tier gets none (its
    hits go through its cpu pages, as before)."""
    store, copiers, _, _ = _engine(node_server, 2)
    assert DirectTargets.of(store, copiers) is not None
    store.close()
    caches = _caches(3)
    layout = detect_layout(caches, NUM_BLOCKS, "TEST")
    plan = HybridPlan([GroupSpec(0, GroupKind.FULL, BLOCK, tuple(caches), page_bytes=layout.block_bytes)], CHUNK, 0)
    own = GroupCopiers(plan.groups, CHUNK, {0: layout}, caches)
    alone = TieredStore(KVTierConfig.from_dict({"chunk_tokens": CHUNK, "cpu_gib": 4 * own.page_bytes / GiB}),
                        NS, own.page_bytes)
    assert DirectTargets.of(alone, own) is None
    alone.close()


def test_pages_of_one_block_are_read_through_tiled_scatters_exactly(node_server: NodeServer) -> None:
    """vLLM's CPU backend: a block of a layer is one run and a chunk is one block, so a page's runs tile
    it layer by layer and its scatter is :meth:`Scatter.tiled` (no run built before the copy).  B
    loads chunks 0-2, saved by A from its blocks 1..3, into its blocks 9, 5, 7: each equal to A's,
    every layer; with a byte of chunk 1 flipped in the pool, chunk 0 lands and chunks 1-2 are
    reported unfilled, one corrupt chunk counted."""
    def engine(seed: int) -> tuple[TieredStore, GroupCopiers, HybridPlan, dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        caches = {f"layer.{i}": torch.randn(NUM_BLOCKS, 2, BLOCK, 64, generator=gen) for i in range(2)}
        layout = detect_layout(caches, NUM_BLOCKS, "TEST")
        plan = HybridPlan([GroupSpec(0, GroupKind.FULL, BLOCK, tuple(caches), page_bytes=layout.block_bytes)], BLOCK, 0)
        copiers = GroupCopiers(plan.groups, BLOCK, {0: layout}, caches)
        config = KVTierConfig.from_dict({"chunk_tokens": BLOCK, "cpu_gib": 8 * copiers.page_bytes / GiB,
                                         "tiers": ["cpu", "node"], "node_socket": node_server.socket,
                                         "shared_deadline_s": 5.0, "shared_transfer_deadline_s": 5.0,
                                         "node_timeout_s": 5.0})
        return TieredStore(config, NS, copiers.page_bytes), copiers, plan, caches

    a, a_copiers, plan, src = engine(0)
    b, copiers, _, dst = engine(1)
    chain = [bytes(k) for k in chunk_keys(request_root(NS, cache_salt="one block"), list(range(4 * BLOCK)), BLOCK)]
    try:
        for page in PagePlanner(plan, IndexMirror(1)).save_pages(chain, 0, 3, [[1, 2, 3]], [], 4 * BLOCK):
            handle = a.prepare_store([ChunkKey(page.key)])
            a_copiers.save([(page, handle.buffers[0])])
            a.complete_store(handle, True)
        assert a.flush(30.0) and wait_until(lambda: a.stats().tiers["node"].num_chunks >= 3, timeout_s=30)
        direct = DirectTargets.of(b, copiers)
        assert direct is not None

        def load() -> tuple[set[int], set[str]]:
            loader = AsyncLoader(LoadPath(b, copiers, BLOCK, partial=True, wait_s=5.0, direct=direct), threads=1)
            pages = PagePlanner(plan, IndexMirror(1)).load_pages(chain, [[9, 5, 7]], 0, 3 * BLOCK)
            job = LoadJob("r", pages, 0, 3 * BLOCK, ("node",) * 3)
            scatter = direct.into(job)(0)
            assert scatter is not None and scatter.tiles is not None
            return _run(loader, job)

        errors, finished = load()
        assert finished == {"r"} and not errors
        for layer, t in src.items():
            for s, d in zip((1, 2, 3), (9, 5, 7)):
                assert torch.equal(dst[layer][d], t[s]), (layer, s, d)
        assert b.stats().loaded_tokens["node"] == 3 * BLOCK
        inner = unwrap(a.index.shared[0].tier)
        assert isinstance(inner, NodeTier)
        reply, pool, serial = inner.client.call(protocol.Pin(bytes(inner.namespace), [chain[1]], []))
        (lease, page, nbytes, _gen), = reply.leases
        pool.value(page, nbytes)[envelope.FIXED_BYTES + nbytes // 2] ^= 0x20
        inner.client.release_later(serial, [lease])
        for t in dst.values():
            t.zero_()
        errors, finished = load()
        assert finished == {"r"} and errors == {5, 7}
        for layer, t in src.items():
            assert torch.equal(dst[layer][9], t[1]), layer
        assert b.stats().tiers["node"].corrupt_chunks == 1
    finally:
        a.close()
        b.close()
