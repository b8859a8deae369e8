"""Plan and pin as one step: the eviction gate (kvtier.core.gate) and early pins.

The vLLM worker drains the store's change feed at the end of a step; the scheduler plans the next
step's loads from that drain (its mirror); the worker pins them at the start of the next step.
Each test replays one interleaving the 300-request soak (``scripts/attribution_check.py``) caught
taking a planned cpu page between that drain and that pin, with real threads, a real disk tier
(slowed, so that its writes end after the drain) and the store's own feed as the mirror, and
runs it twice: ungated (``gated=False``, the store as it was: the planned page is gone, which
shows the interleaving is real) and gated the way :class:`~kvtier.integrations.vllm.worker.side.WorkerSide`
gates it (closed before the drain, opened once the step's loads are pinned: every planned page is
there, and what the gate held back leaves once it opens, in the next drain).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.store import TieredStore
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.core.tiers.wrappers import SlowTier

from .helpers import CHUNK_BYTES, CHUNK_TOKENS, NS, chain_of, payload
from .test_store_changes import mirror_of

WRITE_S = 0.05  # each disk write: ends after the drain that follows the step that queued it


def _store(tmp_path: Path, cpu_chunks: int, spill_watermark: float = 0.0) -> TieredStore:
    config = KVTierConfig.from_dict({"chunk_tokens": CHUNK_TOKENS, "cpu_gib": cpu_chunks * CHUNK_BYTES / GiB,
                                     "disk_path": str(tmp_path / "disk"), "disk_gib": 64 * (CHUNK_BYTES + HEADER_BYTES) / GiB,
                                     "write_mode": "write-back", "spill_watermark": spill_watermark})
    return TieredStore(config, NS, CHUNK_BYTES, wrap=lambda tier: SlowTier(tier, put_s=WRITE_S))


def _drain(store: TieredStore, mirror: dict[ChunkKey, str], gated: bool) -> dict[ChunkKey, str]:
    """The end of a step: the gate closes (when gated), then the feed is drained into the mirror."""
    if gated:
        store.gate_evictions(True)
    return mirror_of(store, mirror)


def _pin_planned(store: TieredStore, mirror: dict[ChunkKey, str], chain: list[ChunkKey], gated: bool) -> int:
    """The next step: a synchronous load of the chunks the mirror puts in the cpu tier (the
    scheduler plans it only when all are there), pinned on the engine's thread with no I/O, its
    bytes checked; then the gate opens.  Returns how many leading planned chunks were held."""
    assert all(mirror.get(k) == "cpu" for k in chain), "the plan: every chunk in the cpu tier"
    handle = store.prepare_load(chain, top_only=True)
    try:
        assert [b.tobytes() for b in handle.buffers] == [payload(k) for k in handle.keys]
        held = handle.num_chunks
    finally:
        store.complete_load(handle, True)
    if gated:
        store.gate_evictions(False)
    return held


@pytest.mark.parametrize("gated", [False, True])
def test_a_spill_ahead_written_after_the_drain_keeps_its_planned_page_until_the_pin(tmp_path: Path, gated: bool) -> None:
    """A writer thread finishing a spill ahead (``evict_after``) evicted its page a few
    milliseconds after the drain: the next step's synchronous load found 4 of 5 planned pages."""
    store = _store(tmp_path, cpu_chunks=8, spill_watermark=0.5)
    mirror: dict[ChunkKey, str] = {}
    chain = chain_of(1, 8)
    store.put(chain, [payload(k) for k in chain])  # the step's save: spills 4 ahead, writes queued
    assert len(store.index.writing) == 4
    mirror = _drain(store, mirror, gated)
    store.flush()  # the writer threads finish after the drain, before the next step
    held = _pin_planned(store, mirror, chain, gated)
    if not gated:
        assert held < len(chain), "the ungated store must show the race (spilled pages evicted)"
        store.close()
        return
    assert held == len(chain)
    after = mirror_of(store, mirror)  # what waited for the gate left once it opened, and is reported
    assert sorted(after.values()) == ["cpu"] * 4 + ["disk"] * 4
    assert store.stats().tiers["cpu"].evictions == 4
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("gated", [False, True])
def test_a_staged_copy_written_after_the_drain_stays_until_the_pin(tmp_path: Path, gated: bool) -> None:
    """A chunk evicted in a write-back store is served from its staged copy until written; the
    last write ending after the drain dropped the copy, and the chunk planned in the cpu tier was
    then on disk only: a synchronous load (no I/O) could not fill it."""
    store = _store(tmp_path, cpu_chunks=4)
    mirror: dict[ChunkKey, str] = {}
    a, b = chain_of(1, 4), chain_of(2, 4)
    store.put(a, [payload(k) for k in a])
    store.put(b, [payload(k) for k in b])  # evicts a: staged copies, writes queued
    assert sorted(store.index.staged) == sorted(a)
    mirror = _drain(store, mirror, gated)
    store.flush()  # written after the drain
    held = _pin_planned(store, mirror, a, gated)
    if not gated:
        assert held == 0, "the ungated store must show the race (staged copies dropped)"
        store.close()
        return
    assert held == len(a)
    store.flush()
    assert not store.index.staged and all(mirror_of(store, mirror)[k] == "disk" for k in a)
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("gated", [False, True])
def test_a_promotion_on_a_loader_thread_after_the_drain_takes_no_planned_page(tmp_path: Path, gated: bool) -> None:
    """A loader thread preparing another request's disk load after the drain took a cpu page for
    its promotion by evicting a chunk the next step's synchronous load was planned from.  Gated,
    the promotion reads into a private buffer (correct bytes, not promoted) and evicts nothing."""
    store = _store(tmp_path, cpu_chunks=4)
    mirror: dict[ChunkKey, str] = {}
    cold, hot = chain_of(1, 4), chain_of(2, 4)
    store.put(cold, [payload(k) for k in cold])
    store.put(hot, [payload(k) for k in hot])  # cold: evicted to disk
    store.flush()
    assert store.flush_dirty(10) == (4, 0)  # hot on disk too: evicting it stages no copy
    mirror = _drain(store, mirror, gated)
    assert all(mirror[k] == "disk" for k in cold) and all(mirror[k] == "cpu" for k in hot)
    got: list[list[bytes]] = []
    loader = threading.Thread(target=lambda: got.append(store.get(cold)), name="kvtier-load_0")
    loader.start()
    loader.join(10)
    assert got == [[payload(k) for k in cold]]
    held = _pin_planned(store, mirror, hot, gated)
    if not gated:
        assert held == 0, "the ungated store must show the race (promotions evicted the hot chunks)"
        store.close()
        return
    assert held == len(hot)
    assert all(not store.cpu.contains(k) for k in cold)  # not promoted: no page was free
    store.check_integrity()
    store.close()


