"""The store's change feed: which chunks appeared, moved between tiers or left, for a mirror elsewhere.

A :class:`~kvtier.core.store.TieredStore` lives where the bytes are (a vLLM worker rank); the
component that decides what to load (vLLM's scheduler) keeps an in-memory *mirror* of the store's
index and must never ask the store synchronously.  The feed is how that mirror stays current:

- every place of the index (:mod:`kvtier.core.index`) that changes where a chunk is held calls
  ``_note(key)`` (the index's lock held);
- ``drain_changes(max_items)`` returns an :class:`IndexDelta`: up to ``max_items`` changed keys,
  each with its *current* best local tier (the store's order: ``"cpu"`` before ``"disk"``;
  ``None`` when the chunk is in no local tier any more).  A shared tier (redis) is not in the
  feed: other hosts change it, and the scheduler asks it directly
  (:mod:`kvtier.integrations.vllm.scheduler.remote`).  A key that changed several times since the last drain appears once, with its
  state at drain time, so applying deltas in order reproduces the index;
- the feed is bounded (``change_feed_limit`` keys): when more changes pile up than that, they are
  forgotten and the next drain is a **full snapshot** (``full=True``: every held key; the mirror
  replaces its view).  The first drain after start is always a full snapshot, which reports the
  disk index rebuilt from the directory (the restart case).

The mirror may lag the store (evictions happen between drains): a consumer must treat a mirror
hit as a hint and the store's ``prepare_load`` as the truth (a shorter load, never wrong bytes).

The feed also tracks *dirty* chunks: held in DRAM (cpu tier or a staging copy) but on no local
lower tier (disk), i.e. what a crash would lose.  ``dirty_bytes()`` is exported as a gauge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

from kvtier.core.keys import ChunkKey

if TYPE_CHECKING:
    import threading

    from kvtier.core.handles import StagedCopy
    from kvtier.core.lowerindex import LowerIndex
    from kvtier.core.tiers.base import StagingTier

CHANGE_FEED_LIMIT = 1 << 16


@dataclass
class IndexDelta:
    """Changes of a store's index since the previous drain.

    Attributes:
        changes: ``(key, tier)`` pairs; ``tier`` is the key's best tier now (``"cpu"`` or
            ``"disk"``) or ``None`` when it left every tier.
        full: ``changes`` is a complete snapshot of the held keys: drop every key not in it.
    """

    changes: list[tuple[ChunkKey, str | None]] = field(default_factory=list)
    full: bool = False


class ChangeFeed:
    """Change-feed half of :class:`~kvtier.core.index.Index` (see module docstring)."""

    chunk_bytes: int
    lock: threading.RLock
    _changed: dict[ChunkKey, None]
    _dirty_keys: set[ChunkKey]
    _full_next: bool
    change_feed_limit: int
    name: str  # the top tier's
    cpu: StagingTier
    doomed: set[ChunkKey]
    staged: dict[ChunkKey, StagedCopy]
    local: list[LowerIndex]

    def _tier_of(self, key: ChunkKey) -> str | None:
        """Best local tier holding ``key`` now, or None (the lock held; here, where the drain asks it
        per changed key: ``Index.holds`` inlined, the cpu tier's ``contains`` is a C call)."""
        if (self.cpu.contains(key) and key not in self.doomed) or key in self.staged:
            return self.name
        return next((lt.name for lt in self.local if lt.tier.indexed(key)), None)

    # answered by the index (its lock held)

    def _dirty(self, key: ChunkKey) -> bool:  # in DRAM and on no local lower tier
        raise NotImplementedError

    def _held_keys(self) -> list[ChunkKey]:  # every key held by a local tier
        raise NotImplementedError

    # ``_note(key)``, which records a change, is the index's own (kvtier.core.index): on a load's path

    def _init_feed(self, limit: int = CHANGE_FEED_LIMIT) -> None:
        self._changed = {}
        self._dirty_keys = set()
        self._full_next = True  # the first drain reports everything, disk index included
        self.change_feed_limit = limit

    def _resync(self) -> None:
        """Make the next drain a full snapshot (e.g. the disk directory was recreated, or a reset),
        and recount the dirty chunks over every held key: chunks the top tier holds whose local
        copies just went are dirty now (a graceful stop's ``flush_dirty`` writes them again).
        Rare, so one pass over the held keys."""
        self._changed.clear()
        self._full_next = True
        self._dirty_keys = {k for k in self._held_keys() if self._dirty(k)}

    def drain_changes(self, max_items: int = 4096) -> IndexDelta:
        """Changes since the last drain, at most ``max_items`` (a full snapshot is sent whole).

        Raises:
            ValueError: ``max_items`` not positive.
        """
        if max_items <= 0:
            raise ValueError(f"max_items must be positive, got {max_items}")
        with self.lock:
            if self._full_next:
                self._full_next = False
                self._changed.clear()
                keys = dict.fromkeys(self._held_keys())
                return IndexDelta([(k, self._tier_of(k)) for k in keys], full=True)
            taken = list(islice(self._changed, max_items))
            for key in taken:
                del self._changed[key]
            return IndexDelta([(k, self._tier_of(k)) for k in taken])

    def pending_changes(self) -> int:
        """Changed keys not drained yet (a pending full snapshot counts as 1)."""
        with self.lock:
            return 1 if self._full_next else len(self._changed)

    def dirty_keys(self) -> list[ChunkKey]:
        """Chunks held in DRAM but on no local lower tier (empty without one)."""
        with self.lock:
            return list(self._dirty_keys)

    def dirty_bytes(self) -> int:
        """Payload bytes a crash would lose: ``len(dirty_keys()) × chunk_bytes``."""
        return len(self._dirty_keys) * self.chunk_bytes
