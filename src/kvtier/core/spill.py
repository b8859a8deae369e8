"""Eviction from the cpu tier and the disk writer of :class:`~kvtier.core.store.TieredStore`.

Kept apart from the store's public operations so each file holds one concern.  Everything here
runs on the store's state: methods ending in ``_locked`` must be called with the store's lock
held; ``_write_loop`` runs on the store's writer threads and takes the lock itself.

- a victim already on disk (or with no disk tier) is dropped from cpu at once;
- in write-back mode a victim not yet on disk is copied to a staging buffer and queued (it stays
  servable from ``_staged`` until written), so the page is free at once;
- ``_spill_ahead_locked`` queues likely victims early, keeping ``spill_watermark`` of pages free;
- the queue is bounded: a write that does not fit is dropped and counted (``dropped_saves``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvtier.core.keys import ChunkKey

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.metrics import StoreMetrics
    from kvtier.core.policies import EvictionPolicy
    from kvtier.core.tiers.cpu import CpuTier
    from kvtier.core.tiers.disk import DiskTier

log = logging.getLogger("kvtier.core.store")


class WriteJob:
    """One queued disk write: bytes from a staging copy or from a pinned cpu page."""

    __slots__ = ("data", "evict_after", "from_cpu", "key", "parent")

    def __init__(self, key: ChunkKey, parent: ChunkKey | None, data: np.ndarray | None, evict_after: bool) -> None:
        self.key, self.parent, self.data, self.evict_after = key, parent, data, evict_after
        self.from_cpu = data is None


class SpillMixin:
    """Eviction and disk-writer half of :class:`~kvtier.core.store.TieredStore` (see module docstring)."""

    config: KVTierConfig
    chunk_bytes: int
    cpu: CpuTier
    disk: DiskTier | None
    cpu_policy: EvictionPolicy
    disk_policy: EvictionPolicy
    metrics: StoreMetrics
    counters: Counter[str]
    _pins: Counter[ChunkKey]
    _disk_pins: Counter[ChunkKey]
    _spilling: set[ChunkKey]
    _staged: dict[ChunkKey, np.ndarray]
    _parent: dict[ChunkKey, ChunkKey | None]
    _queue: queue.Queue[WriteJob | None]
    _disk_generation: int
    _lock: threading.RLock
    # provided by TieredStore:
    _unpin_locked: Callable[[ChunkKey], None]
    _update_usage: Callable[[], None]
    _note_locked: Callable[[ChunkKey], None]
    _resync_locked: Callable[[], None]
    dirty_keys: Callable[[], list[ChunkKey]]

    def _trim_disk(self) -> None:
        """Evict down to capacity when the directory holds more than ``disk_gib`` allows (the tier
        was shrunk since the files were written)."""
        assert self.disk is not None
        while self.disk.usage_exact() > self.disk.capacity_bytes:
            victim = self.disk_policy.victim()
            if victim is None:
                break
            self.disk.delete(victim)
            self.disk_policy.remove(victim)
            self.counters["evictions_disk"] += 1
            self.metrics.evictions.labels("disk").inc()

    # ---- eviction and spill --------------------------------------------------------------
    def _evictable(self, key: ChunkKey) -> bool:
        return key not in self._pins and key not in self._spilling

    def _free_page_locked(self) -> bool:
        """Make sure one cpu page is free, evicting if needed; False if everything is pinned."""
        if self.cpu.can_reserve():
            return True
        victim = self.cpu_policy.victim(self._evictable)
        if victim is None:
            return False
        if self.disk is not None and not self.disk.indexed(victim):
            # write-back: stage a copy so the page is free now; the disk write happens on a worker
            staged = self.cpu.view(victim).copy()
            if self._enqueue_locked(WriteJob(victim, self._parent.get(victim), staged, evict_after=False)):
                self._staged[victim] = staged
        self._evict_cpu_locked(victim)
        return True

    def _evict_cpu_locked(self, key: ChunkKey) -> None:
        self.cpu.delete(key)
        self.cpu_policy.remove(key)
        self._parent.pop(key, None)
        self._note_locked(key)
        self.counters["evictions_cpu"] += 1
        self.metrics.evictions.labels("cpu").inc()

    def _spill_ahead_locked(self) -> None:
        """In write-back mode, queue spills of likely victims so free pages stay above the watermark."""
        if self.disk is None or self.config.write_mode != "write-back" or not self.cpu.num_pages:
            return
        want = int(self.config.spill_watermark * self.cpu.num_pages)
        free = self.cpu.usage().free_bytes // self.chunk_bytes
        while free + len(self._spilling) < want and not self._queue.full():
            victim = self.cpu_policy.victim(self._evictable)
            if victim is None:
                return
            if self.disk.indexed(victim):
                self._evict_cpu_locked(victim)
                free += 1
                continue
            if not self._enqueue_locked(WriteJob(victim, self._parent.get(victim), None, evict_after=True)):
                return

    def _enqueue_locked(self, job: WriteJob) -> bool:
        if job.from_cpu:
            self._pins[job.key] += 1
            self._spilling.add(job.key)
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            if job.from_cpu:
                self._unpin_locked(job.key)
                self._spilling.discard(job.key)
            self.counters["dropped_saves"] += 1
            self.metrics.dropped_saves.inc()
            return False

    def flush_dirty(self, timeout_s: float) -> tuple[int, int]:
        """Write every dirty cpu chunk to the disk tier, waiting at most ``timeout_s`` seconds.

        Used on a graceful stop so that a restart finds the hot set on disk.  Unlike the save
        path, this waits for room in the write queue (until the deadline) instead of dropping.

        Returns:
            ``(written, missed)``: chunks that reached the disk, and chunks still dirty at the
            deadline (counted in ``flush_missed_chunks``).  ``(0, 0)`` without a disk tier.
        """
        if self.disk is None:
            return 0, 0
        deadline = time.monotonic() + max(timeout_s, 0.0)
        before = len(self.dirty_keys())
        for key in self.dirty_keys():
            while time.monotonic() < deadline:
                with self._lock:
                    if not self.cpu.contains(key) or key in self._spilling or self.disk.indexed(key):
                        break  # evicted (then staged and queued) or already on its way
                    if not self._queue.full():
                        self._enqueue_locked(WriteJob(key, self._parent.get(key), None, evict_after=False))
                        break
                time.sleep(0.002)
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        missed = len(self.dirty_keys())
        if missed:
            self.counters["flush_missed_chunks"] += missed
        return max(before - missed, 0), missed

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception:  # a worker must survive any single failure
                log.exception("kvtier: disk write of a chunk failed")
            finally:
                self._queue.task_done()

    def _write(self, job: WriteJob) -> None:
        disk = self.disk
        assert disk is not None
        size = disk.file_bytes(self.chunk_bytes)
        with self._lock:
            data = self.cpu.view(job.key) if job.from_cpu else job.data
            room = True
            while disk.usage().used_bytes + size > disk.capacity_bytes:
                victim = self.disk_policy.victim(lambda k: k not in self._disk_pins)
                if victim is None:
                    room = False
                    break
                disk.delete(victim)
                self.disk_policy.remove(victim)
                self._note_locked(victim)
                self.counters["evictions_disk"] += 1
                self.metrics.evictions.labels("disk").inc()
            if room:
                self._disk_pins[job.key] += 1
        ok = False
        t0 = time.perf_counter()
        if room and data is not None:
            ok = disk.put(job.key, memoryview(data.data))
        seconds = time.perf_counter() - t0
        with self._lock:
            if disk.generation != self._disk_generation:  # the directory was recreated: resync the policy
                self._disk_generation = disk.generation
                for key in list(self.disk_policy.keys()):
                    if not disk.indexed(key):
                        self.disk_policy.remove(key)
                self._resync_locked()
            if room:
                self._disk_pins[job.key] -= 1
                if self._disk_pins[job.key] <= 0:
                    del self._disk_pins[job.key]
            if ok:
                self.disk_policy.insert(job.key, job.parent)
            else:
                log.debug("kvtier: disk write of %s dropped (room=%s)", job.key.hex(), room)
                self.counters["dropped_saves"] += 1
                self.metrics.dropped_saves.inc()
            self._staged.pop(job.key, None)
            self._note_locked(job.key)
            if job.from_cpu:
                self._spilling.discard(job.key)
                self._unpin_locked(job.key)
                if job.evict_after and ok and self.cpu.contains(job.key) and job.key not in self._pins:
                    self._evict_cpu_locked(job.key)
        if ok:
            self.metrics.moved("cpu_to_disk", self.chunk_bytes, seconds)
        self._update_usage()
