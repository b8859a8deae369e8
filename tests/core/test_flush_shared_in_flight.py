"""A graceful stop's flush writes a dirty chunk to disk even while its shared-tier write is in flight.

Seen in a soak (cpu, disk and redis tiers, write-through): an engine's SIGTERM logged "shutdown flush
wrote 11 dirty chunks to disk in 0.0 s; 4 (0.5 MiB) missed shutdown_flush_s=30.0 and are lost". A
dirty chunk (its disk write dropped or failed) whose redis write was still queued or running was
taken for "already on its way" and passed over: the flush ended at once, the chunk was not written
to disk, and the line blamed the deadline.  Real disk tier, real redis-server (paused so that its
writes hang), the disk writes made to fail by a file standing where their shard directory was.
"""

from __future__ import annotations

import time

from .helpers import break_disk_shards, chain_of, make_store, payload


def test_a_dirty_chunk_with_a_shared_tier_write_in_flight_is_flushed_to_disk(tmp_path, redis_factory, key_prefix):
    server = redis_factory()
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=16, tiers=["cpu", "disk", "redis"],
                       redis_url=server.url, redis_key_prefix=key_prefix, write_mode="write-through",
                       io_threads=1, redis_timeout_s=0.5, shared_transfer_deadline_s=0.5)
    disk = store.tier("disk")
    chain = chain_of(1, 2)
    try:
        break_disk_shards(disk, chain)  # their disk writes fail: the chunks stay dirty
        server.pause()  # their redis writes hang, one running and one queued
        assert store.put(chain, [payload(k) for k in chain]) == 2
        deadline = time.monotonic() + 10
        while disk.write_errors < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert disk.write_errors == 2 and sorted(store.dirty_keys()) == sorted(chain)
        assert all(k in store.index.writing for k in chain)  # a write of each still in flight: to redis alone
        for k in chain:  # the disk is writable again
            shard = disk.path(k).parent
            if shard.is_file():
                shard.unlink()
            shard.mkdir(exist_ok=True)
        t0 = time.monotonic()
        assert store.flush_dirty(10.0) == (2, 0)  # both reached the disk, nothing missed
        assert time.monotonic() - t0 < 8.0  # within the redis writes' own bound, not the flush's
        assert all(disk.contains(k) for k in chain) and store.dirty_keys() == []
    finally:
        server.resume()
        store.close()
