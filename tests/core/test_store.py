"""TieredStore scenarios, narrated: spill, promotion, restart, corruption, dropped saves, pins."""

import logging
import os
import threading
import time

import numpy as np
import pytest

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES

from .helpers import CHUNK_BYTES, chain_of, make_store, payload


def put_chain(store, chain):
    return store.put(chain, [payload(k) for k in chain])


def assert_served(store, chain, n):
    out = store.get(chain)
    assert len(out) == n
    assert out == [payload(k) for k in chain[:n]]


def test_put_get_and_longest_prefix(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8)
    a = chain_of(1, 4)
    put_chain(store, a[:3])
    assert store.lookup(a) == 3
    assert_served(store, a, 3)
    assert store.lookup(chain_of(2, 4)) == 0
    store.check_integrity()


def test_chunk_after_a_gap_is_not_a_hit(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8)
    a = chain_of(1, 4)
    put_chain(store, a)
    store.cpu.delete(a[1])
    store.index.policy.remove(a[1])
    assert store.lookup(a) == 1  # chunks 2 and 3 are present but useless without chunk 1
    assert_served(store, a, 1)


def test_cpu_eviction_spills_to_disk_and_get_promotes(tmp_path):
    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=32)
    a, b = chain_of(1, 4), chain_of(2, 4)
    put_chain(store, a)
    put_chain(store, b)  # evicts all of a from cpu: write-back spills it
    store.flush()
    assert store.stats().tier("cpu").evictions == 4
    assert all(store.tier("disk").contains(k) for k in a)
    assert not any(store.cpu.contains(k) for k in a)
    assert store.lookup(a) == 4
    handle = store.prepare_load(a)
    assert handle.tiers == ["disk"] * 4
    store.complete_load(handle, True)
    assert all(store.cpu.contains(k) for k in a)  # promoted
    assert_served(store, a, 4)
    assert store.stats().tier("disk").load_hit_chunks == 4 and store.stats().tier("cpu").load_hit_chunks == 4
    store.flush()
    store.check_integrity()


def test_write_through_writes_every_chunk_at_once(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=32, write_mode="write-through")
    a = chain_of(1, 3)
    put_chain(store, a)
    store.flush()
    assert all(store.cpu.contains(k) and store.tier("disk").contains(k) for k in a)
    store.check_integrity()


def test_restart_still_hits_from_disk(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=32, write_mode="write-through")
    a = chain_of(1, 5)
    put_chain(store, a)
    store.close()
    again = make_store(tmp_path, cpu_chunks=8, disk_chunks=32)
    assert again.lookup(a) == 5
    assert_served(again, a, 5)
    again.flush()
    again.check_integrity()


def test_corrupt_chunk_on_disk_truncates_the_prefix_and_is_counted(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=32, write_mode="write-through")
    a = chain_of(1, 5)
    put_chain(store, a)
    store.close()
    path = store.tier("disk").path(a[2])
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 7] ^= 0x40
    path.write_bytes(bytes(raw))
    again = make_store(tmp_path, cpu_chunks=8, disk_chunks=32)
    handle = again.prepare_load(a)
    assert handle.num_chunks == 2
    assert [b.tobytes() for b in handle.buffers] == [payload(k) for k in a[:2]]
    again.complete_load(handle, True)
    assert again.stats().corrupt_chunks == 1
    assert again.metrics.registry.get_sample_value("kvtier_corrupt_chunks_total", {"tier": "disk"}) == 1
    assert again.lookup(a) == 2  # the bad file is gone; chunks after it are useless
    again.flush()
    again.check_integrity()


def test_failed_load_is_not_a_hit_and_releases_pins(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8)
    a = chain_of(1, 3)
    put_chain(store, a)
    handle = store.prepare_load(a)
    assert store.stats().pinned_chunks == 3
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("transfer to the engine failed")
        finally:
            store.complete_load(handle, success=False)
    assert store.stats().tier("cpu").load_hit_chunks == 0 and store.stats().failed_loads == 1
    store.complete_load(handle, success=True)  # a second completion is a no-op
    assert store.stats().tier("cpu").load_hit_chunks == 0
    store.check_integrity()


