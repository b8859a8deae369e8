"""A reset (``TieredStore.clear``, vLLM's external prefix-cache reset), narrated: what each scope
removes, what a restart finds, and what happens to loads, saves and writes in flight."""

import dataclasses
import threading
import time
from pathlib import Path

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.purge import reset_outside
from kvtier.core.store import TieredStore
from kvtier.core.tiers import registry
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.core.tiers.disk.reset import RESET_MARKER, mark_reset, reset_marked
from kvtier.core.tiers.wrappers import SlowTier

from .helpers import CHUNK_BYTES, CHUNK_TOKENS, NS, chain_of, make_store, payload, shared_prefix

LOCAL = registry.reset_tiers("local")  # the cpu and disk tiers


def put_chain(store, chain):
    return store.put(chain, [payload(k) for k in chain])


def chunk_files(store) -> list[Path]:
    return sorted(store.tier("disk").dir.glob("*/*.kvc"))


def test_local_reset_empties_cpu_and_disk_and_a_restart_finds_nothing(tmp_path):
    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=32)
    a, b = chain_of(1, 4), chain_of(2, 4)
    put_chain(store, a)
    put_chain(store, b)  # a spills to disk (write-back), b stays in cpu
    store.flush()
    assert store.lookup(a) == 4 and store.lookup(b) == 4 and len(chunk_files(store)) == 4
    store.drain_changes()

    removed = store.clear(LOCAL)

    assert sorted(removed) == ["cpu", "disk"] and all(r.ok for r in removed.values())
    assert set(removed["cpu"].keys) == set(b) and set(removed["disk"].keys) == set(a)
    assert store.lookup(a) == 0 and store.lookup(b) == 0
    assert chunk_files(store) == []
    assert store.epoch == 1
    delta = store.drain_changes()
    assert delta.full and delta.changes == []  # the mirror replaces its view with nothing
    stats = store.stats()
    assert stats.tier("cpu").reset_chunks == 4 and stats.tier("disk").reset_chunks == 4
    assert stats.tier("cpu").evictions == 4  # a's spill before the reset; the reset itself is no eviction
    store.check_integrity()
    put_chain(store, a)  # recomputed after the reset: stored and served again
    assert store.get(a) == [payload(k) for k in a]
    store.close()
    restarted = make_store(tmp_path, cpu_chunks=4, disk_chunks=32)
    assert restarted.lookup(b) == 0  # b was never written again
    restarted.close()


def test_cpu_scope_keeps_the_disk_tier(tmp_path):
    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=32)
    a, b = chain_of(1, 4), chain_of(2, 4)
    put_chain(store, a)
    put_chain(store, b)
    store.flush()
    store.clear(registry.reset_tiers("cpu"))
    assert store.lookup(b) == 0
    handle = store.prepare_load(a)
    assert handle.tiers == ["disk"] * 4
    store.complete_load(handle, True)
    assert len(chunk_files(store)) == 4
    store.check_integrity()
    store.close()


def test_a_load_in_flight_keeps_its_pages_until_unpinned_and_nothing_serves_them_after(tmp_path):
    store = make_store(None, cpu_chunks=4)
    a = chain_of(1, 4)
    put_chain(store, a)
    handle = store.prepare_load(a)  # pins every page: the loader copies out of them
    epoch = store.epoch

    store.clear(LOCAL)

    assert store.epoch != epoch  # what the loader checks before reporting the load done
    assert store.lookup(a) == 0
    assert [buf.tobytes() for buf in handle.buffers] == [payload(k) for k in a]  # pages not reused under it
    assert put_chain(store, chain_of(2, 4)) == 0  # every page is still pinned: no room yet
    late = store.prepare_load(a)
    assert late.num_chunks == 0  # a doomed page is never served
    store.complete_load(late, True)
    store.complete_load(handle, True)
    assert store.cpu.usage().num_chunks == 0  # freed at the last unpin
    assert store.stats().tier("cpu").load_hit_chunks == 4  # the load itself did happen
    assert put_chain(store, chain_of(2, 4)) == 4
    store.check_integrity()
    store.close()


def test_a_save_reserved_before_a_reset_is_not_published():
    store = make_store(None, cpu_chunks=8)
    a = chain_of(1, 3)
    handle = store.prepare_store(a)
    store.clear(LOCAL)
    for idx, buf in zip(handle.indices, handle.buffers):
        buf[:] = memoryview(payload(a[idx]))
    store.complete_store(handle, True)
    assert store.lookup(a) == 0
    assert store.cpu.usage().used_bytes == 0  # the reserved pages were given back
    store.check_integrity()
    store.close()


def slow_disk_store(tmp_path: Path, put_s: float = 0.0, get_s: float = 0.0) -> TieredStore:
    config = KVTierConfig.from_dict({"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 16 * CHUNK_BYTES / GiB,
                                     "write_mode": "write-through", "disk_path": str(tmp_path / "disk"),
                                     "disk_gib": 64 * (CHUNK_BYTES + HEADER_BYTES) / GiB, "io_threads": 1})
    return TieredStore(config, NS, CHUNK_BYTES, wrap=lambda tier: SlowTier(tier, put_s=put_s, get_s=get_s))


def test_disk_writes_queued_or_running_at_a_reset_do_not_resurrect_their_chunks(tmp_path):
    store = slow_disk_store(tmp_path, put_s=0.2)
    a = chain_of(1, 4)
    put_chain(store, a)  # write-through: four writes queued, the first one running for 0.2 s
    assert store.stats().queued_writes == 4

    store.clear(LOCAL)
    assert store.flush(10)

    assert chunk_files(store) == []  # the running write's file was deleted, the queued ones dropped
    assert store.lookup(a) == 0
    assert store.stats().dropped_saves == 0  # a write the reset made moot is not a dropped save
    store.check_integrity()
    store.close()
    restarted = make_store(tmp_path, cpu_chunks=4, disk_chunks=64)
    assert restarted.lookup(a) == 0
    restarted.close()


