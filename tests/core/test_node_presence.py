"""The node pool's presence table (kvtier.core.tiers.node.presence) against the owner's index: on a
real pool file, through commits, deletes, evictions, rebuilds and an owner restart's recovery, a
reader of the table answers every key as the owner's index does; a table that cannot be trusted
(no heartbeat, a stale one, a rebuild under way) is not read."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from kvtier.core.tiers.node import presence
from kvtier.core.tiers.node.index import PoolIndex
from kvtier.core.tiers.node.pool import Pool, create_pool, open_pool
from kvtier.core.tiers.node.presence import PresenceTable

PAGE = 4096
NAMESPACES = (b"a" * 16, b"b" * 16)


def _index(pool: Pool) -> PoolIndex:
    index = PoolIndex(pool.gens, pool.heads, PresenceTable(pool.slots, pool.meta), pool.page_bytes, 30.0)
    index.attach(1, "test", 0.0)
    return index


def _agrees(pool: Pool, index: PoolIndex, names: list[tuple[bytes, bytes]]) -> None:
    index.table.beat()
    for ns in NAMESPACES:
        keys = [k for n, k in names if n == ns]
        assert presence.lookup(pool.slots, pool.meta, ns, keys) == index.lookup(ns, keys)
    assert index.problem() == ""


def _write(index: PoolIndex, ns: bytes, keys: list[bytes], nbytes: int) -> list[bool]:
    grants = index.alloc(1, ns, keys, [nbytes] * len(keys), 0.0)
    leases = [g[0] for g in grants if isinstance(g, tuple)]
    return index.commit(1, leases)


@pytest.fixture
def pool(tmp_path: Path):
    made = create_pool(tmp_path / "pool", 4 << 20, PAGE)  # 511 pages: values of 1-3 pages evict
    yield made
    made.close()


def test_the_table_answers_as_the_index_through_writes_deletes_evictions_and_rebuilds(pool):
    index = _index(pool)
    rng = random.Random(7)
    names: list[tuple[bytes, bytes]] = []
    for step in range(400):
        ns = NAMESPACES[step % 2]
        keys = [rng.randbytes(16) for _ in range(rng.randint(1, 24))]
        _write(index, ns, keys, rng.randint(1, 3 * PAGE))
        names += [(ns, k) for k in keys]
        if step % 3 == 0:  # delete some, present or not
            gone = rng.sample(names, min(8, len(names)))
            for n, k in gone:
                index.delete(n, [k])
        if step % 25 == 0:
            _agrees(pool, index, names + [(ns, rng.randbytes(16)) for _ in range(8)])
    assert index.evictions > 0 and index.table.rebuilds > 0  # both paths were taken
    _agrees(pool, index, names)
    # a namespace's key under the other namespace is absent (isolation)
    ns, k = next((n, k) for n, k in names if index.lookup(n, [k]) == [True])
    other = NAMESPACES[1] if ns == NAMESPACES[0] else NAMESPACES[0]
    assert presence.lookup(pool.slots, pool.meta, other, [k]) == index.lookup(other, [k]) == [False]


def test_an_owner_restart_rebuilds_the_table_from_the_pool(pool, tmp_path):
    index = _index(pool)
    keys = [bytes([i]) * 16 for i in range(40)]
    assert all(_write(index, NAMESPACES[0], keys, PAGE + 1))
    index.delete(NAMESPACES[0], keys[:10])
    pool.slots[:] = 0  # a table lost (as a dead owner's half-done rebuild); the heads are the truth
    again = open_pool(tmp_path / "pool")
    restarted = PoolIndex(again.gens, again.heads, PresenceTable(again.slots, again.meta), again.page_bytes, 30.0)
    restarted.recover(lambda page, nbytes, space: next((NAMESPACES[0], v.name[1]) for v in index.values.values()
                                                if v.page == page))
    restarted.table.beat()
    assert presence.lookup(again.slots, again.meta, NAMESPACES[0], keys) == [False] * 10 + [True] * 30
    assert restarted.problem() == ""
    again.close()


def test_a_table_without_a_fresh_heartbeat_or_in_a_rebuild_is_not_read(pool):
    index = _index(pool)
    key = b"k" * 16
    _write(index, NAMESPACES[0], [key], 10)
    assert presence.lookup(pool.slots, pool.meta, NAMESPACES[0], [key]) is None  # never beaten
    index.table.beat()
    assert presence.lookup(pool.slots, pool.meta, NAMESPACES[0], [key]) == [True]
    index.table.beat(time.monotonic_ns() - int((presence.STALE_S + 1) * 1e9))  # an owner that stopped beating
    assert presence.lookup(pool.slots, pool.meta, NAMESPACES[0], [key]) is None
    index.table.beat()
    pool.meta[presence.SEQUENCE] += 1  # odd: a rebuild under way
    assert presence.lookup(pool.slots, pool.meta, NAMESPACES[0], [key]) is None
    pool.meta[presence.SEQUENCE] += 1
    assert presence.lookup(pool.slots, pool.meta, NAMESPACES[0], [key]) == [True]
    index.table.beat(0)  # the owner stopped
    assert presence.lookup(pool.slots, pool.meta, NAMESPACES[0], [key]) is None


def test_a_full_pool_takes_the_evicted_values_pages_and_a_freed_page_is_reused_first(pool):
    """Where the owner's allocation (searched near the last one or an evicted value, not over the
    whole pool each time) puts a value: in a full pool of values of one size, on the least recently
    used value's pages (one eviction); in a pool with room, on the lowest page freed since."""
    index = _index(pool)
    size = 2 * PAGE
    keys = [i.to_bytes(16, "little") for i in range(index.num_pages // 2)]
    assert all(_write(index, NAMESPACES[0], keys, size))
    assert index.free_pages < 2
    lru = index.values[(NAMESPACES[0], keys[0])].page
    index.lookup(NAMESPACES[0], keys)  # a lookup does not touch the LRU order
    assert _write(index, NAMESPACES[0], [b"new" * 5 + b"!"], size) == [True]
    assert index.values[(NAMESPACES[0], b"new" * 5 + b"!")].page == lru and index.evictions == 1
    freed = index.values[(NAMESPACES[0], keys[10])].page
    index.delete(NAMESPACES[0], keys[10:12])
    assert _write(index, NAMESPACES[0], [b"again" * 3 + b"!"], size) == [True]
    assert index.values[(NAMESPACES[0], b"again" * 3 + b"!")].page == freed and index.evictions == 1
    assert index.problem() == ""
