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

:class:`IndexState` is the state of :class:`~kvtier.core.index.Index` (its base), set up once here, with
the feed's rare verbs (a resync after a reset or a recreated directory, the pending count, the dirty
keys).  What a worker asks once per engine step (the drain, the eviction gate, ``pin_resident``, the
tiers' numbers) is the index's own, with a load's path (:mod:`kvtier.core.index`); saves, writes'
outcomes and resets are :mod:`kvtier.core.upkeep`'s.  Neither this module nor upkeep runs on a hit.
"""

from __future__ import annotations

import collections
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.core.codecstats import codec_stats
from kvtier.core.config import KVTierConfig
from kvtier.core.context import Counts
from kvtier.core.gate import EvictionGate
from kvtier.core.ghosts import GhostList, Ghosts
from kvtier.core.handles import StagedCopy
from kvtier.core.keys import ChunkKey
from kvtier.core.lowerindex import LowerIndex
from kvtier.core.policies import make_policy
from kvtier.core.policies.admission import make_admission
from kvtier.core.quota import TenantLedger
from kvtier.core.tenant import Writer
from kvtier.core.tiers.base import Paged, StagingTier

CHANGE_FEED_LIMIT = 1 << 16

count_each: Callable[[dict[ChunkKey, int], Iterable[ChunkKey]], None] = collections._count_elements  # type: ignore[attr-defined]
"""``counter.update(keys)`` for a :class:`~collections.Counter` and a list of keys: +1 per key, by the C helper
``Counter.update`` calls, without its Python frame (the index counts a pin and a use per chunk of every hit)."""


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


class IndexState:
    """What :class:`~kvtier.core.index.Index` holds (see the module docstring), set up over the top (staging)
    tier ``cpu`` and the tiers ``lower`` below it, in order, per ``config`` (policies, admission, quotas,
    ``spill_watermark``, ``pin_max_share``), counting in ``counters``, for chunks of ``chunk_bytes``;
    ``observe(tier, distance_bytes)``: each ghost hit's distance (:mod:`kvtier.core.ghosts`)."""

    def __init__(self, cpu: StagingTier, lower: Sequence[LowerIndex], config: KVTierConfig,
                 counters: Counts, chunk_bytes: int, observe: Callable[[str, float], None] | None = None) -> None:
        self.lock = threading.RLock()
        self.cpu = cpu
        self.name = cpu.name
        self.chunk_bytes = chunk_bytes
        self.counters = counters
        self.spill_watermark = config.spill_watermark
        self.policy = make_policy(config.policy)
        self.lower = list(lower)
        self.by_name = {lt.name: lt for lt in self.lower}
        for lt in self.lower:  # admission per lower tier (kvtier.core.policies.admission)
            lt.admission = make_admission(config.admission.get(lt.name, "all"))
        self.local = [lt for lt in self.lower if not lt.shared]
        self.shared = [lt for lt in self.lower if lt.shared]
        self.back = [lt for lt in self.lower if lt.write_back]
        self.through = [lt for lt in self.lower if not lt.write_back]
        # victims move down, so the default orders the cpu tier for the reach of the whole stack
        self.policy.set_capacity_below(sum(lt.tier.usage().capacity_bytes for lt in self.back) // chunk_bytes)
        pages = cpu.num_pages if isinstance(cpu, Paged) else cpu.usage().capacity_bytes // chunk_bytes
        self.pages = pages
        self.ttl_budget = int(config.pin_max_share * pages)
        self.quota: TenantLedger | None = None
        if config.tenant_quotas is not None:  # each local tier's share per tenant (kvtier.core.quota)
            self.quota = TenantLedger(config.tenant_quotas, pages)
            for lt in self.local:
                lt.quota = TenantLedger(config.tenant_quotas,
                                        lt.tier.usage().capacity_bytes // lt.tier.stored_bytes(chunk_bytes))
        self.pins: Counter[ChunkKey] = Counter()
        self.writing: Counter[ChunkKey] = Counter()  # write jobs reading a page (subset of pins)
        self.staged: dict[ChunkKey, StagedCopy] = {}  # evicted chunks still queued for a write-back tier
        self.parent: dict[ChunkKey, ChunkKey | None] = {}
        self.tenant: dict[ChunkKey, Writer] = {}  # who each resident chunk was saved for, when known
        self.uses: Counter[ChunkKey] = Counter()  # times each resident chunk was served (admission)
        self.epoch = 0  # resets so far; promotions and saves planned in an older one never publish
        self.doomed: set[ChunkKey] = set()  # dropped by a reset while pinned: freed at the last unpin
        self.ttl_pins: dict[ChunkKey, float] = {}  # requests' TTL pins: chunk -> time.monotonic() deadline
        self.gate = EvictionGate()  # closed: no page may be freed (kvtier.core.gate)
        # what each local tier recently lost, and why (kvtier.core.ghosts): limits of 1x its capacity in chunks
        self.ghosts = Ghosts([GhostList(self.name, pages, chunk_bytes), *(GhostList(
            lt.name, lt.tier.usage().capacity_bytes // lt.tier.stored_bytes(chunk_bytes), lt.tier.stored_bytes(
                chunk_bytes)) for lt in self.local)], observe)
        for lt in self.local:
            lt.ghosts = self.ghosts
        self.top_ghosts = self.ghosts.lists[self.name].keys  # (read on the promotion path)
        self.codec_stats = {self.name: codec_stats(cpu), **{lt.name: codec_stats(lt.tier) for lt in self.lower}}
        self._changed: dict[ChunkKey, None] = {}  # the change feed: keys changed since the last drain
        self._dirty_keys: set[ChunkKey] = set()
        self._full_next = True  # the first drain reports everything, disk index included
        self.change_feed_limit = CHANGE_FEED_LIMIT

    if TYPE_CHECKING:  # the index's (kvtier.core.index)
        def _dirty(self, key: ChunkKey) -> bool: ...
        def _tier_of(self, key: ChunkKey) -> str | None: ...

    def _held_keys(self) -> list[ChunkKey]:
        return [*(k for k in self.cpu.keys() if k not in self.doomed), *self.staged,  # noqa: SIM118
                *(k for lt in self.local for k in lt.tier.keys())]  # noqa: SIM118

    def _full_snapshot(self) -> IndexDelta:
        """The drain of a full snapshot (the first, or the next after a resync): every held key with its tier."""
        self._full_next = False
        self._changed.clear()
        return IndexDelta([(k, self._tier_of(k)) for k in dict.fromkeys(self._held_keys())], full=True)

    def _resync(self) -> None:
        """Make the next drain a full snapshot (e.g. the disk directory was recreated, or a reset),
        and recount the dirty chunks over every held key: chunks the top tier holds whose local
        copies just went are dirty now (a graceful stop's ``flush_dirty`` writes them again).
        Rare, so one pass over the held keys."""
        self._changed.clear()
        self._full_next = True
        self._dirty_keys = {k for k in self._held_keys() if self._dirty(k)}

    def pending_changes(self) -> int:
        """Changed keys not drained yet (a pending full snapshot counts as 1)."""
        with self.lock:
            return 1 if self._full_next else len(self._changed)

    def dirty_keys(self) -> list[ChunkKey]:
        """Chunks held in DRAM but on no local lower tier (empty without one)."""
        with self.lock:
            return list(self._dirty_keys)