def test_pinned_chunks_are_never_evicted(tmp_path):
    store = make_store(tmp_path, cpu_chunks=4)
    a = chain_of(1, 4)
    put_chain(store, a)
    handle = store.prepare_load(a)  # all four pinned
    assert put_chain(store, chain_of(2, 2)) == 0  # no room and nothing evictable: dropped, no wait
    assert store.stats().dropped_saves == 2
    assert [b.tobytes() for b in handle.buffers] == [payload(k) for k in a]
    store.complete_load(handle, True)
    assert put_chain(store, chain_of(2, 2)) == 2
    store.check_integrity()


def test_aborted_save_frees_its_pages(tmp_path):
    store = make_store(tmp_path, cpu_chunks=4)
    a = chain_of(1, 3)
    handle = store.prepare_store(a)
    assert handle.num_chunks == 3 and store.lookup(a) == 0  # reserved pages are invisible
    store.complete_store(handle, success=False)
    assert store.cpu.usage().num_chunks == 0
    store.check_integrity()


def test_full_save_queue_drops_and_counts_without_blocking(tmp_path):
    store = make_store(tmp_path, cpu_chunks=64, disk_chunks=64, write_mode="write-through",
                       save_queue_depth=1, io_threads=1)
    a = chain_of(1, 20)
    finished = threading.Event()

    def save():
        put_chain(store, a)
        finished.set()

    threading.Thread(target=save, daemon=True).start()
    assert finished.wait(10), "a full save queue blocked the caller"
    store.flush()
    stats = store.stats()
    # one write at most in the worker, one in the queue: the rest are dropped, and counted
    assert stats.dropped_saves >= 18
    assert store.metrics.registry.get_sample_value("kvtier_dropped_saves_total") == stats.dropped_saves
    assert store.lookup(a) == 20  # still served from cpu
    store.check_integrity()


def test_disk_tier_evicts_within_its_capacity(tmp_path):
    store = make_store(tmp_path, cpu_chunks=2, disk_chunks=4, write_mode="write-through")
    for p in range(5):
        put_chain(store, chain_of(p, 2))
        store.flush()
    disk = store.tier("disk").usage()
    assert disk.used_bytes <= disk.capacity_bytes and disk.num_chunks == 4
    assert store.stats().tier("disk").evictions == 6
    store.check_integrity()


def test_metrics_count_bytes_and_hits(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8)
    a = chain_of(1, 2)
    put_chain(store, a)
    store.get(a)
    m = store.metrics
    assert m.registry.get_sample_value("kvtier_transfer_bytes_total", {"direction": "engine_to_cpu"}) == 2 * CHUNK_BYTES
    assert m.registry.get_sample_value("kvtier_load_hit_tokens_total", {"tier": "cpu"}) == 2 * store.chunk_tokens
    text = __import__("prometheus_client").generate_latest(m.registry).decode()
    assert "kvtier_config_info" in text and 'kvtier_capacity_bytes{tier="cpu"}' in text


def test_concurrent_loads_and_saves_keep_integrity(tmp_path):
    store = make_store(tmp_path, cpu_chunks=16, disk_chunks=64)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                chain = chain_of(int(rng.integers(0, 12)), int(rng.integers(1, 6)))
                if rng.random() < 0.5:
                    put_chain(store, chain)
                else:
                    out = store.get(chain)
                    assert out == [payload(k) for k in chain[:len(out)]]
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    store.flush()
    store.check_integrity()
    store.close()


