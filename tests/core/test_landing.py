"""Landing buffers (kvtier.core.landing): a chunk read from disk when the cpu tier has no page to
give it lands in a reused pool buffer (pinned on a GPU host) instead of a fresh private array, the
bytes are exact, nothing is promoted, and the buffers go back only once the load is released and
its reads have ended."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.landing import LandingPool
from kvtier.core.store import TieredStore
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.core.tiers.wrappers import Fault, FaultyTier

from .helpers import CHUNK_BYTES, CHUNK_TOKENS, NS, chain_of, make_store, payload


def _disk_chain(tmp_path: Path, num_chunks: int) -> list:
    first = make_store(tmp_path, cpu_chunks=16, disk_chunks=32, write_mode="write-through")
    chain = chain_of(7, num_chunks)
    first.put(chain, [payload(k) for k in chain])
    first.close()
    return chain


def _full(store: TieredStore) -> None:
    """Fill the cpu tier with another prompt and close the eviction gate: no page can be freed."""
    other = chain_of(9, 2)
    store.put(other, [payload(k) for k in other])
    store.gate_evictions(True)


def test_reads_without_a_page_land_in_the_pool_exactly_and_are_not_promoted(tmp_path: Path) -> None:
    chain = _disk_chain(tmp_path, 5)
    store = make_store(tmp_path, cpu_chunks=2, disk_chunks=32)
    _full(store)
    pool = store.mover.landing
    before = pool.free()
    handle = store.prepare_load(chain, read_ahead=True)
    assert handle.wait(30.0) and handle.num_chunks == 5
    assert all(pool.owns(b) for b in handle.buffers) and len(handle.landed) == 5
    assert pool.free() == before - 5
    assert [b.tobytes() for b in handle.buffers] == [payload(k) for k in chain]
    store.complete_load(handle, True)
    assert pool.free() == before  # back once the load is released
    assert not any(store.cpu.contains(k) for k in chain)  # under pressure: not promoted
    assert store.stats().tier("disk").load_hit_chunks == 5
    store.gate_evictions(False)
    store.check_integrity()
    store.close()


def test_a_page_when_one_is_free_and_private_buffers_once_the_pool_is_out(tmp_path: Path) -> None:
    chain = _disk_chain(tmp_path, 6)
    store = make_store(tmp_path, cpu_chunks=16, disk_chunks=32)
    handle = store.prepare_load(chain[:2])  # pages free: promoted into them, no landing buffer
    assert handle.landed == [] and not any(store.mover.landing.owns(b) for b in handle.buffers)
    store.complete_load(handle, True)
    assert all(store.cpu.contains(k) for k in chain[:2])
    store.close()
    store = make_store(tmp_path, cpu_chunks=2, disk_chunks=32)
    _full(store)
    store.mover.landing = pool = LandingPool(CHUNK_BYTES, 2)
    handle = store.prepare_load(chain, read_ahead=True)
    assert handle.wait(30.0) and handle.num_chunks == 6
    assert [pool.owns(b) for b in handle.buffers] == [True, True, False, False, False, False]
    assert pool.free() == 0  # never waited for: the rest read into the index's private buffers
    assert [b.tobytes() for b in handle.buffers] == [payload(k) for k in chain]
    store.cancel_load(handle)
    assert pool.free() == 2
    store.cancel_load(handle)  # idempotent: nothing given back twice
    assert pool.free() == 2
    store.close()


def test_buffers_of_a_load_released_while_reading_ahead_come_back_after_the_reads(tmp_path: Path) -> None:
    chain = _disk_chain(tmp_path, 6)
    values = {"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 2 * CHUNK_BYTES / GiB, "write_mode": "write-back",
              "disk_path": str(tmp_path / "disk"), "disk_gib": 32 * (CHUNK_BYTES + HEADER_BYTES) / GiB}
    slow = Fault("get", "delay", keys=frozenset(chain[2:]), delay_s=0.3)  # the read-ahead's chunks
    store = TieredStore(KVTierConfig.from_dict(values), NS, CHUNK_BYTES, wrap=lambda t: FaultyTier(t, [slow]))
    _full(store)
    store.mover.landing = pool = LandingPool(CHUNK_BYTES, 8)
    handle = store.prepare_load(chain, read_ahead=True)
    assert handle.pending is not None and not handle.pending.done()
    store.complete_load(handle, False)  # released while the tail is still being read into its buffers
    assert pool.free() == 2  # the tail's buffers are still being written: not back yet
    handle.pending.result(timeout=30.0)
    assert pool.free() == 8
    store.close()


def test_pool_bounds_and_foreign_buffers() -> None:
    pool = LandingPool(5000, 3)
    taken = [pool.take() for _ in range(3)]
    assert pool.take() is None and all(t is not None and t.nbytes == 5000 for t in taken)
    assert all(t.ctypes.data % 4096 == 0 for t in taken if t is not None)  # O_DIRECT reads go straight in
    with pytest.raises(ValueError, match="not one of its buffers"):
        pool.give([np.empty(5000, np.uint8)])
    pool.give([t for t in taken if t is not None])
    assert pool.free() == 3
    assert LandingPool.sized(1 << 30).num_buffers == 2 and LandingPool.sized(1024).num_buffers == 1024
    with pytest.raises(ValueError, match="chunk_bytes > 0"):
        LandingPool(0, 1)


def test_pinning_goes_through_the_cpu_tier_and_says_why_not_without_cuda() -> None:
    """On a host without a CUDA device the pool is not pinned: one sentence why, nothing registered;
    with one, it is registered through the cpu tier (RegistersMemory) and unregistered with it."""
    import torch

    store = make_store(None, cpu_chunks=2)
    pool = store.mover.landing
    why = pool.pin(store.cpu)
    if torch.cuda.is_available():
        assert why is None and pool.pinned
        assert (int(pool.region.ctypes.data), pool.region.nbytes) in store.cpu.registered_memory()
    else:
        assert why is not None and ("CUDA" in why or "torch" in why) and not pool.pinned
        assert store.cpu.registered_memory() == []
    store.close()
