"""The shared tiers' buffer pool: exact sizes, bounded idle bytes, and reuse by the s3 tier's writes."""

from __future__ import annotations

import os

import numpy as np

from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import PutResult
from kvtier.core.tiers.buffers import BufferPool, fresh
from kvtier.core.tiers.sharedvalue import HEADER_BYTES

from .tier_harness import HARNESSES, NS


def test_pool_gives_back_exact_sizes_and_keeps_at_most_its_bound():
    pool = BufferPool(max_bytes=3000)
    a, b = pool.take(1000), pool.take(2000)
    assert (len(a), len(b)) == (1000, 2000) and pool.reused == 0
    pool.give([a, b])
    assert len(pool) == 2 and pool.idle_bytes == 3000
    assert pool.take(1000) is a and pool.reused == 1  # the same object, not a new one
    assert pool.take(1500) is not b and len(pool) == 1  # no idle buffer of that size: a fresh one
    pool.give([a, pool.take(1500)])  # 2000 + 1000 + 1500 > 3000: the oldest idle one (b) is dropped
    assert pool.idle_bytes == 2500 and len(pool) == 2 and all(x is not b for x in pool._idle)
    pool.give([fresh(4000)])  # larger than the bound: never kept
    assert pool.idle_bytes <= 3000 and all(len(x) != 4000 for x in pool._idle)
    pool.clear()
    assert len(pool) == 0 and pool.idle_bytes == 0


def test_zeroed_pool_and_fresh_buffers():
    assert bytes(BufferPool(10, zeroed=True).take(8)) == bytes(8)
    view = fresh(16)
    assert view.format == "B" and view.nbytes == 16 and not view.readonly


def test_s3_writes_reuse_their_encode_buffers(request, tmp_path):
    tier = HARNESSES["s3"](request, tmp_path).make(NS)
    try:
        pool = tier.inner.encode_buffers
        payloads = [np.random.default_rng(i).integers(0, 256, 1 << 16, dtype=np.uint8) for i in range(3)]
        reused = []
        for _round in range(2):
            keys = [ChunkKey(os.urandom(16)) for _ in payloads]
            assert tier.put_many(keys, [memoryview(p) for p in payloads]) == [PutResult.STORED] * 3
            # every PUT finished: the objects' buffers are idle again (fewer than 3 where a later
            # object of the call was encoded into the buffer an earlier PUT gave back)
            assert 1 <= len(pool) <= 3 and pool.idle_bytes == len(pool) * (HEADER_BYTES + (1 << 16))
            reused.append(pool.reused)
            dsts = [np.zeros(1 << 16, dtype=np.uint8) for _ in payloads]
            tier.get_many(keys, [memoryview(d) for d in dsts])
            assert all(np.array_equal(p, d) for p, d in zip(payloads, dsts, strict=True))
        assert reused[1] > reused[0]  # the second write took the buffers the first one gave back
    finally:
        tier.close()
