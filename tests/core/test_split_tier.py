"""GuardedTier's SplitTier path (kvtier.core.tiers.guarded) on the shared tiers as the store builds
them, against real servers: no payload copy beyond the one each direction needs.

Copies are counted as the peak of Python-allocated bytes during a call (tracemalloc, every thread)
over the payload bytes: the wrapper's generic path (a plain TierWrapper in between) allocates a
private buffer per read and a private copy per write, which the same measurement sees; bytes the
kernel or obstore hold are not Python's and are not counted.  Figures: scripts/split_copies.py."""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import GetResult, PutResult
from kvtier.core.tiers.buffers import BufferPool
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.split import SplitTier
from kvtier.core.tiers.wrappers import TierWrapper

from .tier_harness import HARNESSES, NS

CHUNK_BYTES = 1 << 20
CHUNKS = 6
PAYLOAD_BYTES = CHUNK_BYTES * CHUNKS
ENCODE_COPIES = {"redis": 0, "s3": 1}
"""Copies a write makes on the tier's own path: the redis tier sends payloads from the caller's
buffers; the s3 tier encodes header + payload into one object (its body is sent as one buffer)."""


def peak_copies(call: Callable[[], list[Any]], want: object) -> float:
    """Peak Python-allocated bytes during ``call()`` over the payload bytes; every result must be ``want``."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        results = call()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert results == [want] * CHUNKS
    return peak / PAYLOAD_BYTES


@pytest.mark.parametrize("name", sorted(ENCODE_COPIES))
def test_shared_tiers_copy_each_payload_only_as_often_as_their_direction_needs(name, request, tmp_path):
    tier = HARNESSES[name](request, tmp_path).make(NS)
    assert isinstance(tier, GuardedTier) and isinstance(tier.inner, SplitTier)
    private = GuardedTier(TierWrapper(tier.inner), tier.deadline_s, tier.transfer_deadline_s, 2, 4, tier.breaker)
    datas = [np.random.default_rng(i).integers(0, 256, CHUNK_BYTES, dtype=np.uint8) for i in range(CHUNKS)]
    dsts = [np.zeros(CHUNK_BYTES, dtype=np.uint8) for _ in range(CHUNKS)]
    try:
        copies = {}
        for path, t in (("split", tier), ("private", private)):
            keys = [ChunkKey(os.urandom(16)) for _ in range(CHUNKS)]
            # nothing reused (not even a buffer an earlier PUT of this call gave back): every copy
            # is into a new buffer, which is what tracemalloc sees
            tier.inner.encode_buffers = BufferPool(0)
            put = peak_copies(lambda t=t, keys=keys: t.put_many(keys, [memoryview(d) for d in datas]),
                              PutResult.STORED)
            t.get_many(keys, [memoryview(d) for d in dsts])  # the redis tier's read buffers exist from now on
            for d in dsts:
                d[:] = 0
            get = peak_copies(lambda t=t, keys=keys: t.get_many(keys, [memoryview(d) for d in dsts]), GetResult.HIT)
            assert all(np.array_equal(a, b) for a, b in zip(datas, dsts, strict=True))
            copies[path] = (put, get)
        want = ENCODE_COPIES[name]
        (split_put, split_get), (private_put, private_get) = copies["split"], copies["private"]
        assert want - 0.05 < split_put < want + 0.5, copies
        assert split_get < 0.5, copies
        # the measurement sees a copy: the wrapper's generic path makes one more in each direction
        assert private_put > split_put + 0.9 and private_get > split_get + 0.9, copies
    finally:
        private.close()  # closes the inner tier too (closing twice is a no-op)
        tier.close()


def peak_of_one(call: Callable[[], Any]) -> tuple[Any, float]:
    """``call()``'s result and its peak Python-allocated bytes over one chunk's."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        result = call()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return result, peak / CHUNK_BYTES


@pytest.mark.parametrize("name", sorted(ENCODE_COPIES))
def test_read_into_through_guarded_tier_copies_no_more_than_get_many(name, request, tmp_path):
    """The blob verb ``read_into`` takes the same split path as ``get_many`` behind GuardedTier:
    the fetch on the wrapper's threads, verified and decoded into the caller's buffer on the
    caller's thread, no Python copy of the payload; the generic path (a TierWrapper in between)
    makes one (a new buffer, then the copy into the caller's)."""
    tier = HARNESSES[name](request, tmp_path).make(NS)
    assert isinstance(tier, GuardedTier) and isinstance(tier.inner, SplitTier)
    private = GuardedTier(TierWrapper(tier.inner), tier.deadline_s, tier.transfer_deadline_s, 2, 4, tier.breaker)
    keys = [ChunkKey(os.urandom(16)) for _ in range(2)]
    datas = [np.random.default_rng(i).integers(0, 256, CHUNK_BYTES, dtype=np.uint8) for i in range(2)]
    dst = np.zeros(CHUNK_BYTES + 4096, dtype=np.uint8)  # longer than the value: a variable-length read
    try:
        assert tier.put_many(keys, [memoryview(d) for d in datas]) == [PutResult.STORED] * 2
        copies = {}
        for path, t in (("split", tier), ("private", private)):
            t.read_into(keys[0], memoryview(dst))  # the redis tier's read buffers exist from now on
            dst[:] = 0
            n, copies[path] = peak_of_one(lambda t=t: t.read_into(keys[1], memoryview(dst)))
            assert n == CHUNK_BYTES and np.array_equal(dst[:CHUNK_BYTES], datas[1]) and not dst[CHUNK_BYTES:].any()
        assert copies["split"] < 0.5 and copies["private"] > 0.9, copies
    finally:
        private.close()
        tier.close()


@pytest.mark.parametrize("name", ["redis-aes", "s3-aes"])
def test_an_encrypting_chain_adds_at_most_its_own_output_buffer(name, request, tmp_path):
    """Issue 36: with ``aes-256-gcm`` a write adds at most the cipher's output (one buffer per
    payload) to the identity path's copies, and a read decrypts straight into the caller's buffer."""
    tier = HARNESSES[name](request, tmp_path).make(NS)
    assert isinstance(tier, GuardedTier) and isinstance(tier.inner, SplitTier)
    datas = [np.random.default_rng(i).integers(0, 256, CHUNK_BYTES, dtype=np.uint8) for i in range(CHUNKS)]
    dsts = [np.zeros(CHUNK_BYTES, dtype=np.uint8) for _ in range(CHUNKS)]
    try:
        keys = [ChunkKey(os.urandom(16)) for _ in range(CHUNKS)]
        tier.inner.encode_buffers = BufferPool(0)
        put = peak_copies(lambda: tier.put_many(keys, [memoryview(d) for d in datas]), PutResult.STORED)
        tier.get_many(keys, [memoryview(d) for d in dsts])
        for d in dsts:
            d[:] = 0
        get = peak_copies(lambda: tier.get_many(keys, [memoryview(d) for d in dsts]), GetResult.HIT)
        assert all(np.array_equal(a, b) for a, b in zip(datas, dsts, strict=True))
        assert put < ENCODE_COPIES[name.split("-")[0]] + 1 + 0.05, put
        assert get < 0.5, get
    finally:
        tier.close()