def test_a_promotion_racing_a_reset_is_a_miss_and_publishes_nothing(tmp_path):
    store = slow_disk_store(tmp_path, get_s=0.3)
    a = chain_of(1, 2)
    put_chain(store, a)
    assert store.flush(10)
    store.clear(registry.reset_tiers("cpu"))  # a is on disk only now
    handles = []
    reader = threading.Thread(target=lambda: handles.append(store.prepare_load(a)))
    reader.start()  # reads the disk tier for 0.3 s into reserved cpu pages
    disk = store.index.lower[0]
    deadline = time.monotonic() + 10
    while not disk.pins and time.monotonic() < deadline:  # the read started: its chunks are pinned
        time.sleep(0.001)
    store.clear(registry.reset_tiers("cpu"))  # the disk files stay: the read succeeds, and is still dropped
    reader.join(10)
    handle = handles[0]
    assert handle.num_chunks == 0  # read before the reset: dropped, never published
    store.complete_load(handle, True)
    assert store.cpu.usage().used_bytes == 0
    assert store.lookup(a) == 2  # from disk, which this reset kept
    store.check_integrity()
    store.close()


def test_a_reset_marker_clears_the_files_written_after_it_at_the_next_start(tmp_path):
    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=32)
    a = chain_of(1, 4)
    put_chain(store, a)
    assert store.flush_dirty(10) == (4, 0)  # a graceful stop (the worker's shutdown) writes a to disk
    store.close()
    directory = tmp_path / "disk" / NS.digest().hex()
    assert len(list(directory.glob("*/*.kvc"))) == 4
    mark_reset(directory)  # a reset acknowledged by another process; these files landed after it

    restarted = make_store(tmp_path, cpu_chunks=4, disk_chunks=32)

    assert restarted.lookup(a) == 0 and list(directory.glob("*/*.kvc")) == []
    assert not reset_marked(directory)
    restarted.close()


def test_the_disk_reset_hook_marks_and_empties_one_namespace_only(tmp_path):
    other_ns = dataclasses.replace(NS, model="another-model")
    mine = make_store(tmp_path, cpu_chunks=4, disk_chunks=32, write_mode="write-through")
    other = TieredStore(mine.config, other_ns, CHUNK_BYTES)
    a = chain_of(1, 4)
    put_chain(mine, a)
    put_chain(other, a)
    assert mine.flush(10) and other.flush(10)

    result = reset_outside("disk", mine.config, NS.digest())

    assert result is not None and result.ok and sorted(result.keys) == sorted(a)
    assert chunk_files(mine) == [] and len(chunk_files(other)) == 4
    assert (mine.tier("disk").dir / RESET_MARKER).exists()
    mine.clear(LOCAL)  # the store applying the order removes the marker
    assert not (mine.tier("disk").dir / RESET_MARKER).exists()
    assert other.lookup(a) == 4
    for store in (mine, other):
        store.check_integrity()
        store.close()


def test_scope_all_clears_this_namespace_on_the_server_and_no_other(redis_server, key_prefix):
    settings = {"redis_url": redis_server.url, "redis_key_prefix": key_prefix, "shared_deadline_s": 2.0,
                "shared_transfer_deadline_s": 2.0, "redis_timeout_s": 2.0}
    mine, replica = make_store(None, cpu_chunks=8, **settings), make_store(None, cpu_chunks=8, **settings)
    other = TieredStore(mine.config, dataclasses.replace(NS, model="another-model"), CHUNK_BYTES)
    a, b = chain_of(1, 3), chain_of(2, 3)
    put_chain(mine, a)
    put_chain(replica, b)  # the same namespace, written by another process
    put_chain(other, a)
    for store in (mine, replica, other):
        assert store.flush(10)
    client = mine.tier("redis").client
    assert len(client.keys(f"{key_prefix}*")) == 9

    removed = mine.clear(registry.reset_tiers("all"))

    assert removed["redis"].ok and sorted(removed["redis"].keys) == sorted(a + b)
    assert len(client.keys(f"{key_prefix}*")) == 3  # the other namespace's values survive
    fresh = make_store(None, cpu_chunks=8, **settings)
    assert shared_prefix(fresh, a) == 0 and shared_prefix(fresh, b) == 0
    assert shared_prefix(other, a) == 3
    put_chain(other, b)
    assert other.flush(10)
    hook = reset_outside("redis", other.config, other.namespace.digest())  # from outside any store
    assert hook is not None and hook.ok and sorted(hook.keys) == sorted(a + b)
    assert client.keys(f"{key_prefix}*") == []
    for store in (mine, replica, other, fresh):
        store.check_integrity()
        store.close()


def test_an_unreachable_server_makes_the_reset_hook_fail_with_a_reason(key_prefix):
    config = KVTierConfig.from_dict({"redis_url": "redis://127.0.0.1:1", "redis_key_prefix": key_prefix,
                                     "redis_timeout_s": 0.5})
    result = reset_outside("redis", config, NS.digest())
    assert result is not None and not result.ok and "did not list and delete" in result.reason


def test_reset_scopes_follow_the_registry():
    assert registry.reset_tiers("cpu") == [registry.top_tier()]
    assert registry.reset_tiers("local") == registry.local_tiers()
    assert registry.reset_tiers("all") == registry.available_tiers()