def test_two_stores_share_one_disk_directory(tmp_path):
    writer = make_store(tmp_path, cpu_chunks=4, disk_chunks=32, write_mode="write-through")
    reader = make_store(tmp_path, cpu_chunks=4, disk_chunks=32)
    a = chain_of(3, 3)
    put_chain(writer, a)
    writer.flush()
    assert reader.lookup(a) == 0  # a lookup has no side effect: the writer's files are unknown until a rescan
    assert reader.rescan() == 3
    assert reader.lookup(a) == 3
    assert_served(reader, a, 3)
    reader.check_integrity()  # the adopted chunks are in the reader's eviction policy
    assert all(writer.tier("disk").path(k).is_file() for k in a)  # the reader was served the writer's own files


def test_cancelled_load_counts_neither_hit_nor_failure(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8)
    a = chain_of(1, 3)
    put_chain(store, a)
    handle = store.prepare_load(a)
    store.cancel_load(handle)
    stats = store.stats()
    assert stats.tier("cpu").load_hit_chunks == 0 and stats.failed_loads == 0 and stats.pinned_chunks == 0
    store.check_integrity()


def test_chunks_the_engine_already_held_are_not_hits(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8)
    a = chain_of(1, 4)
    put_chain(store, a)
    handle = store.prepare_load(a)
    store.complete_load(handle, True, first_chunk=3)  # the engine's own cache had chunks 0-2
    assert store.stats().tier("cpu").load_hit_chunks == 1
    assert store.metrics.registry.get_sample_value("kvtier_load_hit_tokens_total", {"tier": "cpu"}) == store.chunk_tokens


def test_disk_tier_shrunk_since_last_run_is_trimmed_oldest_first(tmp_path, caplog):
    big = make_store(tmp_path, cpu_chunks=4, disk_chunks=20, write_mode="write-through")
    chains = [chain_of(p, 2) for p in range(6)]
    for chain in chains:
        put_chain(big, chain)
        big.flush()
        for k in chain:  # distinct modification times, in put order
            os.utime(big.tier("disk").path(k), (time.time() - 100 + chains.index(chain), time.time() - 100 + chains.index(chain)))
    big.close()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        small = make_store(tmp_path, cpu_chunks=4, disk_chunks=4)
    assert small.tier("disk").usage().num_chunks == 4
    said = [r.getMessage() for r in caplog.records if "at start-up" in r.getMessage()]
    assert len(said) == 1 and "evicted 8 chunks" in said[0]  # the operator is told, once
    assert small.lookup(chains[-1]) == 2 and small.lookup(chains[0]) == 0
    small.check_integrity()


@pytest.mark.parametrize("cpu_chunks", [0.5, 0.999])  # 0 itself is refused by the config validator (test_config)
def test_cpu_tier_smaller_than_one_chunk_fails_at_start(tmp_path, cpu_chunks):
    with pytest.raises(ConfigError, match="less than one chunk"):
        make_store(tmp_path, cpu_chunks=cpu_chunks, disk_chunks=8)


def test_cpu_tier_larger_than_the_host_fails_at_start(tmp_path):
    with pytest.raises(ConfigError, match="RAM"):
        make_store(tmp_path, cpu_chunks=1 << 40)


def test_disk_tier_smaller_than_one_chunk_fails_at_start(tmp_path):
    with pytest.raises(ConfigError, match="less than one chunk file"):
        make_store(tmp_path, cpu_chunks=4, disk_chunks=1, disk_gib=100 / (1 << 30))


def test_disk_directory_deleted_while_running_is_recreated(tmp_path):
    import shutil

    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=32, write_mode="write-through")
    put_chain(store, chain_of(1, 2))
    store.flush()
    shutil.rmtree(tmp_path / "disk")
    put_chain(store, chain_of(2, 2))  # first write finds the directory gone: forgets the index, recreates it
    store.flush()
    b = chain_of(3, 2)
    put_chain(store, b)
    store.flush()
    assert all(store.tier("disk").path(k).exists() for k in b)
    on_disk = sum(1 for _ in (tmp_path / "disk").rglob("*.kvc"))
    assert store.tier("disk").usage().num_chunks == on_disk
    store.check_integrity()
