"""Two stores on one disk directory: B (a consumer) adopts the chunk files A (a producer) writes
after B started, through ``rescan`` and its change feed, and serves them byte-exact; damaged
adopted files are counted misses, removed files leave B's index."""

import os
import time

import pytest

from kvtier.core.tiers import DiskTier, GetResult, PutResult
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES

from .helpers import NS, chain_of, make_store, payload
from .test_store_changes import index_of, mirror_of


@pytest.fixture
def pair(tmp_path):
    """(producer A, consumer B) on one directory; A writes every chunk to disk at once."""
    a = make_store(tmp_path, cpu_chunks=4, disk_chunks=64, write_mode="write-through")
    b = make_store(tmp_path, cpu_chunks=4, disk_chunks=64)
    yield a, b
    a.close()
    b.close()


def produce(a, prompt, n):
    chain = chain_of(prompt, n)
    assert a.put(chain, [payload(k) for k in chain]) == n
    assert a.flush(10)
    return chain


def test_consumer_adopts_later_files_and_serves_them_byte_exact(pair):
    a, b = pair
    mirror = mirror_of(b)
    assert mirror == {} and b.rescan() == 0
    chain = produce(a, 1, 3)
    assert b.rescan() == 3
    mirror = mirror_of(b, mirror)
    assert mirror == {k: "disk" for k in chain} == index_of(b)  # the feed carried them
    assert b.get(chain) == [payload(k) for k in chain]
    assert b.stats().tiers["disk"].load_hit_chunks == 3
    assert b.rescan() == 0 and b.tier("disk").corrupt == 0
    b.check_integrity()


def test_files_removed_by_the_producer_leave_the_consumer_index(pair):
    a, b = pair
    chain = produce(a, 2, 3)
    b.rescan()
    mirror = mirror_of(b)
    os.unlink(a.tier("disk").path(chain[2]))  # the producer evicted it
    assert b.rescan() == 1
    mirror = mirror_of(b, mirror)
    assert mirror == {k: "disk" for k in chain[:2]} == index_of(b)
    assert b.get(chain) == [payload(k) for k in chain[:2]]
    b.check_integrity()


def test_damaged_adopted_file_is_a_counted_miss(pair):
    a, b = pair
    chain = produce(a, 3, 3)
    assert b.rescan() == 3
    path = a.tier("disk").path(chain[1])
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 7] ^= 0x40  # payload damage: only the read's checksum can see it
    path.write_bytes(bytes(raw))
    assert b.get(chain) == [payload(chain[0])]  # the prefix ends at the damaged chunk
    assert b.tier("disk").corrupt == 1 and not path.exists()
    assert mirror_of(b).get(chain[1]) is None
    b.check_integrity()


def test_file_with_a_bad_header_is_counted_and_never_adopted(pair):
    a, b = pair
    chain = produce(a, 4, 2)
    path = a.tier("disk").path(chain[1])
    raw = bytearray(path.read_bytes())
    raw[30] ^= 0x01  # inside the key field: the header checksum fails
    path.write_bytes(bytes(raw))
    assert b.rescan() == 1
    assert b.tier("disk").corrupt == 1 and not path.exists()
    assert mirror_of(b) == {chain[0]: "disk"}
    b.check_integrity()


def test_periodic_rescan_feeds_the_mirror_without_being_asked(tmp_path):
    a = make_store(tmp_path, cpu_chunks=4, disk_chunks=64, write_mode="write-through")
    b = make_store(tmp_path, cpu_chunks=4, disk_chunks=64, disk_rescan_s=0.05)
    try:
        mirror = mirror_of(b)
        chain = produce(a, 5, 3)
        deadline = time.monotonic() + 10
        while mirror != {k: "disk" for k in chain} and time.monotonic() < deadline:
            time.sleep(0.02)
            mirror = mirror_of(b, mirror)
        assert mirror == {k: "disk" for k in chain}
        assert b.get(chain) == [payload(k) for k in chain]
    finally:
        a.close()
        b.close()
    assert make_store(tmp_path, cpu_chunks=4, disk_chunks=64)._rescanner is None  # unset: never


def test_rescan_during_this_process_own_write_keeps_the_key(tmp_path, monkeypatch):
    """A key is indexed before its file is renamed into place; a rescan in between must not drop it."""
    tier = DiskTier(tmp_path, NS.digest(), capacity_bytes=1 << 20, io="buffered")
    rounds = []
    real_replace = os.replace

    def replace(src, dst):
        rounds.append(tier.rescan())  # runs while the file is still a temporary one
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    key = chain_of(6, 1)[0]
    assert tier.put(key, payload(key)) is PutResult.STORED
    assert rounds and not rounds[0].gone and not rounds[0].adopted and tier.indexed(key)
    out = bytearray(len(payload(key)))
    assert tier.get_into(key, memoryview(out)) is GetResult.HIT and bytes(out) == payload(key)
    tier.check()
    tier.close()


def test_unchanged_shards_are_not_listed_again(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, NS.digest(), capacity_bytes=1 << 20, io="buffered")
    monkeypatch.setattr("kvtier.core.tiers.disk.scan.RACY_NS", 0)  # this test's timestamps are all fresh
    first = tier.rescan()
    assert first.shards_listed == 256 and tier.rescan().shards_listed == 0
    other = DiskTier(tmp_path, NS.digest(), capacity_bytes=1 << 20, io="buffered")
    key = chain_of(7, 1)[0]
    assert other.put(key, payload(key)) is PutResult.STORED
    found = tier.rescan()
    assert found.shards_listed == 1 and found.adopted == [key]
    tier.close()
    other.close()


def test_adopted_chunks_enter_the_eviction_policy_and_the_cap_holds(tmp_path):
    """B may hold 6 chunk files; A wrote 10 into the shared directory.  B's rescan adopts them into
    its policy and trims to its size at once, and B's own later writes evict adopted
    chunks like its own: the directory never holds more than B's cap once B has looked."""
    a = make_store(tmp_path, cpu_chunks=16, disk_chunks=64, write_mode="write-through")
    b = make_store(tmp_path, cpu_chunks=4, disk_chunks=6, write_mode="write-through")
    try:
        chain = produce(a, 8, 10)
        assert b.rescan() == 10
        b.check_integrity()  # policy == tier both ways, used <= capacity
        cap = b.tier("disk").usage().capacity_bytes
        assert b.tier("disk").usage_exact() <= cap and b.stats().tier("disk").evictions == 4
        kept = {k for k in chain if b.tier("disk").indexed(k)}
        assert len(kept) == 6 and kept == {k for k in chain if a.tier("disk").path(k).exists()}  # deleted for every engine
        mine = chain_of(9, 3)
        assert b.put(mine, [payload(k) for k in mine]) == 3 and b.flush(10)
        assert all(b.tier("disk").indexed(k) for k in mine) and b.stats().tier("disk").evictions == 7
        assert b.tier("disk").usage_exact() <= cap
        b.check_integrity()
    finally:
        a.close()
        b.close()


def test_integrity_check_sees_a_tier_holding_chunks_its_policy_does_not_track(pair):
    a, b = pair
    produce(a, 10, 2)
    b.tier("disk").rescan()  # the bare tier's rescan, behind the store's back: indexed, not in the policy
    with pytest.raises(AssertionError, match="does not track"):
        b.check_integrity()
