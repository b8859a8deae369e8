"""A graceful stop's flush (``flush_dirty``) gets the dirty chunks onto disk and keeps them there.

Seen in a soak (cpu, disk and redis tiers, write-through): an engine's SIGTERM logged "shutdown flush
wrote 11 dirty chunks to disk in 0.0 s; 4 (0.5 MiB) missed shutdown_flush_s=30.0 and are lost".  Two
causes, neither the deadline: a dirty chunk whose redis write was still in flight was taken for
"already on its way" and passed over; and on a full disk each flush write made room by evicting
what the flush had just written (s3fifo and adaptive evict new chunks first).  Real disk tier, real
redis-server (paused so that its writes hang), disk writes made to fail by a file standing where
their shard directory was.
"""

from __future__ import annotations

import time

import pytest

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


@pytest.mark.parametrize("policy", ["s3fifo", "default"])
def test_a_flush_into_a_full_disk_keeps_what_it_wrote(tmp_path, policy):
    """The soak's store with 128 KiB chunks: a flush of ~20 dirty chunks into a full disk tier kept 2 to 8
    of them under s3fifo and adaptive (the default): each write made room by evicting the chunk the flush
    had written just before (new chunks are those policies' first victims), and the line blamed the
    deadline for it.  The chunks it writes are now pinned until it ends; older chunks make the room."""
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=4, policy=policy, spill_watermark=0.0)
    old, new = chain_of(1, 4), chain_of(2, 3)
    store.put(old, [payload(k) for k in old])
    assert store.flush_dirty(10.0) == (4, 0)  # the disk is full of the old chunks
    for _ in range(3):
        assert len(store.get(old)) == 4  # and they are used: no policy prefers them as victims
    store.put(new, [payload(k) for k in new])
    assert sorted(store.dirty_keys()) == sorted(new)
    assert store.flush_dirty(10.0) == (3, 0)
    disk = store.tier("disk")
    assert [disk.contains(k) for k in new] == [True] * 3  # what a restart finds: the chunks just flushed
    assert sum(disk.contains(k) for k in old) == 1
    store.check_integrity()
    store.close()
