"""The store's index: where every chunk is, who holds it, and what must move (no threads, no I/O waits).

One :class:`Index` per :class:`~kvtier.core.store.TieredStore` holds all placement state under one lock
(:class:`~kvtier.core.changes.IndexState`: pages, policies, pins, staged copies, each lower tier's
:class:`~kvtier.core.lowerindex.LowerIndex`, the reset epoch, ghost lists, the change feed).  This module is
what a hit runs: a load's whole path through that state, and what a worker asks once per engine step.

- :meth:`plan_load` / :meth:`plan_shared`: a :class:`~kvtier.core.handles.LoadPlan` (each chunk's source tier
  and buffer, pinned; the :class:`~kvtier.core.handles.Read` s to run); :meth:`complete_reads` applies what
  the reads found (publish, cut the prefix); :meth:`release` unpins;
- once per step: :meth:`drain_changes` (:mod:`kvtier.core.changes`), :meth:`gate_evictions` and
  :meth:`pin_resident` (:mod:`kvtier.core.gate`), :meth:`tier_stats`;
- saves, writes' outcomes, resets and rescans: :mod:`kvtier.core.upkeep`.

The :class:`~kvtier.core.mover.Mover` runs the plans and reports back by calling these verbs (the index
never calls the mover); the index itself touches only the cpu tier's page map, a lower tier's ``delete``
of an eviction victim and ``clear`` on a reset.  What may leave the top tier is decided in one place,
:meth:`Index.may_free_page` (with the eviction gate; a promotion with no TTL pin passes the policy its pins
instead, the same rule); ``evict_top`` (:mod:`kvtier.core.upkeep`) and ``_evict_many`` (promotions) evict.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from itertools import islice, repeat, takewhile

import numpy as np

from kvtier.core.changes import IndexDelta, count_each
from kvtier.core.ghosts import EVICTION_REASONS, Ghost
from kvtier.core.handles import NO_BUFFER, LoadHandle, LoadPlan, Read, WriteJob
from kvtier.core.keys import ChunkKey
from kvtier.core.lowerindex import LowerIndex
from kvtier.core.quota import tenant_stats
from kvtier.core.stats import TierStats
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.base import GetResult, NoRoom, Reservation, ReserveResult
from kvtier.core.upkeep import IndexUpkeep


class Index(IndexUpkeep):
    """All placement state of one store (see the module docstring; built as :class:`~kvtier.core.changes.IndexState`
    says: ``Index(cpu, lower, config, counters, chunk_bytes, observe)``)."""

    # ---- what is where -------------------------------------------------------------------
    def holds(self, key: ChunkKey) -> bool:
        """In the top tier: resident in a page or staged (a doomed chunk is neither)."""
        return self.resident(key) or key in self.staged

    def _dirty(self, key: ChunkKey) -> bool:
        return bool(self.local) and self.holds(key) and not any(lt.tier.indexed(key) for lt in self.local)

    def _note(self, key: ChunkKey) -> None:
        """Record that ``key``'s tiers may have changed (the lock held)."""
        if self._dirty(key):
            self._dirty_keys.add(key)
        else:
            self._dirty_keys.discard(key)
        if self._full_next:
            return
        self._changed[key] = None
        if len(self._changed) > self.change_feed_limit:
            self._changed.clear()
            self._full_next = True

    def resident(self, key: ChunkKey) -> bool:
        """In a cpu page and not doomed by a reset."""
        return self.cpu.contains(key) and key not in self.doomed

    def _tier_of(self, key: ChunkKey) -> str | None:
        """Best local tier holding ``key`` now, or None (the lock held; ``holds`` inlined: the drain asks it per key)."""
        if (self.cpu.contains(key) and key not in self.doomed) or key in self.staged:
            return self.name
        return next((lt.name for lt in self.local if lt.tier.indexed(key)), None)

    # ---- once per engine step (the worker's, around the drain): the feed, the gate, the numbers ----
    def drain_changes(self, max_items: int = 4096) -> IndexDelta:
        """Changes since the last drain, at most ``max_items`` (a full snapshot is sent whole); ``ValueError``
        if ``max_items`` is not positive."""
        if max_items <= 0:
            raise ValueError(f"max_items must be positive, got {max_items}")
        with self.lock:
            if self._full_next:  # (kvtier.core.changes: the first drain, or one after a resync)
                return self._full_snapshot()
            taken = list(islice(self._changed, max_items))
            for key in taken:
                del self._changed[key]
            return IndexDelta([(k, self._tier_of(k)) for k in taken])

    def dirty_bytes(self) -> int:
        """Payload bytes a crash would lose: ``len(dirty_keys()) × chunk_bytes``."""
        return len(self._dirty_keys) * self.chunk_bytes

    def gate_evictions(self, closed: bool) -> bool:
        """Close the eviction gate, or open it and let go what waited for it; returns whether it was closed."""
        with self.lock:
            was, self.gate.closed = self.gate.closed, closed
            for policy in (self.policy, *(lt.policy for lt in self.local)) if closed else ():  # once per engine
                if policy is not None and policy.pending:  # step, off the request's path: the policies' deferred
                    policy.settle()  # work (the adaptive policy's shadow replay)
            for key in self.gate.take() if not closed and self.gate.deferred else ():  # (no call into gate.py
                self.let_go(key)  # on the hit path)
            return was

    def pin_resident(self, chain: Sequence[ChunkKey]) -> LoadHandle:
        """Pin the chunks of ``chain`` resident in the top tier now (no I/O); released by :meth:`release`."""
        handle = LoadHandle([], [], [])
        with self.lock:
            handle.pinned = [k for k in chain if self.cpu.contains(k) and k not in self.doomed]  # (resident)
            self.pins.update(handle.pinned)  # (Counter.update adds: one pin each)
        return handle

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
        if deadline is None or deadline > time.monotonic():
            return deadline is not None
        del self.ttl_pins[key]
        return False

    def expire_ttl_pins(self) -> None:
        """Forget TTL pins whose deadline passed."""
        now = time.monotonic()
        for key in [k for k, d in self.ttl_pins.items() if d <= now]:
            del self.ttl_pins[key]

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

    # ---- load ----------------------------------------------------------------------------
    def plan_load(self, chain: Sequence[ChunkKey], limit: int, top_only: bool) -> LoadPlan:
        """Pin the longest prefix of ``chain[:limit]`` held in the top or a local lower tier (``top_only``: the
        top tier alone); chunks below the top tier get a :class:`Read` into a reserved cpu page (or a private
        buffer when no page may be freed)."""
        plan = LoadPlan(handle := LoadHandle([], [], []))
        below: list[list[bool]] = []  # each local tier's contains_many(chain[start:limit]), asked once
        start = i = 0
        with self.lock:  # (resident(), inlined: the hit path asks it per chunk)
            contains, view, doomed, pins, name = self.cpu.contains, self.cpu.view, self.doomed, self.pins, self.name
            while i < limit:
                key = chain[i]
                if contains(key) and key not in doomed:  # the run held from here on, found and listed in C
                    found = list(takewhile(contains if not doomed else self.resident, islice(chain, i, limit)))
                    count_each(pins, found)  # (Counter.update's C helper: one pin each)
                    handle.pinned.extend(found)
                    handle.keys.extend(found)
                    handle.buffers.extend(map(view, found))
                    handle.tiers.extend(repeat(name, len(found)))
                    i += len(found)
                elif key in self.staged:  # a private copy, immutable: no pin needed
                    handle.keys.append(key)
                    handle.buffers.append(self.staged[key].data)
                    handle.tiers.append(name)
                    i += 1
                elif top_only:
                    break
                else:  # the run of chunks held below from here on, promoted in one batch (_read_run); the chunk
                    if not below:  # that ended it is looked at again (the run's evictions may have taken it)
                        start, below = i, [lt.tier.contains_many(chain[i:limit]) for lt in self.local]
                    run: list[tuple[int, ChunkKey, LowerIndex]] = []
                    while i < limit and not (contains(key := chain[i]) and key not in doomed) and key not in self.staged \
                            and (lt := next((lt for lt, held in zip(self.local, below) if held[i - start]), None)):
                        lt.pins[key] += 1  # (LowerIndex.pin, inlined on the hit path)
                        run.append((i, key, lt))
                        i += 1
                    if not run:
                        break
                    handle.keys.extend(key for _, key, _ in run)
                    handle.buffers.extend(self._read_run(plan, run))
                    handle.tiers.extend(lt.name for _, _, lt in run)
        return plan

    def plan_shared(self, plan: LoadPlan, start: int, keys: Sequence[ChunkKey]) -> None:
        """Extend ``plan`` (whose prefix ends at ``start``) with reads of ``keys`` from the first shared tier."""
        lt = self.shared[0]
        with self.lock:
            run = [(start + offset, key, lt) for offset, key in enumerate(keys)]
            plan.handle.keys.extend(keys)
            plan.handle.buffers.extend(self._read_run(plan, run))
            plan.handle.tiers.extend(lt.name for _ in keys)

    def _read_run(self, plan: LoadPlan, run: Sequence[tuple[int, ChunkKey, LowerIndex]]) -> list[np.ndarray]:
        """Plan the reads of ``run`` (chunks held below: chain position, key, tier) and return their buffers:
        none where ``plan.into`` gives a shared read a destination, else a reserved cpu page while one is free
        or may be freed, else a private buffer.  As one chunk at a time would, in one call each to the cpu
        tier, the policy and the ghost lists; with tenant quotas (a victim depends on the chunk's tenant) one
        chunk at a time (:meth:`free_page`)."""
        into = plan.into
        targets = [into(pos) if lt.shared and into is not None else None for pos, _, lt in run]
        got: list[ReserveResult | None] = [None] * len(run)  # None: no page wanted (a shared read's destination)
        if self.quota is not None:  # (kvtier.core.upkeep: the quotas' own path)
            ghost = self.reserve_each(run, targets, got, plan.writes)
        else:
            paged = [k for k, target in enumerate(targets) if target is None]
            for k, first_got in zip(paged, self.cpu.reserve_many([run[k][1] for k in paged])):
                got[k] = first_got
            # once pages ran out (after the last reservation) each chunk frees one if none is free, held ones too
            ran_out = any(got[k] is NoRoom.NO_ROOM for k in paged) or not self.cpu.can_reserve()
            short = max((j + 1 for j, k in enumerate(paged) if isinstance(got[k], Reservation)), default=0) \
                if ran_out else len(paged)
            need, free = [], 0
            for k in paged[short:]:
                if free == 0:
                    need.append(k)
                    free += 1
                free -= got[k] is NoRoom.NO_ROOM  # (else it is held already: no page taken)
            victims = (self.policy.evict(len(need), held=self.pins) if not self.ttl_pins else self.policy.evict(
                len(need), partial(self.may_free_page, ahead=False))) if need and not self.gate.closed else []
            ghost = self._evict_many([key for _, key, _ in run], dict(zip(need, victims)), plan.writes)
            end = need[len(victims)] if len(victims) < len(need) else len(run)  # no victim from there on
            again = [k for k in paged[short:] if k < end and got[k] is NoRoom.NO_ROOM]
            for k, again_got in zip(again, self.cpu.reserve_many([run[k][1] for k in again])):
                got[k] = again_got
        if plan.handle.below is None and run:
            plan.handle.below = (run[0][0], run[0][2].name, ghost.reason if ghost is not None else "new")
        bufs: list[np.ndarray] = []
        for (pos, key, lt), target, result in zip(run, targets, got):
            if target is not None:
                plan.reads.append(Read(pos, key, NO_BUFFER, False, lt.name, True, self.epoch, target))
                bufs.append(NO_BUFFER)
                continue
            reserved = isinstance(result, Reservation)
            buf = result.buffer if isinstance(result, Reservation) else np.empty(self.chunk_bytes, dtype=np.uint8)
            plan.reads.append(Read(pos, key, buf, reserved, lt.name, lt.shared, self.epoch))
            bufs.append(buf)
        return bufs

    def complete_reads(self, chain: Sequence[ChunkKey], handle: LoadHandle, batch: Sequence[Read],
                       results: Sequence[GetResult], records: TenantRecords) -> int:
        """Apply what reads of ``batch`` found: publish the chunks that arrived (pinned for
        ``handle``), forget corrupt or vanished ones (remembering why: :mod:`kvtier.core.ghosts`),
        cut the prefix at the first chunk that did not arrive (or was planned before a reset);
        returns the epoch it judged that by."""
        with self.lock:
            failed = [r.pos for r, res in zip(batch, results) if res is not GetResult.HIT or r.epoch != self.epoch]
            cut = min(failed) if failed else None
            # the pages published below, committed in one call first (nothing in the loop asks another key's page)
            self.cpu.commit_many([r.key for r in batch if r.reserved and (cut is None or r.pos < cut)])
            inserted: list[tuple[ChunkKey, ChunkKey | None]] = []  # the policy's inserts, in one call after the loop
            for r, res in zip(batch, results):
                lt = self.by_name[r.tier]
                if not r.shared:  # (LowerIndex.unpin, inlined on the hit path)
                    lt.pins[r.key] -= 1
                    if lt.pins[r.key] <= 0:
                        del lt.pins[r.key]
                if res is GetResult.CORRUPT or (res is GetResult.MISS and not r.shared and not lt.tier.indexed(r.key)):
                    self.lost_below(lt, r.key, "corrupt" if res is GetResult.CORRUPT else "purged")
                if cut is not None and r.pos >= cut:
                    if r.reserved:
                        self.cpu.abort(r.key)
                    continue
                if r.reserved:
                    self.publish(r.key, chain[r.pos - 1] if r.pos > 0 else None, records.get(r.key),
                                 owner=lt.quota.owner.get(r.key) if lt.quota is not None else None,  # (LowerIndex.owner)
                                 inserted=inserted)
                    self.pins[r.key] += 1
                    handle.pinned.append(r.key)
            self.policy.insert_many(inserted)
            if cut is not None:  # everything from the first unusable chunk on is dropped
                for key in handle.keys[cut:]:
                    if key in handle.pinned:
                        handle.pinned.remove(key)
                        self.unpin((key,))
                del handle.keys[cut:], handle.buffers[cut:], handle.tiers[cut:]
            return self.epoch

    def start_read_ahead(self, handle: LoadHandle, ahead_from: int) -> bool:
        """Mark ``handle`` as reading chunks ``ahead_from`` on in the background; False if its prefix ends before."""
        with self.lock:
            if len(handle.keys) <= ahead_from:  # (num_chunks)
                return False
            handle.ahead_from, handle.reading_ahead = ahead_from, True
            return True

    def end_read_ahead(self, handle: LoadHandle) -> None:
        """The background reads of ``handle`` ended; unpin it now if it was released meanwhile."""
        with self.lock:
            handle.reading_ahead, refresh = False, handle.release_after_read
            if refresh is not None:
                self.unpin_load(handle, refresh)

    def release(self, handle: LoadHandle, refresh: bool) -> bool:
        """Unpin ``handle`` once (after its reads ahead, if they run); on ``refresh`` mark its chunks used; False if done."""
        with self.lock:
            if handle.done:
                return False
            handle.done = True
            if handle.reading_ahead:  # unpinned by the read-ahead when its reads end
                handle.release_after_read = refresh
            else:
                self.unpin_load(handle, refresh)  # (under the same hold of the lock: the hit path)
            return True

    def unpin_load(self, handle: LoadHandle, refresh: bool) -> None:
        """Unpin ``handle``'s chunks; on ``refresh`` mark them used (the policies' touch, ``uses``); the lock held."""
        self.unpin(handle.pinned)
        handle.pinned = []
        if refresh and handle.keys:
            used = list(filter(self.cpu.contains, handle.keys))  # (the cpu tier's contains is C: no frame)
            used = [k for k in used if k not in self.doomed] if self.doomed else used
            self.policy.touch(used)
            count_each(self.uses, used)  # +1 each (Counter.update's C helper: no frame per hit)
            for lt in self.local:
                below = [k for k, t in zip(handle.keys, handle.tiers) if t == lt.name]
                if below and lt.policy is not None:
                    lt.policy.touch(below)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Unpin each of ``keys`` once (a load's chunks in one call: the hit path)."""
        pins, doomed = self.pins, self.doomed
        if not doomed and max(map(pins.get, keys, repeat(0)), default=0) <= 1:  # each pinned once at most:
            list(map(pins.pop, keys, repeat(None)))  # every pin goes, nothing to drop (in C, no loop per chunk)
            return
        for key in keys:
            left = pins.get(key, 0) - 1
            if left > 0:
                pins[key] = left
            else:
                pins.pop(key, None)
                if key in doomed:
                    doomed.discard(key)
                    self._drop(key)

    def publish(self, key: ChunkKey, parent: ChunkKey | None, tenant: Writer | None = None,
                owner: bytes | None = None, inserted: list[tuple[ChunkKey, ChunkKey | None]] | None = None) -> None:
        """Commit a reserved page and track it (saved for ``tenant`` when known; ``owner``: the quota's tenant
        key when ``tenant`` gives none, e.g. a promotion's lower-tier ledger; ``inserted``: the caller committed
        the page and inserts ``(key, parent)`` into the policy itself, a load's chunks in one call each)."""
        if inserted is None:
            self.cpu.commit(key)
        self.parent[key] = parent
        if tenant is not None:
            self.tenant[key] = tenant
        if self.quota is not None:
            quota_key = tenant.quota_key if tenant is not None else None
            self.quota.add(key, quota_key if quota_key is not None else owner)
        if inserted is None:
            self.policy.insert(key, parent)
        else:
            inserted.append((key, parent))
        self._note(key)

    def _evict_many(self, keys: Sequence[ChunkKey], lost: dict[int, ChunkKey], writes: list[WriteJob]) -> Ghost | None:
        """Let go the victims the policy chose already (``EvictionPolicy.evict``) for a run of ``keys`` promoted into
        the top tier (``lost[i]``: the victim whose page ``keys[i]`` takes) as :meth:`free_page` and :meth:`evict_top`
        would one at a time: each key forgets its ghost (a ghost hit, ``Ghosts.take``) before its victim's is listed
        (the reason: ``top_loss``, with write-back tiers; ``GhostList.add``'s steps, inlined on the hit path); then
        one call each into the cpu tier and the counters.  Returns the first key's ghost (``None``: it is ``new``)."""
        ghosts, top, listed, first = self.ghosts, self.ghosts.lists[self.name], self.top_ghosts, None
        for i, key in enumerate(keys):
            ghost = ghosts.take(self.name, key) if key in listed else None
            first = ghost if i == 0 else first
            if (victim := lost.get(i)) is not None:
                reason, tier = self.top_loss(victim, self.uses.get(victim, 0), False) if self.back else ("evicted", None)
                top.evicted_bytes += top.stored_bytes if reason in EVICTION_REASONS else 0
                ghosts.seq += 1
                listed.pop(victim, None)
                listed[victim] = Ghost(reason, self.name if tier is None else tier, top.evicted_bytes, ghosts.seq)
                if len(listed) > top.limit:
                    listed.popitem(last=False)
        victims = list(lost.values())
        for victim in victims if self.back else ():
            self._stage(victim, writes)
        self.cpu.delete_many(victims[::-1])  # (freed last first: reserve_many takes them in victim order, as one by one)
        for victim in victims:
            self._forget(victim)
        if victims:
            self.counters.evicted(self.name, len(victims))
        return first

    def _forget(self, key: ChunkKey) -> None:
        """What the index keeps of a chunk that left its page (the page and the policy's entry are gone)."""
        self.parent.pop(key, None)
        self.tenant.pop(key, None)
        self.uses.pop(key, None)
        self.ttl_pins.pop(key, None)
        if self.quota is not None:
            self.quota.remove(key)
        self._note(key)
