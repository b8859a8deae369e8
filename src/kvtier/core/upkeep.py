"""The index's cold half: saves, the outcomes of writes, TTL pins, resets, rescans.

:class:`IndexUpkeep` is the part of :class:`~kvtier.core.index.Index` off a load's path: saves
(``plan_store``, ``complete_store``, spills ahead, a write-back victim's staged copy), what the mover's
writers report (``begin_write``, ``end_write``, ``written``, and ``let_go``, what the eviction gate
deferred), rescans, TTL pins and resets (its invariants: :mod:`kvtier.core.indexcheck`).  A load's path
and what a worker asks once per engine step (the change feed's drain, the eviction gate's verbs, the
tiers' numbers) are :mod:`kvtier.core.index`'s.  Same lock, same state (:class:`~kvtier.core.changes.IndexState`,
set up there), calling the index's methods (where a chunk is, pins, publication, what may be evicted);
no threads, no callbacks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from kvtier.core.changes import IndexState
from kvtier.core.context import NotHeld, OpContext, SaveDropped
from kvtier.core.ghosts import Ghost
from kvtier.core.handles import Read, StagedCopy, StoreHandle, StorePlan, WriteJob
from kvtier.core.keys import ChunkKey
from kvtier.core.lowerindex import LowerIndex
from kvtier.core.receipt import MissReason
from kvtier.core.tenant import Writer
from kvtier.core.tiers.base import (
    AlreadyHeld,
    ClearResult,
    NoRoom,
    Paged,
    PutResult,
    Rescannable,
    ReserveResult,
)

if TYPE_CHECKING:
    from kvtier.core.tiers.disk.scan import RescanResult


class IndexUpkeep(IndexState):
    """Saves, writes' outcomes, TTL pins, resets and rescans (see the module docstring)."""

    if TYPE_CHECKING:  # defined by Index (kvtier.core.index): a load's path and the step's verbs
        def holds(self, key: ChunkKey) -> bool: ...
        def resident(self, key: ChunkKey) -> bool: ...
        def unpin(self, keys: Sequence[ChunkKey]) -> None: ...
        def publish(self, key: ChunkKey, parent: ChunkKey | None, tenant: Writer | None = None,
                    owner: bytes | None = None) -> None: ...
        def _note(self, key: ChunkKey) -> None: ...
        def _forget(self, key: ChunkKey) -> None: ...
        def may_free_page(self, key: ChunkKey, ahead: bool) -> bool: ...
        def expire_ttl_pins(self) -> None: ...

    def _job(self, lt: LowerIndex, key: ChunkKey, data: np.ndarray | None, evict_after: bool,
             tenant: Writer | None) -> WriteJob:
        """A write of ``key`` into ``lt``; one from a page (``data`` None) pins the page until :meth:`written`."""
        if data is None:
            self.pins[key] += 1
            self.writing[key] += 1
        return WriteJob(lt.name, key, self.parent.get(key), data, evict_after, self.epoch, tenant)

    def _stage(self, victim: ChunkKey, writes: list[WriteJob]) -> None:
        """Before ``victim`` leaves its page: write-back tiers that lack it and admit it get a write in ``writes``,
        from a staged copy (so the page is free now; the writes happen on the mover)."""
        if missing := self._admitting(victim):
            copy = self.staged.get(victim) or self.staged.setdefault(victim, StagedCopy(self.cpu.view(victim).copy()))
            for lt in missing:
                writes.append(self._job(lt, victim, copy.data, evict_after=False, tenant=self.tenant.get(victim)))
                copy.pending += 1

    def _admitting(self, victim: ChunkKey) -> list[LowerIndex]:
        """Write-back tiers that lack ``victim`` and whose admission takes it."""
        uses = self.uses.get(victim, 0)
        return [lt for lt in self.back if not lt.tier.indexed(victim) and lt.admission.judge(victim, uses)]

    def _drop(self, key: ChunkKey) -> None:
        self.cpu.delete(key)
        self.policy.remove(key)
        self._forget(key)

    def evict_top(self, key: ChunkKey, quota: bool = False) -> None:
        """Drop a resident chunk from its page (an eviction, counted, remembered in the top tier's
        ghost list: :meth:`top_loss`; ``quota``: the tenant quotas chose it)."""
        with self.lock:
            self.ghosts.add(self.name, key, *self.top_loss(key, self.uses.get(key, 0), quota))
            self._drop(key)
            self.counters.evicted(self.name)

    def top_loss(self, key: ChunkKey, uses: int, quota: bool) -> tuple[MissReason, str | None]:
        """Why the top tier's eviction of ``key`` loses it: ``("quota", None)`` when the tenant quotas chose
        the victim; ``("not_admitted", tier)`` when write-back tiers (``back``) exist and none holds ``key`` or
        admits it (the first that refused); else ``("evicted", None)`` (it moves down, or is held below)."""
        if quota:
            return "quota", None
        if not self.back or any(lt.tier.indexed(key) or lt.admission.judge(key, uses) for lt in self.back):
            return "evicted", None
        return "not_admitted", self.back[0].name

    # ---- room in the top tier: what may go is Index.may_free_page's (kvtier.core.index) ----
    def free_page(self, tenant: bytes | None, writes: list[WriteJob]) -> bool:
        """Make sure one cpu page is free, evicting if needed (a write-back tier that lacks the
        victim gets a staged copy, its write in ``writes``); False if nothing may go (with quotas,
        for ``tenant``, the quota's tenant key of whoever needs the page)."""
        if self.cpu.can_reserve():
            return True
        if self.gate.closed:  # may_free_page says no to every chunk: no victim to look for
            return False
        evictable = partial(self.may_free_page, ahead=False)
        chose = self.quota.quota_evictions if self.quota is not None else 0
        victim = self.quota.victim(self.policy, evictable, tenant) if self.quota is not None \
            else self.policy.victim(evictable)
        if victim is None:
            return False
        self._stage(victim, writes)
        self.evict_top(victim, self.quota is not None and self.quota.quota_evictions != chose)
        return True

    def reserve_each(self, run: Sequence[tuple[int, ChunkKey, LowerIndex]], targets: Sequence[object | None],
                     got: list[ReserveResult | None], writes: list[WriteJob]) -> Ghost | None:
        """``Index._read_run``'s pages with tenant quotas (a victim depends on the chunk's tenant): one chunk at
        a time (:meth:`free_page`) into ``got``, each ghost taken before the chunk's own eviction
        (:mod:`kvtier.core.ghosts`); returns the first chunk's ghost."""
        ghosts = []
        for k, ((_, key, lt), target) in enumerate(zip(run, targets)):
            ghosts.append(self.ghosts.take(self.name, key) if key in self.top_ghosts else None)
            if target is None:
                got[k] = self.cpu.reserve(key) if self.free_page(lt.owner(key), writes) else NoRoom.NO_ROOM
        return ghosts[0] if ghosts else None

    # ---- what is where (lookups of tools and tests, the change feed's snapshot) ----------------
    def lookup(self, chain: Sequence[ChunkKey]) -> tuple[int, Counter[str]]:
        """Leading chunks of ``chain`` in the top or a local lower tier, and how many per tier."""
        found = Counter[str]()
        n = 0
        with self.lock:
            for key in chain:
                if self.holds(key):
                    found[self.name] += 1
                else:
                    lt = next((lt for lt in self.local if lt.tier.contains(key)), None)
                    if lt is None:
                        break
                    found[lt.name] += 1
                n += 1
        return n, found

    # ---- store ---------------------------------------------------------------------------
    def plan_store(self, chain: Sequence[ChunkKey], start: int, ctx: OpContext, explain: int = -1,
                   touch_end: int = 0) -> StorePlan:
        """Reserve top-tier pages for ``chain[start:]`` chunks no local tier holds yet (the pages' victims
        spilled to a write-back tier are the plan's ``writes``) for ``ctx`` (its tenant, kept in the
        handle); the chain ends at the first chunk that gets no page (``SaveDropped``; the top tier's
        ghost list remembers why).  A chunk saved again leaves the ghost lists (:mod:`kvtier.core.ghosts`);
        the one at ``explain``, if not held, is explained to ``ctx`` (``NotHeld``: the latest loss
        remembered, or ``new``; both :mod:`kvtier.core.context`).  The chunks of ``chain[start:touch_end]``
        resident in the top tier (served by the engine's own prefix cache) are touched there, in prompt order."""
        tenant = ctx.tenant
        handle = StoreHandle([], [], [], [], tenant=tenant, ctx=ctx)
        writes: list[WriteJob] = []
        owner = tenant.salt if tenant is not None else None  # the quota's tenant key
        with self.lock:
            handle.epoch = self.epoch
            if touch_end > start and (used := [k for k in chain[start:touch_end] if self.resident(k)]):
                self.policy.touch(used)  # the engine served them: a use, as a load's (no ``uses``: not from here)
            for i in range(start, len(chain)):
                key = chain[i]
                if self.holds(key) or any(lt.tier.indexed(key) for lt in self.local):
                    continue
                ghost = self.ghosts.take_all(key)
                if i == explain:
                    ctx.sink.emit(NotHeld(i, "", "new") if ghost is None else NotHeld(i, ghost.tier, ghost.reason))
                got = self.cpu.reserve(key) if self.free_page(owner, writes) else NoRoom.NO_ROOM
                if got is AlreadyHeld.ALREADY_HELD:  # being promoted from a lower tier: stored when that ends
                    continue
                if got is NoRoom.NO_ROOM:
                    ctx.sink.emit(SaveDropped(len(chain) - i, "no_room"))
                    self.ghosts.add_many(self.name, chain[i:], "quota" if self.quota is not None else "save_dropped")
                    break
                handle.keys.append(key)
                handle.indices.append(i)
                handle.parents.append(chain[i - 1] if i > 0 else None)
                handle.buffers.append(got.buffer)
        return StorePlan(handle, writes)

    def complete_store(self, handle: StoreHandle, success: bool, free_slots: dict[str, int]) -> StorePlan | None:
        """Publish (``success`` and no reset since) or give back ``handle``'s pages.  Returns the
        published ``handle`` with its ``writes`` (write-through copies, spills ahead;
        ``free_slots``: each tier's free queue slots), ``None`` when nothing was published
        (failed, reset since, or released already)."""
        writes: list[WriteJob] = []
        with self.lock:
            if handle.done:
                return None
            handle.done = True
            success = success and handle.epoch == self.epoch  # bytes copied before a reset: not stored
            for key, parent in zip(handle.keys, handle.parents):
                if not success:
                    self.cpu.abort(key)
                    continue
                self.publish(key, parent, handle.tenant)
                for lt in self.through:  # a shared server may have lost what this process wrote
                    if lt.shared or not lt.tier.indexed(key):  # (restart, its own eviction, TTL): write again
                        writes.append(self._job(lt, key, None, evict_after=False, tenant=handle.tenant))
            if not success:
                return None
            self.spill_ahead(free_slots, writes)
            return StorePlan(handle, writes)

    def spill_ahead(self, free_slots: dict[str, int], writes: list[WriteJob]) -> None:
        """Plan write-backs of likely victims so free pages stay above ``spill_watermark``."""
        if self.gate.closed or not self.back or not isinstance(self.cpu, Paged) or not self.cpu.num_pages:
            return  # (closed: may_free_page says no to every chunk)
        want = int(self.spill_watermark * self.cpu.num_pages)
        free = self.cpu.usage().free_bytes // self.chunk_bytes
        writing = self.writing
        while free + len(writing) < want and all(free_slots.get(lt.name, 0) > 0 for lt in self.back):
            victim = self.policy.victim(lambda k: self.may_free_page(k, ahead=True) and k not in writing)
            if victim is None:
                return
            if not (missing := self._admitting(victim)):
                self.evict_top(victim)
                free += 1
                continue
            for lt in missing:
                free_slots[lt.name] -= 1
                writes.append(self._job(lt, victim, None, evict_after=True, tenant=self.tenant.get(victim)))

    def give_back(self, reads: Sequence[Read]) -> None:
        """Reads that will not run: unpin their lower-tier chunks, release their reserved pages."""
        with self.lock:
            for r in reads:
                if not r.shared:
                    self.by_name[r.tier].unpin(r.key)
                if r.reserved:
                    self.cpu.abort(r.key)

    def lost_below(self, lt: LowerIndex, key: ChunkKey, reason: MissReason) -> None:
        """A read found ``key`` in ``lt`` corrupt (counted by the tier) or removed by another process: forget it
        there, its ghost list remembering why (``reason``)."""
        lt.forget(key)
        self.ghosts.add(lt.name, key, reason)
        self._note(key)

    def evict_below(self, tier: str, key: ChunkKey) -> None:
        """Evict ``key`` from the lower tier ``tier`` now (what its policy would do; drills and tests)."""
        with self.lock:
            self.by_name[tier].evict(key)
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
        """Apply what ``job``'s write did (``room``: :meth:`begin_write`'s); whether its tier now tracks the chunk."""
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
                if not ok:  # a write-back victim's copy that never reached its tier: lost with it
                    self.ghosts.lists[self.name].mark(key, "save_dropped", job.tier)
                copy = self.staged.get(key)
                if copy is not None:
                    copy.pending -= 1
                    if copy.pending <= 0:
                        self.let_go(key)
                return
            self.writing[key] -= 1
            if self.writing[key] <= 0:
                del self.writing[key]
            self.unpin((key,))
            if job.evict_after and ok:
                self.let_go(key)

    def let_go(self, key: ChunkKey) -> None:
        """``key``'s writes are over: drop its staged copy (none pending), or evict its page if it
        may be freed and every write-back tier holds it; while the eviction gate is closed, this
        waits for it to open (:mod:`kvtier.core.gate`)."""
        if self.gate.closed:
            self.gate.deferred[key] = None
            return
        copy = self.staged.get(key)
        if copy is not None and copy.pending <= 0:
            del self.staged[key]
            self._note(key)
        elif copy is None and self.resident(key) and self.may_free_page(key, ahead=True) and not self._admitting(key):
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
            return True, [self._job(lt, key, None, evict_after=False, tenant=self.tenant.get(key)) for lt in missing]

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
                self.ghosts.add_many(self.name, removed, "reset")
                out[self.name] = ClearResult(removed)
            for lt in self.lower:
                if lt.name in names:
                    out[lt.name] = lt.clear(self.epoch)
            self._resync()
        return out
