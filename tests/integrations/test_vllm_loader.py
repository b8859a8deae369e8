"""The worker's loader on its own: a real store (cpu over disk), real tensors as the engine's KV
cache, the scheduler's own page planning, and no engine.  One load path for every model: with
one full-attention group a short load keeps its valid prefix and reports the rest as block
errors; as one of several groups it fails whole.  Either way the store counts the tokens under
the tier the plan named (what vLLM was told), and the tokens it could not fill apart."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.keys import ChunkKey, Namespace, chunk_keys, request_root
from kvtier.core.landing import LandingPool
from kvtier.core.store import TieredStore
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.integrations.vllm.cache_groups import GroupKind, GroupSpec
from kvtier.integrations.vllm.protocol import LoadJob
from kvtier.integrations.vllm.scheduler.pages import HybridPlan
from kvtier.integrations.vllm.scheduler.steps import IndexMirror, PagePlanner
from kvtier.integrations.vllm.worker.copy import GroupCopiers
from kvtier.integrations.vllm.worker.finisher import Finisher
from kvtier.integrations.vllm.worker.layout import detect_layout
from kvtier.integrations.vllm.worker.loader import LoadPath, tokens_by_tier
from kvtier.integrations.vllm.worker.side import AsyncLoader
from kvtier.integrations.vllm.worker.syncload import load_now

BLOCK, CHUNK, NUM_BLOCKS = 16, 64, 32  # 4 blocks per chunk
NS = Namespace(model="loader-test", kv_dtype="float32", num_layers=2, num_kv_heads=2, head_size=32,
               layout="test", chunk_tokens=CHUNK)


def _caches(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(NUM_BLOCKS, 2, BLOCK, 64, generator=gen) for i in range(2)}


def _setup(tmp_path: Path) -> tuple[TieredStore, HybridPlan, dict[str, torch.Tensor], list[bytes], list[str]]:
    """Three chunks of a four-chunk prompt saved from engine blocks 1..12 (chunk 3 never saved);
    a two-page cpu tier, so the first chunk lives on disk only.  Returns where each chunk is."""
    src = _caches(0)
    layout = detect_layout(src, NUM_BLOCKS, "TEST")
    plan = HybridPlan([GroupSpec(0, GroupKind.FULL, BLOCK, tuple(src), page_bytes=layout.block_bytes)], CHUNK, 0)
    copiers = GroupCopiers(plan.groups, CHUNK, {0: layout}, src)
    page_bytes = copiers.page_bytes
    config = KVTierConfig.from_dict({"chunk_tokens": CHUNK, "cpu_gib": 2 * page_bytes / GiB,
                                     "disk_path": str(tmp_path / "disk"), "disk_gib": 64 * (page_bytes + HEADER_BYTES) / GiB,
                                     "write_mode": "write-through", "disk_io": "buffered"})
    store = TieredStore(config, NS, page_bytes)
    chain = [bytes(k) for k in chunk_keys(request_root(NS), list(range(4 * CHUNK)), CHUNK)]
    pages = PagePlanner(plan, IndexMirror(1)).save_pages(chain, 0, 3, [list(range(1, 13))], [], 4 * CHUNK)
    for page in pages:  # one by one, as three engine steps would
        handle = store.prepare_store([ChunkKey(page.key)])
        copiers.save([(page, handle.buffers[0])])
        store.complete_store(handle, True)
        store.flush()  # on disk before the next save evicts it from the two cpu pages
    where = ["cpu" if store.cpu.contains(ChunkKey(k)) else "disk" for k in chain[:3]]
    assert where[0] == "disk" and where[2] == "cpu", where
    return store, plan, src, chain, where


def _load(store: TieredStore, plan: HybridPlan, chain: list[bytes], tiers: tuple[str, ...], partial: bool,
          ) -> tuple[dict[str, torch.Tensor], set[str], set[int], set[str]]:
    """Load tokens 16..256 (the engine's own hit is one block) into blocks 13..27 of a fresh cache."""
    dst = _caches(1)
    layout = detect_layout(dst, NUM_BLOCKS, "TEST")
    loader = AsyncLoader(LoadPath(store, GroupCopiers(plan.groups, CHUNK, {0: layout}, dst), CHUNK, partial=partial,
                                  wait_s=5.0), threads=1)
    table = [12] + list(range(13, 28))  # block 12 holds the engine's own first 16 tokens
    pages = PagePlanner(plan, IndexMirror(1)).load_pages(chain, [table], BLOCK, 4 * CHUNK)
    loader.submit(LoadJob("r", pages, BLOCK, 4 * CHUNK, tiers))
    deadline = time.monotonic() + 10
    finished: set[str] = set()
    errors: set[int] = set()
    failed: set[str] = set()
    while "r" not in finished and time.monotonic() < deadline:
        done, errs, fails = loader.take()
        finished |= done
        errors |= errs
        failed |= fails
        time.sleep(0.005)
    loader.shutdown()
    return dst, finished, errors, failed


def test_tokens_split_by_the_planned_tier_of_each_chunk() -> None:
    """The one split the scheduler's hit sources and the worker's loaded tokens share: a run of
    chunks in one tier counts at once, the partial chunks at either end count their tokens only,
    tiers in the order they first appear; a span past the planned chunks is an error."""
    tiers = ("", "cpu", "cpu", "disk", "cpu")
    assert tokens_by_tier(tiers, 100, 450, 128) == {"": 28, "cpu": 256, "disk": 66}
    assert list(tokens_by_tier(tiers, 0, 640, 128).items()) == [("", 128), ("cpu", 384), ("disk", 128)]
    assert tokens_by_tier(tiers, 130, 140, 128) == {"cpu": 10}
    assert tokens_by_tier(tiers, 300, 300, 128) == {} and tokens_by_tier((), 0, 0, 128) == {}
    with pytest.raises(IndexError):
        tokens_by_tier(tiers, 600, 641, 128)


def test_one_group_keeps_the_valid_prefix_and_counts_by_the_planned_tier(tmp_path: Path) -> None:
    store, plan, src, chain, where = _setup(tmp_path)
    # the plan names chunk 1 in the other tier than the one it is in (evicted or promoted since)
    planned = ("disk", "cpu" if where[1] == "disk" else "disk", where[2], "cpu")
    before = store.stats()
    dst, finished, errors, failed = _load(store, plan, chain, planned, partial=True)
    after = store.stats()
    assert finished == {"r"} and not failed
    assert errors == set(range(24, 28))  # chunk 3's blocks: never stored, recomputed by the engine
    # chunk 0 from its second block on (13..15 <- 2..4), chunks 1 and 2 whole (16..23 <- 5..12)
    for layer, t in src.items():
        for s, d in zip(range(2, 13), range(13, 24)):
            assert torch.equal(dst[layer][d], t[s]), (layer, s, d)
    tokens = {t: after.loaded_tokens.get(t, 0) - before.loaded_tokens.get(t, 0) for t in ("cpu", "disk")}
    expected: dict[str, int] = {"cpu": 0, "disk": 0}
    expected["disk"] += CHUNK - BLOCK  # chunk 0, after the engine's own block
    expected[planned[1]] += CHUNK
    expected[planned[2]] += CHUNK
    assert tokens == expected
    assert after.unfilled_tokens["cpu"] - before.unfilled_tokens.get("cpu", 0) == CHUNK  # chunk 3, planned cpu
    assert after.rerouted_chunks - before.rerouted_chunks == 1  # chunk 1 read where it was, labelled as planned
    assert after.load_failed_blocks - before.load_failed_blocks == 4
    store.check_integrity()
    store.close()


def test_a_load_that_must_be_whole_fails_whole(tmp_path: Path) -> None:
    store, plan, _, chain, where = _setup(tmp_path)
    planned = (where[0], where[1], where[2], "cpu")
    before = store.stats()
    _, finished, errors, failed = _load(store, plan, chain, planned, partial=False)
    after = store.stats()
    assert finished == failed == {"r"} and not errors  # several groups: vLLM takes no block ids
    assert sum(after.loaded_tokens.values()) == sum(before.loaded_tokens.values())
    unfilled = {t: after.unfilled_tokens.get(t, 0) - before.unfilled_tokens.get(t, 0) for t in ("cpu", "disk")}
    assert sum(unfilled.values()) == 4 * CHUNK - BLOCK and unfilled["cpu"] >= CHUNK
    store.check_integrity()
    store.close()


def test_a_load_reported_after_a_reset_fails_its_blocks(tmp_path: Path) -> None:
    """A load that ended before the rank applied a reset order but is reported after it (the
    worker takes outcomes after applying the order, in the same step) fails: its filled blocks go
    back to vLLM as load errors and are recomputed, so nothing read before the reset reaches a
    request after it.  A load reported before the reset stays a hit."""
    store, plan, _, chain, where = _setup(tmp_path)
    layout = detect_layout(dst := _caches(1), NUM_BLOCKS, "TEST")
    loader = AsyncLoader(LoadPath(store, GroupCopiers(plan.groups, CHUNK, {0: layout}, dst), CHUNK, partial=True,
                                  wait_s=5.0), threads=1)
    table = [12] + list(range(13, 28))
    pages = PagePlanner(plan, IndexMirror(1)).load_pages(chain, [table], BLOCK, 4 * CHUNK)
    planned = (where[0], where[1], where[2], "cpu")

    def run(req_id: str) -> None:
        loader.submit(LoadJob(req_id, pages, BLOCK, 4 * CHUNK, planned))
        deadline = time.monotonic() + 10
        while loader.num_inflight and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not loader.num_inflight

    never_stored = set(range(24, 28))  # chunk 3: recomputed either way
    run("before")
    assert loader.take() == ({"before"}, never_stored, set())  # reported before the reset: a hit
    before = store.stats().load_failed_blocks
    run("racing")  # ended, not yet reported ...
    store.clear(["cpu"])  # ... when the rank applies the reset order
    assert loader.take() == ({"racing"}, set(range(13, 28)), set())
    assert store.stats().load_failed_blocks - before == 15
    loader.shutdown()
    store.check_integrity()
    store.close()


def test_a_synchronous_load_copies_what_the_cpu_tier_holds_and_never_reads_below_it(tmp_path: Path) -> None:
    """``load_now`` (a synchronous load, on the engine's thread): the pages the cpu tier holds are
    copied into the engine's blocks before it returns; it stops at the first page the cpu tier does
    not hold (no disk read on the engine's thread: that chunk and the rest are block errors, vLLM
    recomputes them) and names that page's chunk, from which the worker drops the step's saves."""
    store, plan, src, chain, where = _setup(tmp_path)
    layout = detect_layout(dst := _caches(1), NUM_BLOCKS, "TEST")
    loader = AsyncLoader(LoadPath(store, GroupCopiers(plan.groups, CHUNK, {0: layout}, dst), CHUNK, partial=True,
                                  wait_s=5.0), threads=1)
    table = list(range(13, 29))
    jobs = PagePlanner(plan, IndexMirror(1))
    before = store.stats()
    # the engine's own hit covers chunks 0-1; chunk 2 is in the cpu tier, chunk 3 was never stored
    tail = LoadJob("t", jobs.load_pages(chain, [table], 2 * CHUNK, 4 * CHUNK), 2 * CHUNK, 4 * CHUNK,
                   ("", "", where[2], "cpu"), sync=True)
    assert load_now(loader.path, tail) == (set(range(25, 29)), 3)
    # the request's facts say where and why it came up short: chunk 3 is new to every tier (the cut its pin met,
    # kept on the handle until the request's context is bound after the copy: syncload.finish_sync)
    assert loader.path.facts.take()["t"].miss == (3 * CHUNK, "new", "cpu")
    for layer, t in src.items():  # chunk 2 = saved from blocks 9..12, now in blocks 21..24
        for s, d in zip(range(9, 13), range(21, 25)):
            assert torch.equal(dst[layer][d], t[s]), (layer, s, d)
    # chunk 0 is only on disk: nothing is read, every block is an error, recomputed from chunk 0
    whole = LoadJob("w", jobs.load_pages(chain, [table], 0, 4 * CHUNK), 0, 4 * CHUNK, ("disk", "cpu", "cpu", "cpu"),
                    sync=True)
    finisher = Finisher()  # the same, its bookkeeping on the finisher's thread: chunk 0 was evicted to disk
    assert load_now(loader.path, whole, finisher) == (set(table), 0)
    assert finisher.join()
    assert loader.path.facts.take()["w"].miss == (0, "evicted", "cpu")  # (evicted from its two pages to disk)
    finisher.close()
    after = store.stats()
    assert after.loaded_tokens.get("cpu", 0) - before.loaded_tokens.get("cpu", 0) == CHUNK
    assert after.transfer_seconds.get("disk_to_cpu", 0.0) == before.transfer_seconds.get("disk_to_cpu", 0.0)
    assert after.load_failed_blocks - before.load_failed_blocks == 4 + 16
    assert loader.take() == (set(), set(), set())  # no finished_recving for a synchronous load
    loader.shutdown()
    store.check_integrity()
    store.close()


def test_a_chunk_read_without_a_cpu_page_fills_the_blocks_from_its_landing_buffer(tmp_path: Path) -> None:
    """Device endpoint (issue 37 item 2), host side: with no cpu page to promote into (the tier full,
    the eviction gate closed), chunk 0 is read from disk into a landing buffer
    (:mod:`kvtier.core.landing`) and the engine's blocks are filled straight from it, exactly; it
    is not promoted, and the buffer is back in the pool once the load ended."""
    store, plan, src, chain, where = _setup(tmp_path)
    store.mover.landing = pool = LandingPool(store.chunk_bytes, 1)
    store.gate_evictions(True)  # both cpu pages stay: no page for chunk 0's read
    dst, finished, errors, failed = _load(store, plan, chain, (where[0], where[1], where[2], "cpu"), partial=True)
    store.gate_evictions(False)
    assert finished == {"r"} and not failed and errors == set(range(24, 28))  # chunk 3: never stored
    for layer, t in src.items():  # chunk 0 from disk (13..15 <- 2..4), chunks 1 and 2 (16..23 <- 5..12)
        for s, d in zip(range(2, 13), range(13, 24)):
            assert torch.equal(dst[layer][d], t[s]), (layer, s, d)
    assert not store.cpu.contains(ChunkKey(chain[0])) and pool.free() == 1
    on_disk = store.tier("disk").get(ChunkKey(chain[0]))
    assert on_disk is not None and pool.region[:store.chunk_bytes].tobytes() == on_disk  # it landed there
    store.check_integrity()
    store.close()
