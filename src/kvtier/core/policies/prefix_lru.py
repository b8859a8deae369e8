"""Prefix-aware LRU: evict the least recently used **leaf**, as radix-tree caches do.

A chunk is only useful if every chunk before it is available, so evicting a chunk that still has
resident descendants throws those descendants' value away too.  Radix-tree prefix caches
therefore evict leaves only (SGLang's ``RadixCache.evict`` pops the least recently accessed leaf
from a heap, and a node whose last child goes becomes a leaf; Zheng et al., "SGLang: Efficient
Execution of Structured Language Model Programs", NeurIPS 2024, section 3).  This policy keeps
the same tree implicitly, from the ``parent`` given to ``insert``::

    k0 ── k1 ── k2          children: k0:1  k1:2  k2:0  k3:0
           └─── k3          leaves (candidates): k2, k3 — by last use; k1 only after both go

Children are counted per key whether the parent is tracked or not, so a parent that returns
after being evicted finds its resident children again.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from itertools import count
from typing import Any

from kvtier.core.policies.base import Evictable, EvictionPolicy, always_evictable, heap_victim


class PrefixAwareLRUPolicy(EvictionPolicy):
    """Least recently used leaf first.  O(log n) per operation (lazy-deletion heap)."""

    name = "prefix-lru"

    def __init__(self) -> None:
        self._clock = count(1)
        self._stamp: dict[Any, int] = {}  # tracked key -> last use
        self._parent: dict[Any, Any | None] = {}  # tracked key -> parent given at insert
        self._children: dict[Any, int] = {}  # key -> number of tracked children (tracked or not)
        self._leaves: list[tuple[int, int, Any]] = []  # (stamp, seq, key); stale ones skipped lazily
        self._seq = count()  # ties never compare keys

    def insert(self, key: Any, parent: Any | None) -> None:
        if key in self._stamp:
            self.touch([key])
            return
        stamp = next(self._clock)
        self._stamp[key] = stamp
        self._parent[key] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
        if not self._children.get(key):
            heapq.heappush(self._leaves, (stamp, next(self._seq), key))

    def touch(self, keys: Sequence[Any]) -> None:
        stamps, children = self._stamp, self._children
        stamp = next(self._clock)  # one request: one moment; only its leaf's stamp matters
        for key in keys:
            if key in stamps:
                stamps[key] = stamp
                if not children.get(key):
                    heapq.heappush(self._leaves, (stamp, next(self._seq), key))
        if len(self._leaves) > 2 * len(stamps) + self.heap_slack:
            self._leaves = self.compact_heap(self._leaves, self._stale)

    def remove(self, key: Any) -> None:
        if self._stamp.pop(key, None) is None:
            return
        parent = self._parent.pop(key)
        if parent is not None:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
                if parent in self._stamp:  # the parent just became a leaf
                    heapq.heappush(self._leaves, (self._stamp[parent], next(self._seq), parent))

    def victim(self, evictable: Evictable = always_evictable) -> Any | None:
        stamps, children = self._stamp, self._children
        best = heap_victim(self._leaves, self._stale, evictable)
        if best is None and stamps:
            # Every leaf pinned: the least recent evictable key, leaves first.
            order = sorted(stamps, key=lambda k: (bool(children.get(k)), stamps[k]))
            best = next((k for k in order if evictable(k)), None)
        return best

    def _stale(self, entry: tuple[Any, ...]) -> bool:
        """A heap entry of a key removed, used since, or no longer a leaf."""
        return self._stamp.get(entry[2]) != entry[0] or bool(self._children.get(entry[2]))

    def __len__(self) -> int:
        return len(self._stamp)

    def __contains__(self, key: object) -> bool:
        return key in self._stamp

    def keys(self) -> Iterable[Any]:
        return self._stamp.keys()
