"""The eviction-policy contract.

A policy orders the chunks resident in **one tier** for eviction.  It holds keys only, never
bytes, and never decides capacity: its owner (a tier inside :class:`kvtier.core.store.TieredStore`,
or a simulated tier in :mod:`kvtier.simulate`) calls the hooks below and asks for a victim when
it needs room.  Because the hooks carry nothing engine-specific, the simulator drives the very
same objects the store uses.

Operations (all mutate only the policy's own bookkeeping):

- ``insert(key, parent)``: ``key`` became resident.  ``parent`` is the key of the previous chunk
  of the same prefix (``None`` for a first chunk); prefix-aware policies use it to know which
  chunks have resident descendants.  Inserting a key that is already tracked is a ``touch``.
- ``touch(keys)``: one request used these resident chunks, given **in prompt order** (chunk 0
  first).  The policy decides in which order they count as used; e.g. LRU variants differ in
  whether the first or the last chunk of a prompt becomes the most recent.
- ``remove(key)``: ``key`` left the tier (evicted, deleted, or failed verification).  Unknown
  keys are ignored, so callers may remove on every error path.
- ``victim(evictable)``: the key to evict next, **without** removing it; keys for which
  ``evictable(key)`` is false (pinned by an in-flight transfer) are skipped.  ``None`` means no
  resident key may be evicted now.  The owner evicts, then calls ``remove``.
- ``evict(num_chunks, evictable, held)`` and ``insert_many(pairs)``: the batch forms (victim then remove,
  up to ``num_chunks`` times; insert in order), one call for a load's promotions and their victims; a key
  in ``held`` (the owner's pins, a container asked by membership: no call per candidate) never goes.

- ``settle()``: do work a policy deferred off the request's path (the adaptive policy's shadow
  replay), when ``pending`` is non-empty; the store calls it once per engine step.

Policies are not thread-safe; the owner serialises calls (the store holds its lock).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Iterable, Sequence, Sized
from functools import partial
from typing import Any, ClassVar

from kvtier.core.keys import ChunkKey

Evictable = Callable[[ChunkKey], bool]


def always_evictable(key: ChunkKey) -> bool:
    """An ``evictable`` predicate for owners that never pin (the simulator)."""
    return True


def _unheld(held: Container[ChunkKey], evictable: Evictable, key: ChunkKey) -> bool:
    return key not in held and evictable(key)


def heap_victim(heap: list[tuple[Any, ...]], stale: Callable[[tuple[Any, ...]], bool],
                evictable: Evictable) -> Any | None:
    """The key of the first live, evictable entry of a lazy-deletion heap (the key is an entry's
    last item), or ``None``.  Stale entries (``stale(entry)``: evicted, re-ranked, or no longer a
    leaf) are dropped; entries of pinned keys are looked past and put back, so the heap keeps them.
    Used by the heap-ordered policies (prefix-lru, prefix-freq, adaptive)."""
    pinned = []
    best = None
    while heap:
        entry = heap[0]
        if stale(entry):
            heapq.heappop(heap)
        elif evictable(entry[-1]):
            best = entry[-1]
            break
        else:  # pinned by a transfer in flight
            pinned.append(heapq.heappop(heap))
    for entry in pinned:
        heapq.heappush(heap, entry)
    return best


class EvictionPolicy(ABC):
    """Base class of eviction policies; see the module docstring for the contract."""

    name: ClassVar[str] = "abstract"
    heap_slack: int = 64
    """A heap-ordered policy compacts its heap (:meth:`compact_heap`) past ``2 × chunks + heap_slack``
    entries (an attribute, not a call: the check runs on every touch)."""
    pending: Sized = ()
    """Work recorded on the request's path and not done yet (the adaptive policy's sampled
    accesses for its shadows); the owner calls :meth:`settle` when it is non-empty."""

    @staticmethod
    def compact_heap(heap: list[Any], stale: Callable[[Any], bool]) -> list[Any]:
        """``heap`` with one entry per key (an entry's last item): its least live one (``stale`` as
        :func:`heap_victim` judges them), heapified.  The same victims in the same order: a key's other
        live entries (prefix-freq re-queues a key at an unchanged rank) only follow its first, which
        leaves the heap only when the key is evicted, re-ranked or gets a child, and they go stale with
        it.  Each touch of a leaf queues it again and only :func:`heap_victim` drops the old entry, when
        it reaches the top: in a tier that seldom evicts the heap would grow by an entry per hit without
        bound, so the heap-ordered policies call this once it holds more than twice their chunks plus
        :attr:`heap_slack` entries."""
        first: dict[Any, Any] = {}
        for entry in heap:
            if not stale(entry) and ((seen := first.get(entry[-1])) is None or entry < seen):
                first[entry[-1]] = entry
        live = list(first.values())
        heapq.heapify(live)
        return live

    def settle(self) -> None:
        """Do the work deferred off the request's path (none by default); decisions do not depend
        on when it is called."""

    @abstractmethod
    def insert(self, key: ChunkKey, parent: ChunkKey | None) -> None:
        """Track a newly resident chunk (mutates)."""

    @abstractmethod
    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Record one request's use of resident chunks, in prompt order (mutates)."""

    @abstractmethod
    def remove(self, key: ChunkKey) -> None:
        """Forget a chunk that left the tier; unknown keys are ignored (mutates)."""

    @abstractmethod
    def victim(self, evictable: Evictable = always_evictable) -> ChunkKey | None:
        """The next chunk to evict, or ``None`` if none is evictable.  Does not mutate."""

    def evict(self, num_chunks: int, evictable: Evictable = always_evictable,
              held: Container[ChunkKey] = ()) -> list[ChunkKey]:
        """Up to ``num_chunks`` victims in eviction order, each removed (:meth:`remove`) before the next
        is chosen (:meth:`victim`), none of ``held``; fewer when no more may go (mutates)."""
        if held:
            evictable = partial(_unheld, held, evictable)
        victims: list[ChunkKey] = []
        while len(victims) < num_chunks and (key := self.victim(evictable)) is not None:
            self.remove(key)
            victims.append(key)
        return victims

    def insert_many(self, pairs: Iterable[tuple[ChunkKey, ChunkKey | None]]) -> None:
        """:meth:`insert` of each ``(key, parent)``, in order (mutates)."""
        for key, parent in pairs:
            self.insert(key, parent)

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked chunks."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked."""

    def set_capacity_below(self, chunks: int) -> None:
        """The tiers below this one hold ``chunks`` chunks and take its victims; a policy may
        use it to order for the whole stack (the default does; others ignore it)."""

    def keys(self) -> Iterable[ChunkKey]:
        """Tracked keys, in no promised order (for integrity checks)."""
        raise NotImplementedError  # pragma: no cover - every shipped policy overrides it
