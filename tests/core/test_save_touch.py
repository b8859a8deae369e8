"""A save job's chunks the engine served from its own prefix cache are touched in the cpu tier's policy
(``prepare_store``'s ``touch_end``): a real store, LRU, no engine."""

from __future__ import annotations

from kvtier.core.keys import ChunkKey
from kvtier.core.store import TieredStore
from tests.core.helpers import chain_of, make_store


def _save(store: TieredStore, chain: list[ChunkKey], touch_end: int = 0) -> int:
    handle = store.prepare_store(chain, touch_end=touch_end)
    store.complete_store(handle, True)
    return handle.num_chunks


def _survivors(touch_end: int) -> list[bool]:
    """cpu tier of 3 chunks: prompt A (2 chunks) saved, then prompt B (1 chunk); A comes back with one more
    chunk, its first 2 served by the engine's cache; then prompt C (1 chunk) needs a page: which of A's
    first chunk and B's survive."""
    store = make_store(None, cpu_chunks=4, policy="lru")
    a, b, c = chain_of(1, 3), chain_of(2, 1), chain_of(3, 1)
    assert _save(store, a[:2]) == 2 and _save(store, b) == 1
    assert _save(store, a, touch_end=touch_end) == 1  # a[2] stored; a[0], a[1] held: stored again never
    assert _save(store, c) == 1  # 5 chunks for 4 pages: the least recent goes
    return [store.lookup(a[:1]) == 1, store.lookup(b) == 1]


def test_engine_served_chunks_are_touched_by_the_save() -> None:
    """Touched, A's chunks are more recent than B's: B goes."""
    assert _survivors(touch_end=2) == [True, False]


def test_without_touch_end_a_held_chunk_keeps_its_rank() -> None:
    """The default (0: no touch, the old behaviour): A's first chunk is still the least recent and goes."""
    assert _survivors(touch_end=0) == [False, True]


def test_touch_end_before_start_touches_nothing() -> None:
    """``touch_end`` at or before ``start`` is no touch (chunks before ``start`` are not the job's)."""
    store = make_store(None, cpu_chunks=4, policy="lru")
    a, b, c = chain_of(1, 3), chain_of(2, 1), chain_of(3, 1)
    _save(store, a[:2])
    _save(store, b)
    handle = store.prepare_store(a, start=2, touch_end=2)
    store.complete_store(handle, True)
    _save(store, c)
    assert [store.lookup(a[:1]) == 1, store.lookup(b) == 1] == [False, True]
