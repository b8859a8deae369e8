"""The store's change feed (mirror of the index elsewhere), dirty bytes, and the shutdown flush."""

from kvtier.core.changes import IndexDelta

from .helpers import CHUNK_BYTES, chain_of, make_store, payload


def mirror_of(store, mirror=None, max_items=4096):
    """Apply every pending delta to ``mirror`` (key -> tier), as a scheduler-side mirror would."""
    mirror = {} if mirror is None else mirror
    while True:
        delta = store.drain_changes(max_items)
        if delta.full:
            mirror.clear()
        for key, tier in delta.changes:
            if tier is None:
                mirror.pop(key, None)
            else:
                mirror[key] = tier
        if not delta.changes and not store.pending_changes():
            return mirror


def index_of(store):
    out = {k: "disk" for k in (store.tier("disk").keys() if store.tier("disk") else [])}
    out.update({k: "cpu" for k in [*store.cpu.keys(), *store.index.staged]})
    return out


def test_first_drain_is_a_full_snapshot_of_the_disk_index(tmp_path):
    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=32, write_mode="write-through")
    a = chain_of(1, 3)
    store.put(a, [payload(k) for k in a])
    store.close()
    again = make_store(tmp_path, cpu_chunks=4, disk_chunks=32)  # a restart on the same directory
    first = again.drain_changes(1)  # a snapshot is sent whole, whatever max_items says
    assert first.full and sorted(first.changes) == sorted((k, "disk") for k in a)
    assert again.drain_changes() == IndexDelta([], False)


def test_mirror_follows_stores_spills_promotions_and_evictions(tmp_path):
    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=6)
    mirror = mirror_of(store)
    assert mirror == {}
    for p in range(1, 5):  # 16 chunks through a 4-chunk cpu tier and a 6-chunk disk tier
        chain = chain_of(p, 4)
        store.put(chain, [payload(k) for k in chain])
        mirror_of(store, mirror, max_items=3)
    store.flush()
    store.get(chain_of(4, 2))  # promotion back to cpu
    mirror_of(store, mirror)
    assert mirror == index_of(store)
    assert set(mirror.values()) == {"cpu", "disk"}


def test_too_many_changes_turn_into_a_full_resync(tmp_path):
    store = make_store(tmp_path, cpu_chunks=64)
    store.drain_changes()
    store.change_feed_limit = 5
    chain = chain_of(1, 8)
    store.put(chain, [payload(k) for k in chain])
    delta = store.drain_changes(2)
    assert delta.full and len(delta.changes) == 8  # 8 changes > limit 5: the feed forgot them
    assert store.pending_changes() == 0


def test_write_back_dirty_bytes_and_shutdown_flush(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=32)  # write-back: nothing on disk yet
    chain = chain_of(1, 5)
    store.put(chain, [payload(k) for k in chain])
    assert store.dirty_bytes() == 5 * CHUNK_BYTES
    assert store.stats().dirty_bytes == 5 * CHUNK_BYTES
    written, missed = store.flush_dirty(timeout_s=10)
    assert (written, missed) == (5, 0)
    assert store.dirty_bytes() == 0 and all(store.tier("disk").indexed(k) for k in chain)
    store.check_integrity()
    store.close()
    again = make_store(tmp_path, cpu_chunks=8, disk_chunks=32)
    assert again.get(chain) == [payload(k) for k in chain]  # the restart finds the hot set


def test_a_reset_of_the_disk_tier_alone_makes_the_cpu_chunks_dirty_again(tmp_path):
    """After the disk tier alone is reset, the chunks the cpu tier kept are on no local tier: they
    count in dirty bytes and a graceful stop's flush writes them again (the dirty set was only
    narrowed on a resync, so they were lost to the flush)."""
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=32)
    chain = chain_of(1, 4)
    store.put(chain, [payload(k) for k in chain])
    assert store.flush_dirty(timeout_s=10) == (4, 0) and store.dirty_bytes() == 0
    store.clear(["disk"])
    assert store.dirty_bytes() == 4 * CHUNK_BYTES
    assert store.flush_dirty(timeout_s=10) == (4, 0)
    assert store.dirty_bytes() == 0 and all(store.tier("disk").indexed(k) for k in chain)
    store.check_integrity()
    store.close()


def test_flush_that_misses_its_deadline_counts_the_missed_chunks(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=32)
    chain = chain_of(1, 4)
    store.put(chain, [payload(k) for k in chain])
    assert store.flush_dirty(timeout_s=0) == (0, 4)
    assert store.stats().flush_missed_chunks == 4


def test_pinned_chunks_are_visible_while_a_load_holds_them(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8)
    chain = chain_of(1, 3)
    store.put(chain, [payload(k) for k in chain])
    handle = store.prepare_load(chain)
    assert (store.stats().tier("cpu").pinned_chunks, store.stats().tier("disk").pinned_chunks) == (3, 0)
    assert store.metrics.registry.get_sample_value("kvtier_pinned_bytes", {"tier": "cpu"}) == 3 * CHUNK_BYTES
    store.complete_load(handle, True)
    assert (store.stats().tier("cpu").pinned_chunks, store.stats().tier("disk").pinned_chunks) == (0, 0)
    assert store.metrics.registry.get_sample_value("kvtier_pinned_chunks", {"tier": "cpu"}) == 0
