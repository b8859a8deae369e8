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

:class:`ChangeFeed` is the part of :class:`~kvtier.core.index.Index` a worker asks once per engine
step, around the drain: the feed, the eviction gate that keeps the mirror's plan loadable
(``gate_evictions``, :mod:`kvtier.core.gate`; ``pin_resident`` pins a planned hit's resident chunks
before the gate opens) and the tiers' numbers (``tier_stats``).  Kept here, with the load's path in
:mod:`kvtier.core.index`, so that a step with a hit never runs :mod:`kvtier.core.upkeep` (the
saves, writes' outcomes, resets).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

from kvtier.core.handles import LoadHandle
from kvtier.core.keys import ChunkKey
from kvtier.core.quota import tenant_stats
from kvtier.core.stats import TierStats

if TYPE_CHECKING:
    import threading
    from collections import Counter

    from kvtier.core.codecstats import CodecStats
    from kvtier.core.gate import EvictionGate
    from kvtier.core.handles import StagedCopy
    from kvtier.core.lowerindex import LowerIndex
    from kvtier.core.policies.base import EvictionPolicy
    from kvtier.core.quota import TenantLedger
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
    """The per-step part of :class:`~kvtier.core.index.Index`: the change feed, the eviction gate and
    what may leave the top tier (``may_free_page``), the tiers' numbers (see the module docstring)."""

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
    lower: list[LowerIndex]
    pins: Counter[ChunkKey]
    ttl_pins: dict[ChunkKey, float]
    quota: TenantLedger | None
    gate: EvictionGate
    policy: EvictionPolicy
    codec_stats: dict[str, CodecStats | None]

    if TYPE_CHECKING:  # the index's (kvtier.core.index, kvtier.core.upkeep)
        def let_go(self, key: ChunkKey) -> None: ...

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

    # ---- plan and pin (kvtier.core.gate) ----------------------------------------------------
    def gate_evictions(self, closed: bool) -> bool:
        """Close the eviction gate, or open it and let go what waited for it; returns whether it was closed."""
        with self.lock:
            was, self.gate.closed = self.gate.closed, closed
            if closed:  # once per engine step, off the request's path: the policies' deferred work
                self.settle_policies()
            if not closed and self.gate.deferred:  # (no call into gate.py on the hit path)
                for key in self.gate.take():
                    self.let_go(key)
            return was

    def pin_resident(self, chain: Sequence[ChunkKey]) -> LoadHandle:
        """Pin the chunks of ``chain`` resident in the top tier now (no I/O); released by :meth:`release`."""
        handle = LoadHandle([], [], [])
        with self.lock:
            handle.pinned = [k for k in chain if self.cpu.contains(k) and k not in self.doomed]  # (resident)
            self.pins.update(handle.pinned)  # (Counter.update adds: one pin each)
        return handle

    # ---- what may leave the top tier: decided here, with the gate (done in index.py and upkeep.py) ----
    def may_free_page(self, key: ChunkKey, ahead: bool) -> bool:
        """Whether the page of resident ``key`` may be freed now: not while the eviction gate is
        closed (:mod:`kvtier.core.gate`), not pinned, no live TTL pin; ahead of need (a spill, or
        eviction after its write) with quotas only while its tenant stays at or above its guarantee."""
        if self.gate.closed or key in self.pins or self.ttl_pinned(key):
            return False
        return not ahead or self.quota is None or self.quota.above_guarantee(key)

    def ttl_pinned(self, key: ChunkKey) -> bool:
        """``key`` has a TTL pin whose deadline has not passed (an expired one is forgotten here)."""
        deadline = self.ttl_pins.get(key)
        if deadline is None:
            return False
        if deadline <= time.monotonic():
            del self.ttl_pins[key]
            return False
        return True

    def settle_policies(self) -> None:
        """The policies' work deferred off the request's path (the adaptive policy's shadow replay), done now."""
        for policy in (self.policy, *(lt.policy for lt in self.local)):
            if policy is not None and policy.pending:
                policy.settle()

    def expire_ttl_pins(self) -> None:
        """Forget TTL pins whose deadline passed."""
        now = time.monotonic()
        for key in [k for k, d in self.ttl_pins.items() if d <= now]:
            del self.ttl_pins[key]

    # ---- numbers  --------------------------------------------------------------
    def tier_stats(self) -> dict[str, TierStats]:
        """Each tier's usage, pins, TTL pins, errors and tenant bytes now (for :class:`~kvtier.core.stats.StoreStats`)."""
        with self.lock:
            self.expire_ttl_pins()
            pinned = {self.name: len(self.pins), **{lt.name: len(lt.pins) for lt in self.lower}}
            ledgers = {self.name: self.quota, **{lt.name: lt.quota for lt in self.local}}
            tiers, codecs = {self.name: self.cpu, **{lt.name: lt.tier for lt in self.lower}}, self.codec_stats
            return {name: TierStats(u.used_bytes, u.capacity_bytes, u.num_chunks, corrupt_chunks=t.corrupt,
                                    pinned_chunks=pinned.get(name, 0), wire=t.wire_stats() if t.shared else None,  # local: None
                                    write_errors=t.write_errors, ttl_pinned_chunks=len(self.ttl_pins) if name == self.name else 0,
                                    codec=c.numbers if (c := codecs.get(name)) is not None else None,
                                    **(tenant_stats(q, u.num_chunks, self.chunk_bytes) if (q := ledgers.get(name)) is not None else {}))
                    for name, t in tiers.items() for u in (t.usage(),)}
