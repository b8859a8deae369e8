"""One tier below the store's top (cpu) tier, with what the store keeps for it.

A :class:`LowerTier` owns, for its tier: the eviction policy (local tiers only: a shared tier
evicts on its own), the pins of chunks being read or written, a bounded write queue with its
writer threads, and a reader pool.  The store hands it :class:`WriteJob` s; a writer thread makes
room (evicting the policy's victims that are not pinned), writes, and reports back through the
store's ``on_written`` callback, which releases what the job held in the top tier.

- ``write_back``: the tier receives chunks when they leave the top tier (disk in ``write-back``
  mode); otherwise every stored chunk is queued at once (``write-through``; always for a shared
  tier, whose point is that other hosts see the chunk now).
- ``quota``: with ``tenant_quotas``, a local tier's :class:`~kvtier.core.quota.TenantLedger` (who
  owns each stored chunk; room for a write is made by its victim choice for the job's tenant).
- The queue holds at most ``queue_depth`` jobs: a job that does not fit is dropped and counted in
  ``dropped_saves``; callers never wait.

Locking: methods ending in ``_locked`` need the store's lock (passed in as ``lock``); the writer
threads take it themselves, and do the tier I/O outside it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvtier.core.keys import ChunkKey
from kvtier.core.policies import EvictionPolicy, make_policy
from kvtier.core.policies.admission import AdmissionPolicy, AdmitAll
from kvtier.core.quota import TenantLedger
from kvtier.core.stats import StoreCounters
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.base import (
    ClearResult,
    ExactUsage,
    Generational,
    GetResult,
    PutResult,
    Rescannable,
    Tier,
)
from kvtier.core.tiers.registry import top_tier

log = logging.getLogger("kvtier.core.store")


@dataclass(slots=True)
class WriteJob:
    """One queued write of ``key`` into a lower tier.

    Attributes:
        key / parent: the chunk and the previous chunk of its chain (``None`` for chunk 0).
        data: a private staged copy of the bytes, or ``None`` to read the pinned top-tier page.
        evict_after: drop the chunk from the top tier once written (spill ahead).
        epoch: the tier's reset epoch when queued (set by :meth:`LowerTier.enqueue`); a write of an
            older epoch is dropped, or its chunk deleted if it landed after the reset.
        tenant: who the chunk was saved for (:mod:`kvtier.core.tenant`), ``None`` when unknown.
    """

    key: ChunkKey
    parent: ChunkKey | None
    data: np.ndarray | None
    evict_after: bool
    epoch: int = 0
    tenant: Writer | None = None

    @property
    def from_top(self) -> bool:
        """Whether the bytes come from a pinned top-tier page."""
        return self.data is None


class LowerTier:
    """A tier below the top and its policy, pins, write queue and threads (see module docstring).

    Args:
        tier: the tier.
        policy: eviction policy name (ignored for a shared tier).
        write_back: receive chunks on eviction from the top tier instead of at once.
        io_threads: writer threads and reader pool size.
        queue_depth: write jobs queued at most.
        lock: the store's lock.
        counters: the store's event counters.
        source: returns the top tier's bytes of a key (called with the lock held).
        on_written: ``on_written(job, tier_name, ok)``, called with the lock held after each job.
        on_change: ``on_change(key)`` when the tier gained or lost ``key``; ``on_resync()`` when
            it lost its contents (both with the lock held; the store's change feed).
    """

    def __init__(self, tier: Tier, policy: str, write_back: bool, io_threads: int, queue_depth: int,
                 lock: threading.RLock, counters: StoreCounters,
                 source: Callable[[ChunkKey], np.ndarray],
                 on_written: Callable[[WriteJob, str, bool], None],
                 on_change: Callable[[ChunkKey], None], on_resync: Callable[[], None]) -> None:
        self.tier = tier
        self.name = tier.name
        self._top_name = top_tier()
        self.shared = tier.shared
        self.write_back = write_back and not tier.shared
        self.policy: EvictionPolicy | None = None if tier.shared else make_policy(policy)
        self.admission: AdmissionPolicy = AdmitAll()  # the store sets the configured one
        self.quota: TenantLedger | None = None  # tenant quotas of a local tier (the store sets it when configured)
        self.pins: Counter[ChunkKey] = Counter()
        self._lock = lock
        self._counters = counters
        self._source = source
        self._on_written = on_written
        self._on_change = on_change
        self._on_resync = on_resync
        self._generation = tier.generation if isinstance(tier, Generational) else 0
        self.epoch = 0  # resets of this tier so far (clear_locked)
        self.queue: queue.Queue[WriteJob | None] = queue.Queue(maxsize=queue_depth)
        self.readers = ThreadPoolExecutor(io_threads, thread_name_prefix=f"kvtier-{self.name}-lookup") \
            if tier.shared else None
        if self.policy is not None:
            for key in tier.keys():  # noqa: SIM118 - a list, oldest first
                self.policy.insert(key, None)
            self._trim("at start-up")
        self._workers = [threading.Thread(target=self._write_loop, name=f"kvtier-{self.name}-write-{i}",
                                          daemon=True) for i in range(io_threads)]
        for t in self._workers:
            t.start()

    # ---- reads ---------------------------------------------------------------------------
    def contains_local(self, key: ChunkKey) -> bool:
        """Presence in a local tier (a shared tier is never asked synchronously)."""
        return not self.shared and self.tier.contains(key)

    def read(self, keys: Sequence[ChunkKey], dsts: Sequence[np.ndarray],
             records: TenantRecords | None = None) -> list[GetResult]:
        """Read ``keys`` into ``dsts`` (callers pin the keys of a local tier first); the tenant
        records of the verified values go into ``records``."""
        # one batch: a remote tier pipelines it under its deadline, the disk tier reads in parallel
        return self.tier.get_many(keys, [memoryview(d.data) for d in dsts], records)

    def rescan(self) -> int:
        """Take in chunks other processes wrote or removed (a :class:`~kvtier.core.tiers.base.Rescannable`
        tier, e.g. the disk tier).  The directory is read without the store's lock (``scan``); the index
        changes under it (``adopt``), in the same hold as the policy: adopted keys join the policy
        (then the tier is trimmed to its capacity), removed ones leave it, both go to the change
        feed.  Returns the keys adopted or forgotten."""
        tier = self.tier
        if not isinstance(tier, Rescannable) or self.shared or self.policy is None:
            return 0
        found = tier.scan()
        with self._lock:
            found = tier.adopt(found)
            for key in found.adopted:
                if key not in self.policy:
                    self.policy.insert(key, None)
                self._on_change(key)
            for key in found.gone:
                self.policy.remove(key)
                if self.quota is not None:
                    self.quota.remove(key)
                self._on_change(key)
            if found.adopted:
                self._trim("after adopting other engines' chunk files")
        return len(found.adopted) + len(found.gone)

    def submit(self, fn: Callable[[], object]) -> Future[object]:
        """Run ``fn`` on this (shared) tier's lookup threads."""
        assert self.readers is not None, "only a shared tier runs background lookups"
        return self.readers.submit(fn)

    def forget_locked(self, key: ChunkKey) -> None:
        """The tier dropped ``key`` (it failed verification): stop tracking it."""
        if self.policy is not None:
            self.policy.remove(key)
        if self.quota is not None:
            self.quota.remove(key)
        self._on_change(key)

    def owner_locked(self, key: ChunkKey) -> bytes | None:
        """The quota's tenant key of stored ``key`` (``None``: unknown, or no quotas)."""
        return self.quota.owner.get(key) if self.quota is not None else None

    def pin_locked(self, key: ChunkKey) -> None:
        self.pins[key] += 1

    def unpin_locked(self, key: ChunkKey) -> None:
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]

    # ---- writes --------------------------------------------------------------------------
    def enqueue(self, job: WriteJob) -> bool:
        """Queue ``job``; ``False`` (counted in ``dropped_saves``) if the queue is full."""
        job.epoch = self.epoch
        try:
            self.queue.put_nowait(job)
            return True
        except queue.Full:
            self._counters.dropped()
            return False

    def _trim(self, when: str) -> None:
        """Evict down to capacity when the tier holds more than it may (it was shrunk since, or
        other engines on its directory wrote more than this one may hold)."""
        assert self.policy is not None
        used = self._used_exact
        capacity = self.tier.usage().capacity_bytes
        before, evicted = used(), 0
        while used() > capacity:
            victim = self.policy.victim()
            if victim is None:
                break
            self._evict_locked(victim)
            evicted += 1
        if evicted:
            # Chunks found at start-up beyond this tier's size: e.g. a directory shared with an
            # engine whose disk_gib is larger (each engine bounds the files it knows of).
            log.warning("kvtier: the %s tier held %.1f MiB %s, more than its %.1f MiB: evicted %d chunks "
                        "(%.1f MiB) to fit; other engines sharing this directory lose them too. Give every "
                        "engine on one directory the same size, or each its own directory",
                        self.name, before / 2**20, when, capacity / 2**20, evicted, (before - used()) / 2**20)

    def _used_exact(self) -> int:
        """Bytes the tier holds, unclamped where it can say (:class:`~kvtier.core.tiers.base.ExactUsage`)."""
        tier = self.tier
        return tier.usage_exact() if isinstance(tier, ExactUsage) else tier.usage().used_bytes

    def _evict_locked(self, key: ChunkKey) -> None:
        assert self.policy is not None
        self.tier.delete(key)
        self.policy.remove(key)
        if self.quota is not None:
            self.quota.remove(key)
        self._on_change(key)
        self._counters.evicted(self.name)

    def _write_loop(self) -> None:
        while True:
            job = self.queue.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception:  # a worker must survive any single failure
                log.exception("kvtier: %s write of a chunk failed", self.name)
            finally:
                self.queue.task_done()

    def _make_room_locked(self, size: int, tenant: bytes | None = None) -> bool:
        """Evict until ``size`` more bytes fit; with quotas, victims chosen for ``tenant`` (the
        quota's tenant key of the chunk to write, ``None``: unknown).  False when nothing may go."""
        if self.policy is None:
            return True
        usage = self.tier.usage
        quota, policy, pins = self.quota, self.policy, self.pins

        def unpinned(key: ChunkKey) -> bool:
            return key not in pins

        while usage().used_bytes + size > usage().capacity_bytes:
            victim = quota.victim(policy, unpinned, tenant) if quota is not None else policy.victim(unpinned)
            if victim is None:
                return False
            self._evict_locked(victim)
        return True

    def _write(self, job: WriteJob) -> None:
        tier = self.tier
        with self._lock:
            if job.epoch != self.epoch:  # queued before a reset of this tier: what it would write is gone
                self._on_written(job, self.name, False)
                return
            data = self._source(job.key) if job.from_top else job.data
            room = self._make_room_locked(tier.stored_bytes(data.size if data is not None else 0),
                                          job.tenant.quota_key if job.tenant is not None else None)
            if room:
                self.pins[job.key] += 1
        result = PutResult.NO_ROOM
        t0 = time.perf_counter()
        if room and data is not None:
            result = tier.put(job.key, memoryview(data.data), job.tenant)  # its envelope keeps the tenant record
        seconds = time.perf_counter() - t0
        ok = result.stored
        with self._lock:
            if job.epoch != self.epoch:  # the tier was reset while this write ran: it must not resurrect the chunk
                if result is PutResult.STORED:
                    tier.delete(job.key)
                result, ok = PutResult.FAILED, False
                if room:
                    self.unpin_locked(job.key)
                self._on_change(job.key)
                self._on_written(job, self.name, False)
                return
            generation = tier.generation if isinstance(tier, Generational) else 0
            if generation != self._generation and self.policy is not None:
                # the tier lost its contents (a recreated directory): resync the policy
                self._generation = generation
                for key in list(self.policy.keys()):
                    if not tier.indexed(key):
                        self.policy.remove(key)
                        if self.quota is not None:
                            self.quota.remove(key)
                self._on_resync()
            if room:
                self.unpin_locked(job.key)
            if ok and self.policy is not None:
                self.policy.insert(job.key, job.parent)
                if self.quota is not None:
                    self.quota.add(job.key, job.tenant.quota_key if job.tenant is not None else None)
            if not ok:
                log.debug("kvtier: %s write of %s dropped (%s)", self.name, job.key.hex(), result.value)
                self._counters.dropped()
            self._on_change(job.key)
            self._on_written(job, self.name, ok)
        if result is PutResult.STORED and data is not None:
            self._counters.moved(f"{self._top_name}_to_{self.name}", data.size, seconds)

    def clear_locked(self) -> ClearResult:
        """A reset of this tier: bump :attr:`epoch` (queued and running writes are dropped, see
        :meth:`_write`), clear the tier (:meth:`~kvtier.core.tiers.base.Tier.clear`), forget its
        policy.  Pins stay with their owners (a read in flight; its promotion is dropped by the
        store's epoch).  The store's lock held; the store resyncs its change feed."""
        self.epoch += 1
        result = self.tier.clear()
        if self.policy is not None:
            for key in list(self.policy.keys()):
                self.policy.remove(key)
        if self.quota is not None:
            self.quota.clear()
        if isinstance(self.tier, Generational):
            self._generation = self.tier.generation  # cleared on purpose, not a vanished directory
        return result

    # ---- lifecycle -----------------------------------------------------------------------
    def flush(self, deadline: float | None) -> bool:
        """Wait until queued writes are done; ``False`` if ``deadline`` (monotonic) passed first."""
        if deadline is None:
            self.queue.join()
            return True
        while self.queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Stop the writer threads (after :meth:`flush`), the readers, and the tier."""
        for _ in self._workers:
            try:
                self.queue.put(None, timeout=1.0)
            except queue.Full:
                break
        for t in self._workers:
            t.join(timeout=5.0)
        if self.readers is not None:
            self.readers.shutdown(wait=True)
        self.tier.close()

    def check_locked(self) -> None:
        """Assert the tier's accounting, that it holds no more than its capacity, and that the
        policy tracks exactly the stored chunks (a chunk being written, pinned, is not tracked yet)."""
        self.tier.check()
        if self.policy is None:
            return
        used = self._used_exact()
        capacity = self.tier.usage().capacity_bytes
        assert used <= capacity, f"{self.name} tier holds {used} bytes, more than its {capacity}"
        stored, tracked = set(self.tier.keys()), set(self.policy.keys())
        stray = tracked - stored
        assert not stray, f"{self.name} policy tracks {len(stray)} chunks that are not in the tier"
        untracked = stored - tracked - set(self.pins)
        assert not untracked, f"{self.name} tier holds {len(untracked)} chunks its eviction policy does not track"
        if self.quota is not None:
            self.quota.check(stored)
