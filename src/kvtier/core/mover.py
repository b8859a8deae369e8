"""The store's mover: runs the index's plans, with threads, bounded queues and tier I/O.

The index (:mod:`kvtier.core.index`) decides; the :class:`Mover` moves bytes and reports what
happened by calling the index's verbs (the index never calls the mover).  It never holds the
index's lock during tier I/O: each verb it calls takes the lock for its own bookkeeping only.

- **Writes**: one bounded queue (``save_queue_depth`` jobs) and ``io_threads`` writer threads
  per lower tier.  :meth:`Mover.submit` queues the index's :class:`~kvtier.core.handles.WriteJob` s
  without waiting: a job that does not fit is dropped, counted in ``dropped_saves``, and handed
  back to the index (:meth:`~kvtier.core.upkeep.IndexUpkeep.written`).  A writer asks the index for
  room and the bytes (:meth:`~kvtier.core.upkeep.IndexUpkeep.begin_write`), writes, and reports
  (:meth:`~kvtier.core.upkeep.IndexUpkeep.end_write`).
- **Reads** (promotions): a load's :class:`~kvtier.core.handles.Read` s, one batch per tier in
  tier order, then :meth:`~kvtier.core.index.Index.complete_reads`.  With read-ahead the first
  ``io_threads`` are read before ``prepare_load`` returns and the rest on a background pool,
  ``io_threads`` at a time (a shared tier's chunks in one pipelined batch), advancing
  ``LoadHandle.ahead_from`` so the caller copies the ready head while the tail is read (each
  batch's events go to the load's context, ``LoadHandle.ctx``, on whichever thread read it)::

      chain     c0   c1   c2   c3   c4   c5
      found in  cpu  disk disk disk redis redis
      reads          1    2    3    4     5      (pos = position in the chain = in the handle)

  A chunk that is missing or fails verification cuts the prefix there (a chunk is only useful if
  every chunk before it was delivered).  A chunk read from a lower tier keeps its writer's tenant
  record: the tier puts the record of each value it verified into ``records``
  (:data:`kvtier.core.tenant.TenantRecords`), and the published page carries it (issue 22).
- **Landing buffers**: a read the index planned into a private buffer (no cpu page could be freed,
  so the chunk is not promoted) lands in one of the :class:`~kvtier.core.landing.LandingPool`'s
  reused, page-aligned buffers instead (pinned on a GPU host), swapped in before the first read;
  they go back once the load is released and its reads have ended (:meth:`Mover.give_landed`).
- **Presence** in a shared tier: :meth:`Mover.leading_present`, one pipelined batch.
- **Rescans** of local tiers other processes write into (``disk_rescan_s``): :meth:`Mover.rescan`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.core import tenant
from kvtier.core.context import ChunkMissed, ChunksRead, LoadCut, MissReason, Sink, WriteDropped
from kvtier.core.handles import LoadHandle, LoadPlan, Read, WriteJob
from kvtier.core.index import Index
from kvtier.core.keys import ChunkKey
from kvtier.core.landing import LandingPool
from kvtier.core.sinks import StoreCounters
from kvtier.core.tiers.base import GetResult, PutResult, Rescannable, Tier
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.wrappers import MissWhy, TierWrapper

log = logging.getLogger("kvtier.core.store")


class Mover:
    """Runs the index's plans (see the module docstring).

    Args:
        index: the store's index.
        io_threads: writer threads per lower tier; reads before ``prepare_load`` returns with
            read-ahead, and per background batch.
        queue_depth: write jobs queued per lower tier at most.
        counters: the store's event counters (bytes and seconds written, dropped saves; reads
            report to their load's context, :mod:`kvtier.core.context`).
        landing: where reads without a cpu page land (default: :meth:`LandingPool.sized`).
    """

    def __init__(self, index: Index, io_threads: int, queue_depth: int, counters: StoreCounters,
                 landing: LandingPool | None = None) -> None:
        self.index = index
        self.io_threads = io_threads
        self.counters = counters
        self.chunk_bytes = index.chunk_bytes
        self.top_name = index.name
        self.tiers: dict[str, Tier] = {lt.name: lt.tier for lt in index.lower}
        self.queues: dict[str, queue.Queue[WriteJob | None]] = {
            name: queue.Queue(maxsize=queue_depth) for name in self.tiers}
        self._writers = [threading.Thread(target=self._write_loop, args=(name,), daemon=True,
                                          name=f"kvtier-{name}-write-{i}")
                         for name in self.tiers for i in range(io_threads)]
        for t in self._writers:
            t.start()
        self._ahead = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-read-ahead")
        self.landing = landing if landing is not None else LandingPool.sized(self.chunk_bytes)
        self._rescan_stop = threading.Event()
        self._rescanner: threading.Thread | None = None

    # ---- writes --------------------------------------------------------------------------
    def submit(self, jobs: Iterable[WriteJob], sink: Sink | None = None) -> None:
        """Queue ``jobs``; one that does not fit is dropped (counted) and handed back to the index.
        ``sink``: a save's context's, told of its write-through copies so refused, per tier
        (:class:`~kvtier.core.context.WriteDropped`; the counters count them here, once)."""
        refused = Counter[str]()
        for job in jobs:
            try:
                self.queues[job.tier].put_nowait(job)
            except queue.Full:
                self.counters.dropped()
                self.index.written(job, False)
                refused[job.tier] += 1
        for name in (lt.name for lt in self.index.through if refused[lt.name]):
            if sink is not None:
                sink.emit(WriteDropped(name, refused[name], "queue_full"))

    def free_slots(self) -> dict[str, int]:
        """Jobs each tier's queue takes now before it is full."""
        return {name: q.maxsize - q.qsize() for name, q in self.queues.items()}

    def full(self) -> set[str]:
        """Tiers whose queue is full."""
        return {name for name, q in self.queues.items() if q.full()}

    def busy(self, names: Iterable[str] | None = None) -> int:
        """Write jobs queued or running (for the tiers ``names``; ``None``: all)."""
        return sum(self.queues[n].unfinished_tasks for n in (self.queues if names is None else names))

    def write_dirty(self, keys: Iterable[ChunkKey], deadline: float) -> None:
        """Write each of ``keys`` (dirty chunks) to the local tiers that lack it, waiting for room
        in their queues (unlike a save), then for the writes, until ``deadline`` (monotonic)."""
        for key in keys:
            while time.monotonic() < deadline:
                done, writes = self.index.plan_flush(key, self.full())
                self.submit(writes)
                if done:
                    break
                time.sleep(0.002)
        local = [lt.name for lt in self.index.local]
        while self.busy(local) and time.monotonic() < deadline:
            time.sleep(0.005)

    def _write_loop(self, name: str) -> None:
        q = self.queues[name]
        while True:
            job = q.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception:  # a worker must survive any single failure
                log.exception("kvtier: %s write of a chunk failed", name)
            finally:
                q.task_done()

    def _write(self, job: WriteJob) -> None:
        begun = self.index.begin_write(job)
        if begun is None:
            return
        data, room = begun
        result = PutResult.NO_ROOM
        t0 = time.perf_counter()
        if room:
            result = self.tiers[job.tier].put(job.key, memoryview(data.data), job.tenant)  # the envelope keeps the tenant record
        seconds = time.perf_counter() - t0
        if not result.stored:
            log.debug("kvtier: %s write of %s dropped (%s)", job.tier, job.key.hex(), result.value)
        if self.index.end_write(job, result, room) and result is PutResult.STORED:
            self.counters.moved(f"{self.top_name}_to_{job.tier}", data.size, seconds)

    # ---- reads ---------------------------------------------------------------------------
    def leading_present(self, tier: str, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` the (shared) tier holds: one pipelined batch; blocks up to
        the tier's deadline; a fault is 0."""
        present = self.tiers[tier].contains_many(keys)
        return next((i for i, hit in enumerate(present) if not hit), len(present))

    def run(self, chain: Sequence[ChunkKey], plan: LoadPlan, read_ahead: bool, within_s: float | None = None) -> None:
        """Run ``plan.reads`` now, or with ``read_ahead`` only the first ``io_threads`` of them and
        the rest in the background; all now if every one reads into the caller's destination
        (``Read.into``: the read is the copy, nothing to overlap it with; one batch, no thread hop).
        ``within_s``: the shared tier's reads under this deadline (:meth:`read`)."""
        self._land(plan)
        reads = plan.reads
        ahead = reads[self.io_threads:] if read_ahead and any(r.into is None for r in reads) else []
        self.read(chain, plan.handle, reads[:len(reads) - len(ahead)], within_s)
        if not ahead:
            return
        if not self.index.start_read_ahead(plan.handle, ahead[0].pos):
            self.index.give_back(ahead)  # the prefix already ended before them
            return
        try:
            plan.handle.pending = self._ahead.submit(self._read_ahead, chain, plan.handle, ahead)
        except RuntimeError:  # closed: read here
            self._read_ahead(chain, plan.handle, ahead)

    def _land(self, plan: LoadPlan) -> None:
        """``plan.reads`` with each private buffer (a read that got no cpu page) replaced by a landing
        buffer while the pool has one, in the reads and in the handle (before any read runs)."""
        reads = plan.reads
        for i, r in enumerate(reads):
            if r.reserved or r.into is not None:
                continue
            buffer = self.landing.take()
            if buffer is None:
                break  # every landing buffer is out: the rest keep their private buffers
            reads[i] = r._replace(buffer=buffer)
            plan.handle.buffers[r.pos] = buffer
            plan.handle.landed.append(buffer)

    def give_landed(self, handle: LoadHandle) -> None:
        """Put ``handle``'s landing buffers back once its reads have ended (the caller released it)."""
        landed, handle.landed = handle.landed, []
        self.landing.give_after(landed, handle.pending)

    def read(self, chain: Sequence[ChunkKey], handle: LoadHandle, batch: Sequence[Read],
             within_s: float | None = None) -> None:
        """Read ``batch`` (one read per tier, in tier order) and report to the index; a guarded tier's
        reads under ``within_s`` when given (a synchronous load, on the engine's thread).  The load's
        context (``handle.ctx``) hears a :class:`~kvtier.core.context.ChunksRead` per tier read, a
        ``ChunkMissed`` per chunk that did not arrive and a ``LoadCut`` where the prefix now ends
        (the tiers' per-chunk results and a wrapper's reasons, translated by :func:`_reason`)."""
        sink = handle.ctx.sink
        results: list[GetResult] = []
        records: tenant.TenantRecords = {}  # verified values and chunk files name their writer
        why: MissWhy = {}  # a wrapper's reason for each miss it caused (deadline, breaker open, ...)
        for name in dict.fromkeys(r.tier for r in batch):
            jobs = [r for r in batch if r.tier == name]
            t0 = time.perf_counter()
            tier, keys = self.tiers[name], [r.key for r in jobs]
            dsts: list[Any] = [memoryview(r.buffer.data) if r.into is None else r.into for r in jobs]
            # (wrappers.get_explained, inlined: a bare tier is not asked for reasons)
            if within_s is not None and isinstance(tier, GuardedTier):
                got = tier.get_many(keys, dsts, records, why=why, within_s=within_s)
            else:
                got = tier.get_many(keys, dsts, records, why=why) if isinstance(tier, TierWrapper) else \
                    tier.get_many(keys, dsts, records)
            seconds = time.perf_counter() - t0
            results.extend(got)
            hits = sum(1 for r in got if r is GetResult.HIT)
            sink.emit(ChunksRead(name, hits, hits * self.chunk_bytes, seconds))
        planned = len(handle.keys)  # num_chunks: only complete_reads changes it, and one batch of a load runs at a time
        gone = {r.key for r, res in zip(batch, results)  # local files removed from outside (purge, another engine)
                if res is GetResult.MISS and not r.shared and r.key not in why and not self.tiers[r.tier].indexed(r.key)}
        epoch = self.index.complete_reads(chain, handle, batch, results, records)
        missed = [ChunkMissed(r.pos, r.tier, _reason(r, res, r.epoch != epoch, why, gone))
                  for r, res in zip(batch, results) if res is not GetResult.HIT or r.epoch != epoch]
        for m in missed:
            sink.emit(m)
        first = min(missed, key=lambda m: m.index, default=None)
        if first is not None and first.index < planned:  # not cut before (by an earlier batch of this load)
            sink.emit(LoadCut(first.index, first.tier, first.reason, planned - first.index))

    def _read_ahead(self, chain: Sequence[ChunkKey], handle: LoadHandle, ahead: list[Read]) -> None:
        """Read ``ahead`` in batches of ``io_threads`` chunks, advancing ``handle.ahead_from`` after
        each; a shared tier's chunks stay in one batch (one pipelined round trip)."""
        try:
            i = 0
            while i < len(ahead):
                if ahead[i].shared:
                    end = next((j for j in range(i, len(ahead)) if not ahead[j].shared), len(ahead))
                else:
                    end = min(i + self.io_threads, len(ahead))
                batch, i = ahead[i:end], end
                if len(handle.keys) > batch[0].pos:  # the prefix (num_chunks) still reaches this batch
                    self.read(chain, handle, batch)
                else:  # the prefix ended in an earlier batch (a chunk failed): give this one's pins and pages back
                    self.index.give_back(batch)
                # chunks before the batch's end are in place (only complete_reads, on this thread, cuts handle.keys)
                handle.ahead_from = min(batch[-1].pos + 1, len(handle.keys))
        finally:
            self.index.end_read_ahead(handle)

    # ---- other processes' chunk files ----------------------------------------------------
    def rescan(self) -> int:
        """Read each rescannable local tier's directory (without the index's lock) and hand what
        changed to the index (:meth:`~kvtier.core.upkeep.IndexUpkeep.adopt`); the keys adopted or forgotten."""
        n = 0
        for lt in self.index.local:
            if isinstance(lt.tier, Rescannable) and lt.policy is not None:
                n += self.index.adopt(lt.name, lt.tier.scan())
        return n

    def start_rescans(self, interval_s: float) -> None:
        """:meth:`rescan` every ``interval_s`` seconds on a background thread until :meth:`stop_rescans`."""
        self._rescanner = threading.Thread(target=self._rescan_loop, args=(interval_s,),
                                           name="kvtier-disk-rescan", daemon=True)
        self._rescanner.start()

    def stop_rescans(self, timeout_s: float) -> None:
        self._rescan_stop.set()
        if self._rescanner is not None:
            self._rescanner.join(timeout=timeout_s)

    def _rescan_loop(self, interval_s: float) -> None:
        while not self._rescan_stop.wait(interval_s):
            try:
                self.rescan()
            except Exception:  # the thread must outlive one bad round (e.g. the directory vanished)
                log.exception("kvtier: rescanning the disk tier failed")

    # ---- lifecycle -----------------------------------------------------------------------
    def flush(self, deadline: float | None) -> bool:
        """Wait until queued writes of every tier are done; False if ``deadline`` (monotonic) passed first."""
        done = [self._flush(q, deadline) for q in self.queues.values()]  # every tier, not just up to a late one
        return all(done)

    @staticmethod
    def _flush(q: queue.Queue[WriteJob | None], deadline: float | None) -> bool:
        if deadline is None:
            q.join()
            return True
        while q.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Wait for background reads, then stop the writer threads (after :meth:`flush`)."""
        self._ahead.shutdown(wait=True)
        for name, q in self.queues.items():
            for _ in range(self.io_threads):
                try:
                    q.put(None, timeout=1.0)
                except queue.Full:
                    log.warning("kvtier: the %s write queue stayed full at close", name)
                    break
        for t in self._writers:
            t.join(timeout=5.0)


def _reason(read: Read, result: GetResult, stale: bool, why: MissWhy, gone: set[ChunkKey]) -> MissReason:
    """Why ``read``, which returned ``result``, is not served (``stale``: a reset came since its
    plan; ``why``: a wrapper's reasons; ``gone``: local keys whose file vanished before the read)."""
    if stale:
        return "reset"
    if result is GetResult.CORRUPT:
        return "corrupt"
    reason = why.get(read.key)
    if reason in ("deadline", "breaker_open", "load_failed"):
        return reason  # type: ignore[return-value]
    if read.shared:
        return "evicted"  # present at the lookup, gone at the read: the shared tier let it go (or its TTL)
    return "purged" if read.key in gone else "load_failed"