def test_pages_pinned_for_a_load_prepared_later_survive_the_steps_saves(tmp_path: Path) -> None:
    """An asynchronous load is prepared on a loader thread after its step's gate opened; its cpu
    pages are pinned first, on the engine's thread (``pin_resident``), so that the step's saves,
    which may evict, take other pages.  Released with ``cancel_load``: no pin is left, nothing counted."""
    store = _store(tmp_path, cpu_chunks=4)
    a = chain_of(1, 4)
    store.put(a, [payload(k) for k in a])
    store.flush()
    store.gate_evictions(True)
    mirror = mirror_of(store)
    held = store.pin_resident([a[3], chain_of(9, 1)[0], a[0]])  # any order; a chunk not held is skipped
    assert held.pinned == [a[3], a[0]]
    store.gate_evictions(False)
    b = chain_of(2, 2)
    store.put(b, [payload(k) for k in b])  # the step's save needs two pages: a1 and a2 go, not a0 or a3
    assert store.cpu.contains(a[0]) and store.cpu.contains(a[3])
    assert not store.cpu.contains(a[1]) and not store.cpu.contains(a[2])
    handle = store.prepare_load([a[0]], top_only=True)
    assert handle.num_chunks == 1 and mirror[a[0]] == "cpu"
    store.complete_load(handle, True)
    hits = store.stats().tiers["cpu"].load_hit_chunks
    store.cancel_load(held)
    store.cancel_load(held)  # idempotent
    assert store.stats().tiers["cpu"].load_hit_chunks == hits
    store.flush()
    store.check_integrity()
    store.close()
