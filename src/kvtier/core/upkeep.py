"""The index's upkeep: pins, eviction from the top tier, writes' outcomes, TTL pins, resets, checks.

:class:`IndexUpkeep` is the half of :class:`~kvtier.core.index.Index` that the mover's reports
and the operator's actions run through (the other half plans loads and saves).  Same lock, same
state (declared here, set up by :class:`~kvtier.core.index.Index`), no threads, no callbacks.

Eviction from the top tier is decided in one place, :meth:`IndexUpkeep.may_free_page` (may this
chunk's page be freed now), and done in one place, :meth:`IndexUpkeep.evict_top`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.core.changes import ChangeFeed
from kvtier.core.handles import StagedCopy, WriteJob
from kvtier.core.keys import ChunkKey
from kvtier.core.lowerindex import LowerIndex
from kvtier.core.policies import EvictionPolicy
from kvtier.core.quota import TenantLedger
from kvtier.core.stats import StoreCounters, TierStats
from kvtier.core.tenant import Writer
from kvtier.core.tiers.base import ClearResult, PutResult, Rescannable, StagingTier

if TYPE_CHECKING:
    from kvtier.core.tiers.disk.scan import RescanResult


class IndexUpkeep(ChangeFeed):
    """Pins, eviction, writes' outcomes, TTL pins, resets and checks (see the module docstring)."""

    lock: threading.RLock
    cpu: StagingTier
    name: str
    counters: StoreCounters
    policy: EvictionPolicy
    quota: TenantLedger | None
    lower: list[LowerIndex]
    local: list[LowerIndex]
    by_name: dict[str, LowerIndex]
    pins: Counter[ChunkKey]  # loads and write jobs holding a page
    writing: Counter[ChunkKey]  # write jobs reading a page (subset of pins)
    staged: dict[ChunkKey, StagedCopy]  # evicted chunks still queued for a write-back tier
    parent: dict[ChunkKey, ChunkKey | None]
    tenant: dict[ChunkKey, Writer]  # who each resident chunk was saved for, when known
    uses: Counter[ChunkKey]  # times each resident chunk was served (admission)
    epoch: int  # resets so far; loads, saves and writes planned in an older one never publish
    doomed: set[ChunkKey]  # dropped by a reset while pinned: freed at the last unpin
    ttl_pins: dict[ChunkKey, float]  # requests' TTL pins: chunk -> time.monotonic() deadline
    ttl_budget: int  # TTL pins held at most

    def resident(self, key: ChunkKey) -> bool:
        """In a cpu page and not doomed by a reset."""
        return self.cpu.contains(key) and key not in self.doomed

    def unpin(self, key: ChunkKey) -> None:
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]
            if key in self.doomed:
                self.doomed.discard(key)
                self._drop(key)

    def _job(self, lt: LowerIndex, key: ChunkKey, data: np.ndarray | None, evict_after: bool,
             tenant: Writer | None) -> WriteJob:
        """A write of ``key`` into ``lt``; one from a page (``data`` None) pins the page until :meth:`written`."""
        if data is None:
            self.pins[key] += 1
            self.writing[key] += 1
        return WriteJob(lt.name, key, self.parent.get(key), data, evict_after, self.epoch, tenant)

    # ---- eviction from the top tier: decided in may_free_page, done in evict_top ------------
    def may_free_page(self, key: ChunkKey, ahead: bool) -> bool:
        """Whether the page of resident ``key`` may be freed now: not pinned, no live TTL pin; ahead
        of need (a spill, or eviction after its write) with quotas only while its tenant stays at
        or above its guarantee."""
        if key in self.pins or self.ttl_pinned(key):
            return False
        return not ahead or self.quota is None or self.quota.above_guarantee(key)

    def evict_top(self, key: ChunkKey) -> None:
        """Drop a resident chunk from its page (an eviction, counted)."""
        with self.lock:
            self._drop(key)
            self.counters.evicted(self.name)

    def evict_below(self, tier: str, key: ChunkKey) -> None:
        """Evict ``key`` from the lower tier ``tier`` now (what its policy would do; drills and tests)."""
        with self.lock:
            self.by_name[tier].evict(key)
            self._note(key)

    def _drop(self, key: ChunkKey) -> None:
        self.cpu.delete(key)
        self.policy.remove(key)
        self.parent.pop(key, None)
        self.tenant.pop(key, None)
        self.uses.pop(key, None)
        self.ttl_pins.pop(key, None)
        if self.quota is not None:
            self.quota.remove(key)
        self._note(key)

    # ---- writes into lower tiers (run by the mover) ---------------------------------------
    def begin_write(self, job: WriteJob) -> tuple[np.ndarray, bool] | None:
        """A writer took ``job``: its bytes and whether room was made (victims evicted, the chunk
        pinned in its tier).  ``None``: planned before a reset of its tier, released here."""
        with self.lock:
            lt = self.by_name[job.tier]
            if job.epoch < lt.cleared_at:  # what it would write is gone
                self.written(job, False)
                return None
            data = self.cpu.view(job.key) if job.data is None else job.data
            room, evicted = lt.make_room(lt.tier.stored_bytes(data.size),
                                         job.tenant.quota_key if job.tenant is not None else None)
            for key in evicted:
                self._note(key)
            if room:
                lt.pin(job.key)
            return data, room

    def end_write(self, job: WriteJob, result: PutResult, room: bool) -> bool:
        """Apply what the write of ``job`` did (after :meth:`begin_write` returned ``room``);
        returns whether the chunk is now tracked in its tier."""
        with self.lock:
            lt = self.by_name[job.tier]
            if room:
                lt.unpin(job.key)
            if job.epoch < lt.cleared_at:  # reset while the write ran: it must not resurrect the chunk
                if result is PutResult.STORED:
                    lt.tier.delete(job.key)
                self._note(job.key)
                self.written(job, False)
                return False
            if lt.lost_contents():  # a recreated directory: the feed starts over
                self._resync()
            ok = result.stored
            if ok:
                lt.stored(job.key, job.parent, job.tenant.quota_key if job.tenant is not None else None)
            else:
                self.counters.dropped()
            self._note(job.key)
            self.written(job, ok)
            return ok

    def written(self, job: WriteJob, ok: bool) -> None:
        """``job`` is over (run, dropped, or never queued): release what it held in the top tier."""
        with self.lock:
            key = job.key
            if not job.from_top:
                copy = self.staged.get(key)
                if copy is not None:
                    copy.pending -= 1
                    if copy.pending <= 0:
                        del self.staged[key]
                        self._note(key)
                return
            self.writing[key] -= 1
            if self.writing[key] <= 0:
                del self.writing[key]
            self.unpin(key)
            if job.evict_after and ok and self.resident(key) and self.may_free_page(key, ahead=True):
                self.evict_top(key)

    def plan_flush(self, key: ChunkKey, full: Collection[str]) -> tuple[bool, list[WriteJob]]:
        """Writes of dirty ``key`` to the local tiers that lack it; ``(False, [])`` while one of
        their queues is ``full`` (ask again), ``(True, [])`` when nothing is needed any more."""
        with self.lock:
            missing = [lt for lt in self.local if not lt.tier.indexed(key)]
            if not self.resident(key) or key in self.writing or not missing:
                return True, []  # evicted (then staged and queued), already on its way, or written
            if any(lt.name in full for lt in missing):
                return False, []
            return True, [self._job(lt, key, None, evict_after=False, tenant=self.tenant.get(key))
                          for lt in missing]

    def adopt(self, name: str, found: RescanResult) -> int:
        """Take in a rescan of the local tier ``name`` (read by the caller without the lock)."""
        lt = self.by_name[name]
        with self.lock:
            tier = lt.tier
            assert isinstance(tier, Rescannable), f"{name} cannot rescan"
            found = tier.adopt(found)
            changed, _evicted = lt.adopt(found)
            for key in changed:
                self._note(key)
        return len(found.adopted) + len(found.gone)

    # ---- TTL pins and resets -------------------------------------------------------------
    def ttl_pin(self, keys: Sequence[ChunkKey], deadline: float) -> tuple[int, int]:
        """Keep resident ``keys`` until ``deadline`` (``time.monotonic()``); at most
        ``ttl_budget`` chunks pinned at once.  Returns ``(pinned, refused)``."""
        pinned = refused = 0
        with self.lock:
            for key in keys:
                if not self.resident(key):
                    continue
                if key in self.ttl_pins:
                    self.ttl_pins[key] = max(self.ttl_pins[key], deadline)
                elif len(self.ttl_pins) < self.ttl_budget or self._expired_room():
                    self.ttl_pins[key] = deadline
                else:
                    refused += 1
                    continue
                pinned += 1
        return pinned, refused

    def _expired_room(self) -> bool:
        self.expire_ttl_pins()
        return len(self.ttl_pins) < self.ttl_budget

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

    def clear(self, names: Collection[str]) -> dict[str, ClearResult]:
        """A reset of the tiers in ``names``: bump :attr:`epoch` (no load or save planned before
        publishes, no write planned before lands in a cleared tier); the top tier drops every
        resident and staged chunk except pinned ones, which are doomed (freed at the last unpin)."""
        out: dict[str, ClearResult] = {}
        with self.lock:
            self.epoch += 1
            if self.name in names:
                removed = [k for k in self.cpu.keys() if k not in self.doomed]  # noqa: SIM118 - a list
                self.ttl_pins.clear()
                for key in removed:
                    if key in self.pins:
                        self.doomed.add(key)
                    else:
                        self._drop(key)
                for key in list(self.staged):  # queued writes keep their copies
                    del self.staged[key]
                    if key not in removed:
                        removed.append(key)
                out[self.name] = ClearResult(removed)
            for lt in self.lower:
                if lt.name in names:
                    out[lt.name] = lt.clear(self.epoch)
            self._resync()
        return out

    # ---- checks and numbers --------------------------------------------------------------
    def check(self, expect_idle: bool) -> None:
        """Assert every invariant: the cpu tier's page accounting; its policy tracks exactly the
        resident chunks (both ways); TTL pins, pins, staged copies and writes name held chunks;
        each lower tier's usage ≤ capacity and policy == contents; the tenant ledgers; and with
        ``expect_idle`` that nothing is pinned and no write is planned.

        Raises:
            AssertionError: naming the broken invariant.
        """
        with self.lock:
            self.cpu.check()
            usage = self.cpu.usage()
            assert usage.used_bytes + usage.free_bytes == usage.capacity_bytes
            assert usage.used_bytes <= usage.capacity_bytes, f"{self.name} holds more than its capacity"
            resident = set(self.cpu.keys())
            tracked = set(self.policy.keys())
            assert resident == tracked, \
                f"{self.name} policy tracks {len(tracked)} chunks but {len(resident)} are resident"
            assert set(self.ttl_pins) <= resident, f"{self.name} TTL-pins chunks that are not resident"
            assert set(self.pins) <= resident, f"{self.name} pins chunks that are not resident"
            assert set(self.writing) <= set(self.pins), "a write reads a page it does not pin"
            assert all(self.pins[k] >= n for k, n in self.writing.items()), "more writes than pins of a page"
            assert self.doomed <= set(self.pins), "a doomed chunk is not pinned (it should have been freed)"
            assert set(self.parent) <= resident and set(self.uses) <= resident, "bookkeeping of evicted chunks"
            assert all(c.pending > 0 for c in self.staged.values()), "a staged copy no write waits for"
            if self.quota is not None:
                self.quota.check(resident)
            for lt in self.lower:
                lt.check()
            if expect_idle:
                lower_pins = {lt.name: len(lt.pins) for lt in self.lower if lt.pins}
                assert not self.pins and not lower_pins, \
                    f"pins left behind: {len(self.pins)} {self.name}, {lower_pins}"
                assert not self.writing and not self.staged, "writes still in flight"

    def tier_stats(self) -> dict[str, TierStats]:
        """Each tier's usage, pins, TTL pins, errors and tenant bytes now (for :class:`~kvtier.core.stats.StoreStats`)."""
        with self.lock:
            self.expire_ttl_pins()
            pinned = {self.name: len(self.pins), **{lt.name: len(lt.pins) for lt in self.lower}}
            ttl_pinned = {self.name: len(self.ttl_pins)}
            ledgers = {self.name: self.quota, **{lt.name: lt.quota for lt in self.local}}
            tiers = {self.name: self.cpu, **{lt.name: lt.tier for lt in self.lower}}
            return {name: TierStats(u.used_bytes, u.capacity_bytes, u.num_chunks, corrupt_chunks=t.corrupt,
                                    pinned_chunks=pinned.get(name, 0), wire=t.wire_stats(),
                                    write_errors=t.write_errors, ttl_pinned_chunks=ttl_pinned.get(name, 0),
                                    **_tenant_stats(ledgers.get(name), u.num_chunks, self.chunk_bytes))
                    for name, t in tiers.items() for u in (t.usage(),)}


def _tenant_stats(ledger: TenantLedger | None, num_chunks: int, chunk_bytes: int) -> dict[str, Any]:
    """A tier's per-tenant bytes and quota evictions for its :class:`TierStats` (none without quotas)."""
    if ledger is None:
        return {}
    return {"tenant_used_bytes": ledger.usage_by_label(chunk_bytes, num_chunks - len(ledger.owner)),
            "quota_evictions": ledger.quota_evictions}
