"""Read-ahead: a load whose tail lives on disk returns after the first chunks are read, and the
rest arrive in cpu pages in the background (``prepare_load(read_ahead=True)``)."""

from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES

from .helpers import chain_of, make_store, payload


def on_disk_only(tmp_path, num_chunks, io_threads=2):
    """A store whose chunks of one chain live only on disk (written through, then restarted)."""
    first = make_store(tmp_path, cpu_chunks=16, disk_chunks=32, write_mode="write-through")
    chain = chain_of(7, num_chunks)
    first.put(chain, [payload(k) for k in chain])
    first.close()
    return make_store(tmp_path, cpu_chunks=16, disk_chunks=32, io_threads=io_threads), chain


def flip(store, key):
    path = store.tier("disk").path(key)
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 3] ^= 0x10
    path.write_bytes(bytes(raw))


def test_tail_is_read_ahead_and_served_verified(tmp_path):
    store, chain = on_disk_only(tmp_path, 6)
    handle = store.prepare_load(chain, read_ahead=True)
    # io_threads chunks read first; the read-ahead thread may have read more batches by now
    assert handle.pending is not None and 2 <= handle.ahead_from <= 6
    assert 2 <= handle.ready_chunks() <= 6
    head = [b.tobytes() for b in handle.buffers[:handle.ready_chunks()]]
    assert head == [payload(k) for k in chain[:len(head)]]
    assert handle.wait(30.0) and handle.num_chunks == handle.ready_chunks() == 6
    assert [b.tobytes() for b in handle.buffers] == [payload(k) for k in chain]
    store.complete_load(handle, True)
    assert store.stats().tier("disk").load_hit_chunks == 6
    assert store.lookup(chain) == 6 and all(store.cpu.contains(k) for k in chain)  # promoted
    store.check_integrity()
    store.close()


def test_corrupt_chunk_read_ahead_ends_the_prefix(tmp_path):
    store, chain = on_disk_only(tmp_path, 6)
    flip(store, chain[4])
    handle = store.prepare_load(chain, read_ahead=True)
    assert handle.wait(30.0) and handle.num_chunks == 4
    assert [b.tobytes() for b in handle.buffers] == [payload(k) for k in chain[:4]]
    store.complete_load(handle, True)
    assert store.stats().corrupt_chunks == 1 and store.stats().tier("disk").load_hit_chunks == 4
    store.check_integrity()
    store.close()


def test_corrupt_chunk_before_the_read_ahead_gives_its_pages_back(tmp_path):
    store, chain = on_disk_only(tmp_path, 6)
    flip(store, chain[1])
    handle = store.prepare_load(chain, read_ahead=True)
    assert handle.pending is None and handle.num_chunks == 1
    store.complete_load(handle, True)
    assert store.cpu.usage().num_chunks == 1  # no page left reserved for the chunks after the bad one
    store.check_integrity()
    store.close()


def test_load_cancelled_during_read_ahead_leaves_no_pins(tmp_path):
    store, chain = on_disk_only(tmp_path, 8)
    handle = store.prepare_load(chain, read_ahead=True)
    store.cancel_load(handle)  # before the tail has arrived: unpinned once the reads end
    assert handle.wait(30.0)
    assert store.stats().pinned_chunks == 0 and store.stats().tier("disk").load_hit_chunks == 0
    store.check_integrity()
    store.close()


def test_get_serves_a_disk_prefix_through_read_ahead(tmp_path):
    store, chain = on_disk_only(tmp_path, 7, io_threads=1)
    assert store.get(chain) == [payload(k) for k in chain]
    assert store.stats().tier("disk").load_hit_chunks == 7
    store.check_integrity()
    store.close()


def test_read_ahead_in_batches_stops_at_a_corrupt_chunk_and_gives_the_rest_back(tmp_path):
    """io_threads=1: the tail is read one chunk per batch; ``ready_chunks`` only grows, never past a
    chunk that failed verification, and the batches after it release their pins and pages."""
    store, chain = on_disk_only(tmp_path, 7, io_threads=1)
    flip(store, chain[4])
    handle = store.prepare_load(chain, read_ahead=True)
    # prepare_load reads chunk 0 itself; the read-ahead thread may have read more by now (under load it
    # runs before this line), never past the corrupt chunk 4
    assert 1 <= handle.ahead_from <= 4
    seen = [handle.ready_chunks()]
    while not handle.wait(0.0005):
        seen.append(handle.ready_chunks())
    seen.append(handle.ready_chunks())
    assert seen == sorted(seen) and seen[-1] == handle.num_chunks == 4
    assert [b.tobytes() for b in handle.buffers] == [payload(k) for k in chain[:4]]
    store.complete_load(handle, True)
    assert store.cpu.usage().num_chunks == 4  # chunks 5 and 6 were never read: no page kept for them
    assert store.stats().pinned_chunks == 0 and store.stats().corrupt_chunks == 1
    store.check_integrity()
    store.close()
