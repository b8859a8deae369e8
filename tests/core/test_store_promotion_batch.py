"""A load's promotions in one batch (``Index._read_run``): the cpu tier reserves and frees pages, the
policy gives up its victims and the ghost lists take and add, one call each per run of chunks read
from below, with what one chunk at a time did: the same victims in the same order, the same ghost
list, the same counters, a held chunk still freeing a page, the closed gate freeing none."""

import copy

from .helpers import chain_of, make_store, payload


def one_by_one(policy, num, evictable):
    """The victims one chunk at a time took: victim, then remove, ``num`` times (on a copy)."""
    twin, victims = copy.deepcopy(policy), []
    while len(victims) < num and (victim := twin.victim(evictable)) is not None:
        twin.remove(victim)
        victims.append(victim)
    return victims


def on_disk_only(tmp_path, cpu_chunks=4):
    """A store whose disk holds chain ``a`` (3 chunks) and whose full cpu tier holds chain ``b``
    (``cpu_chunks`` chunks) instead: ``a`` was pushed out of the cpu tier by ``b``."""
    store = make_store(tmp_path, cpu_chunks=cpu_chunks, disk_chunks=64, write_mode="write-through", policy="lru")
    a, b = chain_of(1, 3), chain_of(2, cpu_chunks)
    store.put(a, [payload(k) for k in a])
    store.flush()
    store.put(b, [payload(k) for k in b])
    store.flush()
    assert not any(store.cpu.contains(k) for k in a) and all(store.cpu.contains(k) for k in b)
    return store, a, b


def evictions(store):
    return store.stats().tier("cpu").evictions


def test_a_run_from_disk_evicts_the_victims_one_at_a_time_would_in_their_order(tmp_path):
    store, a, b = on_disk_only(tmp_path)
    expected = one_by_one(store.index.policy, 3, lambda k: k not in store.index.pins)
    assert len(expected) == 3 and set(expected) <= set(b)
    before, ghosts = evictions(store), store.index.ghosts.lists["cpu"].keys
    handle = store.prepare_load(a)
    assert handle.num_chunks == 3 and list(handle.tiers) == ["disk"] * 3
    assert [k for k in b if not store.cpu.contains(k)] == [k for k in b if k in expected]
    assert list(ghosts)[-3:] == expected and all(ghosts[k].reason == "evicted" for k in expected)
    assert evictions(store) == before + 3
    assert [bytes(buf.tobytes()) for buf in handle.buffers] == [payload(k) for k in a]
    store.complete_load(handle, True)
    assert all(store.cpu.contains(k) for k in a)  # promoted into the pages the victims left
    assert store.get(a) == [payload(k) for k in a]
    store.check_integrity()


def test_a_held_chunk_still_frees_a_page_the_next_chunk_then_takes(tmp_path):
    # a[0]'s page is reserved already (as by a save in flight) and no page is free: its promotion
    # first evicts one, then finds a[0] held (a private buffer), and a[1] takes the freed page
    # without evicting; a[2] evicts again: 2 evictions for 3 chunks, as one chunk at a time did
    store, a, b = on_disk_only(tmp_path)
    store.index.evict_top(b[-1])  # one free page...
    assert store.cpu.reserve(a[0]).buffer is not None  # ...held for a[0]
    expected = one_by_one(store.index.policy, 2, lambda k: k not in store.index.pins)
    before = evictions(store)
    handle = store.prepare_load(a)
    assert handle.num_chunks == 3 and evictions(store) == before + 2
    assert list(store.index.ghosts.lists["cpu"].keys)[-2:] == expected
    assert not store.cpu.can_reserve()  # the first victim's page went to a[1], the second's to a[2]
    assert [bytes(buf.tobytes()) for buf in handle.buffers] == [payload(k) for k in a]
    store.complete_load(handle, True)
    store.cpu.abort(a[0])
    assert store.cpu.contains(a[1]) and store.cpu.contains(a[2]) and not store.cpu.contains(a[0])
    store.check_integrity()


def test_with_the_gate_closed_a_run_frees_no_page_and_reads_into_private_buffers(tmp_path):
    store, a, b = on_disk_only(tmp_path)
    before = evictions(store)
    store.gate_evictions(True)
    handle = store.prepare_load(a)
    assert handle.num_chunks == 3 and evictions(store) == before and all(store.cpu.contains(k) for k in b)
    assert [bytes(buf.tobytes()) for buf in handle.buffers] == [payload(k) for k in a]
    store.complete_load(handle, True)
    store.gate_evictions(False)
    assert not any(store.cpu.contains(k) for k in a)  # read, served, not promoted
    store.check_integrity()


def test_a_lone_held_chunk_evicts_one_page_it_leaves_free_as_before(tmp_path):
    # kept as one chunk at a time did it: with no page free, a promotion frees one before it finds its
    # chunk held (a private buffer), and the freed page stays free for whoever comes next
    store, a, b = on_disk_only(tmp_path)
    store.index.evict_top(b[-1])
    assert store.cpu.reserve(a[0]).buffer is not None
    expected = one_by_one(store.index.policy, 1, lambda k: k not in store.index.pins)
    before = evictions(store)
    handle = store.prepare_load(a[:1])
    assert handle.num_chunks == 1 and evictions(store) == before + 1 and store.cpu.can_reserve()
    assert list(store.index.ghosts.lists["cpu"].keys)[-1:] == expected
    assert bytes(handle.buffers[0].tobytes()) == payload(a[0])
    store.complete_load(handle, True)
    store.cpu.abort(a[0])
    store.check_integrity()
