"""The store's top tier (cpu) and what the store keeps for it: policy, pins, staged copies.

Every chunk passes through the top tier: saves are staged in its pages, loads from lower tiers
are promoted into them.  :class:`TopTier` tracks

- ``pins``: chunks that callers hold views of, or that a write job reads; never evicted;
- ``ttl_pins``: chunks a request asked to keep for a while (:meth:`TopTier.ttl_pin`, a deadline
  each, at most a budget of pages); never evicted before their deadline, forgotten after it;
- ``staged``: private copies of chunks already evicted from the pages but still queued for a
  write-back tier; servable until every queued write of them is done (``pending``);
- ``parent``: the previous chunk of each resident chunk's chain, for the policies;
- ``quota``: with ``tenant_quotas``, who owns each resident chunk and the quota's victim choice
  (:class:`~kvtier.core.quota.TenantLedger`; ``None`` without quotas);
- ``epoch``: the store's reset count; ``doomed``: chunks a reset (:meth:`TopTier.clear`) dropped
  while they were pinned: invisible at once (``holds``/``resident`` say no), their pages freed
  when the last pin goes.

Eviction lives here too: when a page is needed the policy's victim (never a pinned chunk) leaves
(with quotas, the ledger's choice for the tenant that needs the page: :mod:`kvtier.core.quota`);
a write-back tier (``back``) that lacks it gets a staged copy queued, so the page is free at once;
``spill_ahead`` queues likely victims early (pinned, evicted once written) to keep
``spill_watermark`` of the pages free.

All methods need the store's lock.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier.core.gate import EvictionGate
from kvtier.core.keys import ChunkKey
from kvtier.core.lower import LowerTier, WriteJob
from kvtier.core.policies import EvictionPolicy
from kvtier.core.quota import TenantLedger
from kvtier.core.stats import StoreCounters
from kvtier.core.tenant import Writer
from kvtier.core.tiers.base import Paged, StagingTier


@dataclass(slots=True)
class StagedCopy:
    """A copy of an evicted chunk and the number of writes of it still queued."""

    data: np.ndarray
    pending: int = 0


class TopTier:
    """The top (staging) tier with its policy, pins and staged copies (see module docstring)."""

    def __init__(self, tier: StagingTier, policy: EvictionPolicy, counters: StoreCounters,
                 spill_watermark: float, chunk_bytes: int) -> None:
        self.tier = tier
        self.back: list[LowerTier] = []  # write-back tiers, set by the store once they exist
        self.spill_watermark = spill_watermark
        self.chunk_bytes = chunk_bytes
        self.name = tier.name
        self.policy = policy
        self.pins: Counter[ChunkKey] = Counter()
        self.writing: Counter[ChunkKey] = Counter()  # write jobs reading a page (subset of pins)
        self.staged: dict[ChunkKey, StagedCopy] = {}
        self.parent: dict[ChunkKey, ChunkKey | None] = {}
        self.tenant: dict[ChunkKey, Writer] = {}  # who each resident chunk was saved for, when known
        self.uses: Counter[ChunkKey] = Counter()  # times each resident chunk was served (admission)
        self.epoch = 0  # resets so far (the store's; promotions and saves started in an older one are dropped)
        self.doomed: set[ChunkKey] = set()  # dropped by a reset while pinned: freed at the last unpin
        self.ttl_pins: dict[ChunkKey, float] = {}  # requests' TTL pins: chunk -> time.monotonic() deadline
        self.quota: TenantLedger | None = None  # tenant quotas (the store sets it when configured)
        self._counters = counters
        self.gate = EvictionGate()  # closed: nothing leaves (kvtier.core.gate)
        self.on_change: Callable[[ChunkKey], None] = lambda key: None  # the store's change feed

    def holds(self, key: ChunkKey) -> bool:
        """Resident in a page or staged (a doomed chunk is neither)."""
        return self.resident(key) or key in self.staged

    def resident(self, key: ChunkKey) -> bool:
        """In a page and not doomed by a reset."""
        return self.tier.contains(key) and key not in self.doomed

    def pin(self, key: ChunkKey) -> None:
        self.pins[key] += 1

    def unpin(self, key: ChunkKey) -> None:
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]
            if key in self.doomed:
                self.doomed.discard(key)
                self._drop(key)

    def ttl_pin(self, key: ChunkKey, deadline: float, budget: int) -> bool:
        """Keep resident ``key`` from eviction until ``deadline`` (``time.monotonic()`` seconds).

        A chunk pinned already keeps the later deadline; a new pin is refused (False) when the
        chunk is not resident or ``budget`` chunks are pinned already (expired pins do not count)."""
        if key in self.ttl_pins:
            self.ttl_pins[key] = max(self.ttl_pins[key], deadline)
            return True
        if not self.resident(key):
            return False
        if len(self.ttl_pins) >= budget:
            self.expire_ttl_pins()
            if len(self.ttl_pins) >= budget:
                return False
        self.ttl_pins[key] = deadline
        return True

    def expire_ttl_pins(self) -> None:
        """Forget TTL pins whose deadline passed."""
        now = time.monotonic()
        for key in [k for k, d in self.ttl_pins.items() if d <= now]:
            del self.ttl_pins[key]

    def ttl_pinned(self, key: ChunkKey) -> bool:
        """``key`` has a TTL pin whose deadline has not passed (an expired one is forgotten here)."""
        deadline = self.ttl_pins.get(key)
        if deadline is None:
            return False
        if deadline <= time.monotonic():
            del self.ttl_pins[key]
            return False
        return True

    def clear(self) -> list[ChunkKey]:
        """A reset: drop every resident and staged chunk now, except pinned ones, which become
        doomed (freed at their last unpin).  Reserved pages stay with their owners (a save or a
        promotion), which give them back when they see the new :attr:`epoch` (the store bumps it).
        Returns the keys dropped or doomed."""
        removed = [k for k in self.tier.keys() if k not in self.doomed]  # noqa: SIM118 - a list
        self.ttl_pins.clear()
        for key in removed:
            if key in self.pins:
                self.doomed.add(key)
            else:
                self._drop(key)
        for key in list(self.staged):  # queued writes keep their copies; the store drops those writes
            del self.staged[key]
            if key not in removed:
                removed.append(key)
            self.on_change(key)
        return removed

    def evictable(self, key: ChunkKey) -> bool:
        return key not in self.pins and not self.ttl_pinned(key)

    def spillable(self, key: ChunkKey) -> bool:
        """May leave ahead of need (a spill, or eviction after it is written): evictable, and with
        quotas only when its tenant stays at or above its guarantee."""
        return self.evictable(key) and (self.quota is None or self.quota.above_guarantee(key))

    def publish(self, key: ChunkKey, parent: ChunkKey | None, tenant: Writer | None = None,
                owner: bytes | None = None) -> None:
        """Commit a reserved page and start tracking it (saved for ``tenant``, when known: a
        save's :class:`~kvtier.core.tenant.TenantId`, or a promotion's record read from a verified
        shared value).  ``owner``: the quota's tenant key when ``tenant`` does not give one (a
        promotion: the lower tier's ledger says whose it is)."""
        self.tier.commit(key)
        self.parent[key] = parent
        if tenant is not None:
            self.tenant[key] = tenant
        if self.quota is not None:
            quota_key = tenant.quota_key if tenant is not None else None
            self.quota.add(key, quota_key if quota_key is not None else owner)
        self.policy.insert(key, parent)
        self.on_change(key)

    def owner(self, key: ChunkKey) -> bytes | None:
        """The quota's tenant key of resident ``key`` (``None``: unknown, or no quotas)."""
        return self.quota.owner.get(key) if self.quota is not None else None

    def stage(self, key: ChunkKey) -> StagedCopy:
        """A private copy of a resident chunk that outlives its page."""
        copy = self.staged.get(key)
        if copy is None:
            copy = self.staged[key] = StagedCopy(self.tier.view(key).copy())
        return copy

    def release_staged(self, key: ChunkKey) -> None:
        """One queued write of a staged copy is over; drop the copy after the last."""
        copy = self.staged.get(key)
        if copy is not None:
            copy.pending -= 1
            if copy.pending <= 0:
                self.gate.later(key, self._unstage)

    def _unstage(self, key: ChunkKey) -> None:
        copy = self.staged.get(key)
        if copy is not None and copy.pending <= 0:
            del self.staged[key]
            self.on_change(key)

    def evict(self, key: ChunkKey) -> None:
        """Drop a resident chunk from its page (an eviction, counted)."""
        self._drop(key)
        self._counters.evicted(self.name)

    def _drop(self, key: ChunkKey) -> None:
        self.tier.delete(key)
        self.policy.remove(key)
        self.parent.pop(key, None)
        self.tenant.pop(key, None)
        self.uses.pop(key, None)
        self.ttl_pins.pop(key, None)
        if self.quota is not None:
            self.quota.remove(key)
        self.on_change(key)

    # ---- eviction and spill --------------------------------------------------------------
    def free_page(self, tenant: bytes | None = None) -> bool:
        """Make sure one page is free, evicting if needed; False if everything is pinned (or, with
        quotas, nothing may go for ``tenant``, the quota's tenant key of whoever needs the page;
        ``None``: unknown)."""
        if self.tier.can_reserve():
            return True
        if self.gate.closed:
            return False
        if self.quota is not None:
            victim = self.quota.victim(self.policy, self.evictable, tenant)
        else:
            victim = self.policy.victim(self.evictable)
        if victim is None:
            return False
        missing = self._admitting(victim)
        if missing:  # write-back: stage a copy so the page is free now; the writes happen on workers
            copy = self.stage(victim)
            for lt in missing:
                if lt.enqueue(WriteJob(victim, self.parent.get(victim), copy.data, evict_after=False,
                                           tenant=self.tenant.get(victim))):
                    copy.pending += 1
            if not copy.pending:
                del self.staged[victim]
        self.evict(victim)
        return True

    def spill_ahead(self) -> None:
        """Queue write-backs of likely victims so free pages stay above ``spill_watermark``."""
        num_pages = self.tier.num_pages if isinstance(self.tier, Paged) else 0
        if not self.back or not num_pages or self.gate.closed:
            return
        want = int(self.spill_watermark * num_pages)
        free = self.tier.usage().free_bytes // self.chunk_bytes
        writing = self.writing
        while free + len(writing) < want and not any(lt.queue.full() for lt in self.back):
            victim = self.policy.victim(lambda k: self.spillable(k) and k not in writing)
            if victim is None:
                return
            missing = self._admitting(victim)
            if not missing:
                self.evict(victim)
                free += 1
                continue
            queued = [self.enqueue(lt, WriteJob(victim, self.parent.get(victim), None, evict_after=True,
                                                           tenant=self.tenant.get(victim)))
                      for lt in missing]
            if not any(queued):
                return

    def used(self, keys: list[ChunkKey]) -> None:
        """One request was served these resident chunks: tell the policy, count the uses."""
        self.policy.touch(keys)
        for key in keys:
            self.uses[key] += 1

    def _admitting(self, victim: ChunkKey) -> list[LowerTier]:
        """Write-back tiers that lack ``victim`` and whose admission takes it."""
        uses = self.uses.get(victim, 0)
        return [lt for lt in self.back if not lt.tier.indexed(victim) and lt.admission.judge(victim, uses)]

    def enqueue(self, lt: LowerTier, job: WriteJob) -> bool:
        """Queue ``job`` for ``lt``, pinning the page it reads; False (counted) if the queue is full."""
        if job.from_top:
            self.pin(job.key)
            self.writing[job.key] += 1
        if lt.enqueue(job):
            return True
        if job.from_top:
            self._done_writing(job.key)
        return False

    def _done_writing(self, key: ChunkKey) -> None:
        self.unpin(key)
        self.writing[key] -= 1
        if self.writing[key] <= 0:
            del self.writing[key]

    def written(self, job: WriteJob, ok: bool) -> None:
        """A lower tier finished ``job``: release what it held here."""
        if not job.from_top:
            self.release_staged(job.key)
            return
        self._done_writing(job.key)
        if job.evict_after and ok:
            self.gate.later(job.key, self._evict_spilled)

    def _evict_spilled(self, key: ChunkKey) -> None:  # deferred by a closed gate: check it is still written
        if self.resident(key) and self.spillable(key) and not self._admitting(key):
            self.evict(key)

    def check(self) -> None:
        """Assert page accounting and that the policy tracks exactly the resident chunks."""
        self.tier.check()
        usage = self.tier.usage()
        assert usage.used_bytes + usage.free_bytes == usage.capacity_bytes
        resident = set(self.tier.keys())
        tracked = set(self.policy.keys())
        assert resident == tracked, \
            f"{self.name} policy tracks {len(tracked)} chunks but {len(resident)} are resident"
        assert set(self.ttl_pins) <= resident, f"{self.name} TTL-pins chunks that are not resident"
        if self.quota is not None:
            self.quota.check(resident)
