"""The store's index: where every chunk is, who holds it, and what must move (no threads, no I/O waits).

One :class:`Index` per :class:`~kvtier.core.store.TieredStore` holds all placement state under one lock: the
top (cpu) tier's pages and their policy, pins, TTL pins, staged copies, parents, tenant records, uses and
tenant ledger; each lower tier's :class:`~kvtier.core.lowerindex.LowerIndex`; the reset epoch (one counter for
the whole store); chunks a reset doomed; the change feed (:mod:`kvtier.core.changes`). Its verbs return typed
plans (:mod:`kvtier.core.handles`):

- :meth:`plan_load` / :meth:`plan_shared`: a :class:`~kvtier.core.handles.LoadPlan` (each chunk's source
  tier and buffer, pinned; the :class:`~kvtier.core.handles.Read` s to run); :meth:`complete_reads` applies
  what the reads found (publish, cut the prefix);
- :meth:`plan_store` / :meth:`complete_store`: reserved pages, then publication;
- every verb that frees a cpu page or publishes a chunk also returns the
  :class:`~kvtier.core.handles.WriteJob` s it decided (a victim's spill to a write-back tier, a write-through,
  a spill ahead); :meth:`begin_write` / :meth:`end_write` / :meth:`written` apply what the write did.

The :class:`~kvtier.core.mover.Mover` runs the plans (threads, queues, tier reads and writes) and reports back
by calling these verbs; the index never calls the mover. Every planned :class:`WriteJob` ends in exactly one
:meth:`written` (the mover calls it when a job cannot be queued; :meth:`end_write` when it ran). What the
index still does to tiers: the cpu tier's page map (reserve, commit, abort, delete: memory only), a lower
tier's ``delete`` of an eviction victim and ``clear`` on a reset (under the lock: usage and policy agree).

Eviction from the top tier is decided in one place, ``may_free_page`` (:mod:`kvtier.core.changes`, with the
eviction gate, :mod:`kvtier.core.gate`), and done by ``evict_top`` one chunk at a time (:mod:`kvtier.core.upkeep`)
or :meth:`Index._evict_many` for a load's promotions.  This module is a load's whole path through the index;
the per-step feed, gate and numbers are :mod:`kvtier.core.changes`'; saves, writes, resets :mod:`kvtier.core.upkeep`'.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import numpy as np

from kvtier.core.codecstats import codec_stats
from kvtier.core.config import KVTierConfig
from kvtier.core.gate import EvictionGate
from kvtier.core.ghosts import GhostList, Ghosts
from kvtier.core.handles import NO_BUFFER, LoadHandle, LoadPlan, Read, StagedCopy, WriteJob
from kvtier.core.keys import ChunkKey
from kvtier.core.lowerindex import LowerIndex
from kvtier.core.policies import make_policy
from kvtier.core.policies.admission import make_admission
from kvtier.core.quota import TenantLedger
from kvtier.core.sinks import StoreCounters
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.base import GetResult, NoRoom, Paged, Reservation, ReserveResult, StagingTier
from kvtier.core.upkeep import IndexUpkeep


class Index(IndexUpkeep):
    """All placement state of one store (see the module docstring): over the top (staging) tier ``cpu`` and the
    tiers ``lower`` below it, in order, per ``config`` (policies, admission, quotas, ``spill_watermark``,
    ``pin_max_share``), counting in ``counters``, for chunks of ``chunk_bytes``."""

    def __init__(self, cpu: StagingTier, lower: Sequence[LowerIndex], config: KVTierConfig,
                 counters: StoreCounters, chunk_bytes: int, observe: Callable[[str, float], None] | None = None) -> None:
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
        self._init_feed()

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

    # ---- load ----------------------------------------------------------------------------
    def plan_load(self, chain: Sequence[ChunkKey], limit: int, top_only: bool) -> LoadPlan:
        """Pin the longest prefix of ``chain[:limit]`` held in the top or a local lower tier
        (``top_only``: the top tier alone); chunks below the top tier get a :class:`Read` into a
        reserved cpu page (or a private buffer when no page may be freed)."""
        plan = LoadPlan(handle := LoadHandle([], [], []))
        below: list[list[bool]] = []  # each local tier's contains_many(chain[start:limit]), asked once
        start = i = 0
        with self.lock:  # (resident(), inlined: the hit path asks it per chunk)
            contains, view, doomed, pins, name = self.cpu.contains, self.cpu.view, self.doomed, self.pins, self.name
            while i < limit:
                key = chain[i]
                if contains(key) and key not in doomed:
                    pins[key] = pins.get(key, 0) + 1
                    handle.pinned.append(key)
                    buf, source = view(key), name
                elif key in self.staged:  # a private copy, immutable: no pin needed
                    buf, source = self.staged[key].data, name
                elif top_only:
                    break
                else:  # the run of chunks held below from here on, promoted in one batch (_read_run)
                    if not below:
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
                    continue  # (the chunk that ended the run is looked at again: the run's evictions may have taken it)
                handle.keys.append(key)
                handle.buffers.append(buf)
                handle.tiers.append(source)
                i += 1
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
        into, name = plan.into, self.name
        targets = [into(pos) if lt.shared and into is not None else None for pos, _, lt in run]
        got: list[ReserveResult | None] = [None] * len(run)  # None: no page wanted (a shared read's destination)
        if self.quota is not None:
            ghosts = []  # a ghost hit is measured before the chunk's own eviction (kvtier.core.ghosts)
            for k, ((_, key, lt), target) in enumerate(zip(run, targets)):
                ghosts.append(self.ghosts.take(name, key) if key in self.top_ghosts else None)
                if target is None:
                    got[k] = self.cpu.reserve(key) if self.free_page(_owner(lt, key), plan.writes) else NoRoom.NO_ROOM
            ghost = ghosts[0] if ghosts else None
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
            victims = self.policy.evict(len(need), partial(self.may_free_page, ahead=False)) \
                if need and not self.gate.closed else []
            ghost = self.ghosts.promote(name, [key for _, key, _ in run], dict(zip(need, (
                (v, self.uses.get(v, 0)) for v in victims))), self.back)
            self._evict_many(victims, plan.writes)
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
                if res is GetResult.CORRUPT or (res is GetResult.MISS and not r.shared
                                                and not lt.tier.indexed(r.key)):
                    lt.forget(r.key)  # corrupt (counted by the tier) or removed by another process
                    self.ghosts.add(lt.name, r.key, "corrupt" if res is GetResult.CORRUPT else "purged")
                    self._note(r.key)
                if cut is not None and r.pos >= cut:
                    if r.reserved:
                        self.cpu.abort(r.key)
                    continue
                if r.reserved:
                    self.publish(r.key, chain[r.pos - 1] if r.pos > 0 else None, records.get(r.key),
                                 owner=_owner(lt, r.key), inserted=inserted)
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
            if handle.num_chunks <= ahead_from:
                return False
            handle.ahead_from = ahead_from
            handle.reading_ahead = True
            return True

    def advance(self, handle: LoadHandle, ready: int) -> None:
        """Chunks before ``ready`` of ``handle`` are in place (read ahead)."""
        with self.lock:
            handle.ahead_from = min(ready, handle.num_chunks)

    def end_read_ahead(self, handle: LoadHandle) -> None:
        """The background reads of ``handle`` ended; unpin it now if it was released meanwhile."""
        with self.lock:
            handle.reading_ahead = False
            refresh = handle.release_after_read
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
                return True
        self.unpin_load(handle, refresh)
        return True

    def unpin_load(self, handle: LoadHandle, refresh: bool) -> None:
        with self.lock:
            self.unpin(handle.pinned)
            handle.pinned = []
            if refresh and handle.keys:
                contains, doomed = self.cpu.contains, self.doomed
                used = [k for k in handle.keys if contains(k) and k not in doomed]
                self.policy.touch(used)
                dict.update(self.uses, {k: self.uses.get(k, 0) + 1 for k in used})  # +1 each (no Counter.update frames)
                for lt in self.local:
                    below = [k for k, t in zip(handle.keys, handle.tiers) if t == lt.name]
                    if below and lt.policy is not None:
                        lt.policy.touch(below)

    def unpin(self, keys: Iterable[ChunkKey]) -> None:
        """Unpin each of ``keys`` once (a load's chunks in one call: the hit path)."""
        pins, doomed = self.pins, self.doomed
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

    def _stage(self, victim: ChunkKey, writes: list[WriteJob]) -> None:
        """Before ``victim`` leaves its page: write-back tiers that lack it and admit it get a write in ``writes``,
        from a staged copy (so the page is free now; the writes happen on the mover)."""
        missing = self._admitting(victim)
        if missing:
            copy = self.staged.get(victim) or self.staged.setdefault(victim, StagedCopy(self.cpu.view(victim).copy()))
            for lt in missing:
                writes.append(self._job(lt, victim, copy.data, evict_after=False, tenant=self.tenant.get(victim)))
                copy.pending += 1

    def _evict_many(self, victims: Sequence[ChunkKey], writes: list[WriteJob]) -> None:
        """:meth:`free_page` and :meth:`evict_top` for victims the policy let go already (``EvictionPolicy.evict``),
        their ghosts added (``Ghosts.promote``): one call each into the cpu tier and the counters."""
        for victim in victims if self.back else ():
            self._stage(victim, writes)
        self.cpu.delete_many(victims[::-1])  # (freed last first: reserve_many takes them in victim order, as one by one)
        for victim in victims:
            self._forget(victim)
        if victims:
            self.counters.evicted(self.name, len(victims))

    def _admitting(self, victim: ChunkKey) -> list[LowerIndex]:
        """Write-back tiers that lack ``victim`` and whose admission takes it."""
        uses = self.uses.get(victim, 0)
        return [lt for lt in self.back if not lt.tier.indexed(victim) and lt.admission.judge(victim, uses)]

    def _drop(self, key: ChunkKey) -> None:
        self.cpu.delete(key)
        self.policy.remove(key)
        self._forget(key)

    def _forget(self, key: ChunkKey) -> None:
        """What the index keeps of a chunk that left its page (the page and the policy's entry are gone)."""
        self.parent.pop(key, None)
        self.tenant.pop(key, None)
        self.uses.pop(key, None)
        self.ttl_pins.pop(key, None)
        if self.quota is not None:
            self.quota.remove(key)
        self._note(key)


def _owner(lt: LowerIndex, key: ChunkKey) -> bytes | None:
    """The quota's tenant key of ``key`` in ``lt`` (:meth:`LowerIndex.owner`, here on the hit path)."""
    return lt.quota.owner.get(key) if lt.quota is not None else None
