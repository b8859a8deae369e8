"""The redis tier behind GuardedTier (kvtier.core.tiers.guarded) against real redis-servers: the
wrapper owns deadlines, breaker and latency metrics, while reads and writes keep the tier's own
data path (it implements the wrapper's SplitTier)."""

from __future__ import annotations

import os

import numpy as np
from prometheus_client import CollectorRegistry

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import GetResult, PutResult, TierContext
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.redis import factory as redis_factory
from kvtier.core.tiers.redis import tier as redis_tier
from kvtier.core.tiers.wrappers import unwrap

from ..redis_servers import wait_until
from .tier_harness import make_redis_tier


def test_the_factory_wraps_the_redis_tier_and_the_wrapper_times_its_calls(redis_server, key_prefix):
    registry = CollectorRegistry()
    config = KVTierConfig.from_dict({"redis_url": redis_server.url, "redis_key_prefix": key_prefix})
    tier = redis_factory.from_config(TierContext(config, os.urandom(16), 4096, 1, registry))
    try:
        assert isinstance(tier, GuardedTier) and isinstance(unwrap(tier), redis_tier.RedisTier)
        keys = [ChunkKey(os.urandom(16)) for _ in range(3)]
        datas = [os.urandom(4096) for _ in keys]
        assert tier.put_many(keys, datas) == [PutResult.STORED] * 3
        dsts = [bytearray(4096) for _ in keys]
        assert tier.get_many(keys, [memoryview(d) for d in dsts]) == [GetResult.HIT] * 3
        assert [bytes(d) for d in dsts] == datas
        for op in ("put", "get"):  # the histogram operators already chart, now kept by the wrapper
            assert registry.get_sample_value("kvtier_tier_call_seconds_count", {"tier": "redis", "op": op}) == 1
        wire = tier.wire_stats()
        assert wire.bytes == {"read": 3 * 4096, "write": 3 * 4096}  # the tier's own numbers, merged
    finally:
        tier.close()


def test_reads_reuse_the_tiers_buffers_and_a_late_read_never_lands_in_the_callers(redis_factory, key_prefix):
    server = redis_factory()
    size = 256 << 10
    tier = make_redis_tier(server.url, os.urandom(16), key_prefix, io_threads=1, shared_transfer_deadline_s=1.0,
                           redis_timeout_s=3.0)
    inner = unwrap(tier)
    assert isinstance(inner, redis_tier.RedisTier)
    try:
        keys = [ChunkKey(os.urandom(16)) for _ in range(2)]
        datas = [np.frombuffer(os.urandom(size), dtype=np.uint8) for _ in keys]
        assert tier.put_many(keys, [memoryview(d) for d in datas]) == [PutResult.STORED] * 2
        dsts = [np.zeros(size, dtype=np.uint8) for _ in keys]
        assert tier.get_many(keys, [memoryview(d) for d in dsts]) == [GetResult.HIT] * 2
        pool = inner.read_buffers
        assert len(pool) == 2  # the values were received into the tier's buffers, given back
        reused = pool.reused
        assert tier.get_many(keys, [memoryview(d) for d in dsts]) == [GetResult.HIT] * 2
        assert pool.reused == reused + 2 and len(pool) == 2  # and taken again, not reallocated

        late = [np.zeros(size, dtype=np.uint8) for _ in keys]
        server.pause()
        try:
            assert tier.get_many(keys, [memoryview(d) for d in late]) == [GetResult.MISS] * 2  # past the deadline
        finally:
            server.resume()
        # one thread: once a later read is served, the one given up has finished too (its bytes
        # went to the tier's buffers, and it was never finished into the caller's)
        assert wait_until(lambda: tier.get_many(keys[:1], [memoryview(dsts[0])]) == [GetResult.HIT], timeout_s=10)
        assert not any(d.any() for d in late)
        assert tier.wire_stats().errors["get"] == 1
    finally:
        tier.close()


def test_cluster_writes_in_several_batches_keep_their_order(redis_cluster, key_prefix, monkeypatch):
    # encoded batches are produced on the caller's thread, at most two ahead of the wire
    monkeypatch.setattr(redis_tier, "BATCH_BYTES", 64 << 10)
    tier = make_redis_tier(redis_cluster.url, os.urandom(16), key_prefix, redis_cluster=True)
    try:
        keys = [ChunkKey(os.urandom(16)) for _ in range(7)]
        datas = [os.urandom(40 << 10) for _ in keys]  # one chunk per batch: 7 batches
        assert unwrap(tier)._batches(datas) == [(i, i + 1) for i in range(7)]
        assert tier.put_many(keys[:5], datas[:5]) == [PutResult.STORED] * 5
        assert tier.put_many(keys, datas) == [PutResult.PRESENT] * 5 + [PutResult.STORED] * 2
        assert unwrap(tier).put_many(keys[::-1], datas[::-1]) == [PutResult.PRESENT] * 7  # the bare tier too
        dsts = [bytearray(40 << 10) for _ in keys]
        assert tier.get_many(keys, [memoryview(d) for d in dsts]) == [GetResult.HIT] * 7
        assert [bytes(d) for d in dsts] == datas
        tier.check()
    finally:
        tier.close()
