"""The store's moving part: a load's path from plan to release, and the threads, bounded queues and
tier I/O that run the index's plans.

The index (:mod:`kvtier.core.index`) decides; the :class:`Mover` moves bytes and reports what
happened by calling the index's verbs (the index never calls the mover).  It never holds the
index's lock during tier I/O: each verb it calls takes the lock for its own bookkeeping only.
The store's request-path verbs (a load's three, and the step's ``stats`` and ``take_ghost_distances``)
are the mover's, bound at construction: a worker calls them on every load and step.

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
from kvtier.core.context import (
    ChunkMissed,
    ChunksRead,
    ChunksServed,
    EngineLoad,
    LoadCut,
    LoadFailed,
    MissReason,
    OpContext,
    ServedBelow,
    Sink,
    WriteDropped,
)
from kvtier.core.handles import Into, LoadHandle, LoadPlan, Read, WriteJob
from kvtier.core.index import Index
from kvtier.core.keys import ChunkKey
from kvtier.core.landing import LandingPool
from kvtier.core.sinks import CountersSink
from kvtier.core.stats import StoreStats
from kvtier.core.tiers.base import GetResult, PutResult, Tier
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
        sink: the store's metrics sink; its counters count bytes and seconds written and dropped
            saves here (reads report to their load's context, :mod:`kvtier.core.context`).
        chunk_tokens: tokens per chunk (for :meth:`stats`).
        landing: where reads without a cpu page land (default: :meth:`LandingPool.sized`).
    """

    def __init__(self, index: Index, io_threads: int, queue_depth: int, sink: CountersSink, chunk_tokens: int,
                 landing: LandingPool | None = None) -> None:
        self.index = index
        self.io_threads = io_threads
        self.sink = sink
        self.counters = sink.counters
        self.chunk_bytes = index.chunk_bytes
        self.chunk_tokens = chunk_tokens
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

    # ---- a load: TieredStore's prepare_load, complete_load, cancel_load (bound: the worker calls them) ----
    def prepare_load(self, chain: Sequence[ChunkKey], max_chunks: int | None = None, read_ahead: bool = False,
                     top_only: bool = False, ctx: OpContext | None = None, into: Into | None = None,
                     shared_within_s: float | None = None) -> LoadHandle:
        """Pin and return the longest available prefix of ``chain``, at most ``max_chunks`` (the contract:
        :mod:`kvtier.core.store`).  With ``read_ahead``, only the first ``io_threads`` chunks found below the
        cpu tier are read before returning; the rest are read into cpu pages in the background, ``io_threads``
        at a time, while the caller copies the ready ones out (``handle.ready_chunks()`` grows as they
        arrive; ``handle.wait(timeout_s)`` for the end).

        With ``top_only``, the prefix ends at the first chunk the top (cpu) tier does not hold: no file,
        socket or network I/O, every buffer ready when this returns (the connector's synchronous loads, on the
        engine's own thread); with ``shared_within_s`` too, it goes on in the shared tier (no local lower tier),
        read and verified before this returns under that deadline (a synchronous node-tier hit).  Top-tier
        pages are handed out pinned, not re-hashed.  ``ctx``: the request's context (:mod:`kvtier.core.context`;
        ``None``: none), kept in the handle: the reads' events (``ChunksRead``, ``ChunkMissed``, ``LoadCut``)
        and :meth:`complete_load`'s go to it.  ``into``: where the shared tier reads a chunk instead of a cpu
        page (:data:`~kvtier.core.handles.Into`)."""
        limit = len(chain) if max_chunks is None else min(max_chunks, len(chain))
        plan = self.index.plan_load(chain, limit, top_only)
        plan.handle.ctx, plan.into = self.sink.bind(ctx), into
        start = len(plan.handle.keys)  # (num_chunks, without the property's call: the hit path)
        if start < limit and self.index.shared and (not top_only or shared_within_s is not None):
            want = list(chain[start:limit])
            if max_chunks is None:  # nobody asked yet: one presence batch, so misses cost no bytes
                want = want[:self.leading_present(self.index.shared[0].name, want)]
            self.index.plan_shared(plan, start, want)
        if (n := len(plan.handle.keys)) < limit:  # no tier this load may read holds the next chunk: why not
            with self.index.lock:
                ghost = self.index.ghosts.latest(chain[n], (self.top_name,) if top_only else None)
            plan.handle.ctx.sink.emit(LoadCut(n, ghost.tier if ghost is not None else self.top_name if top_only
                                              else "", ghost.reason if ghost is not None else "new", limit - n))
        if plan.writes:  # spills of the cpu pages the reads take
            self.submit(plan.writes)
        if plan.reads:
            self.run(chain, plan, read_ahead, shared_within_s)
        return plan.handle

    def complete_load(self, handle: LoadHandle, success: bool, first_chunk: int = 0,
                      engine: EngineLoad | None = None) -> None:
        """Unpin ``handle``'s chunks (from :meth:`prepare_load`); count hits only if ``success`` (the chunks
        reached their destination).  Idempotent.  ``first_chunk``: chunks before it were pinned, not delivered
        (the engine's prefix cache held them): no hits.  ``engine``: what the load did in the engine (tokens by
        planned tier, blocks not filled, bytes and seconds), counted here, once."""
        # (handle.ready_chunks(), read here: every chunk unless reads ahead still run)
        delivered = len(handle.keys) if (ahead := handle.pending) is None or ahead.done() else handle.ahead_from
        if not self.index.release(handle, refresh=success):
            return
        if handle.landed:  # (only then: the hit path with a page stays off the landing pool, scripts/hit_story.py)
            self.give_landed(handle)
        sink = handle.ctx.sink
        if engine is not None:
            sink.emit(engine)
        served = handle.tiers[first_chunk:delivered]  # chunks per tier, counted in C (no Counter frames: the hit path)
        sink.emit(ChunksServed(dict(zip(tiers := dict.fromkeys(served), map(served.count, tiers))))
                  if success else LoadFailed())
        if success and (below := handle.below) is not None and first_chunk <= below[0] < delivered:
            sink.emit(ServedBelow(*below))  # why the top tier did not hold it

    def cancel_load(self, handle: LoadHandle, engine: EngineLoad | None = None) -> None:
        """Unpin a load that will not happen (request aborted, or nothing left to load).

        Neither a hit nor a failed load is counted; ``engine`` (what the engine was promised and did not get) is.
        Idempotent."""
        if not self.index.release(handle, refresh=False):
            return
        if handle.landed:  # (only then: the hit path with a page stays off the landing pool, scripts/hit_story.py)
            self.give_landed(handle)
        if engine is not None:
            handle.ctx.sink.emit(engine)

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

    # ---- each step: TieredStore's stats and take_ghost_distances (bound: the worker calls them) ----
    def stats(self) -> StoreStats:
        """The store's counters and each tier's usage, as one snapshot (:meth:`kvtier.core.sinks.StoreCounters.snapshot`)."""
        return self.counters.snapshot(self.chunk_bytes, self.chunk_tokens, self.index.tier_stats(),
                                      self.index.dirty_bytes(), self.busy())

    def take_ghost_distances(self) -> list[tuple[str, int]]:
        """Ghost hits' ``(tier, distance bytes)`` since the last call (:mod:`kvtier.core.ghosts`; at
        most :data:`~kvtier.core.ghosts.PENDING_DISTANCES` of them), for the engine's metrics."""
        if not self.index.ghosts.distances:  # (a worker asks every step; most steps have none: no lock, no call)
            return []
        with self.index.lock:
            return self.index.ghosts.take_distances()

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
