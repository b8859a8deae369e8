"""Least-recently-used eviction, in two touch orders.

``LRUPolicy(tail_first=False)`` counts a prompt's chunks as used in prompt order, so chunk 0 is
the least recent of them and is evicted first; that breaks the whole chain behind it, since a
chunk is only useful if every chunk before it is available.

``LRUPolicy(tail_first=True)`` counts them in reverse order, so the **tail** of a prompt goes
first and the shared head stays; this is the order vLLM's own block pool frees blocks in
(vllm/v1/core/block_pool.py: ``free_blocks`` is called with blocks in reverse order so tail
blocks are evicted first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.base import Evictable, EvictionPolicy, always_evictable


class LRUPolicy(EvictionPolicy):
    """LRU over chunk keys.  O(1) insert/touch/remove; ``victim`` is O(1) unless the oldest
    chunks are pinned, in which case it skips them.

    Args:
        tail_first: if true, a prompt's chunks are recorded in reverse order (tail evicted first).
    """

    name = "lru"

    def __init__(self, tail_first: bool = False) -> None:
        self.tail_first = tail_first
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey, parent: ChunkKey | None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        order = self._order
        for key in (reversed(keys) if self.tail_first else keys):
            if key in order:
                order.move_to_end(key)

    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Evictable = always_evictable) -> ChunkKey | None:
        for key in self._order:
            if evictable(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def keys(self) -> Iterable[ChunkKey]:
        return self._order.keys()


class TailFirstLRUPolicy(LRUPolicy):
    """LRU whose touch order puts a prompt's tail first in line for eviction (vLLM's order)."""

    name = "lru-tail"

    def __init__(self) -> None:
        super().__init__(tail_first=True)
