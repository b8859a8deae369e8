"""The mover's state and what a hit does not run (:class:`MoverState`, the base of
:class:`~kvtier.core.mover.Mover`): its set-up, the writes, the shared tier's presence batch, the landing
buffers' return, and shutdown.  A load's path (plan, reads, report) and the step's snapshot are
:mod:`kvtier.core.mover`'s, which says how a load runs.

- **Writes**: one bounded queue (``save_queue_depth`` jobs) and ``io_threads`` writer threads
  per lower tier.  :meth:`MoverState.submit` queues the index's :class:`~kvtier.core.handles.WriteJob` s
  without waiting: a job that does not fit is dropped, counted in ``dropped_saves``, and handed
  back to the index (:meth:`~kvtier.core.upkeep.IndexUpkeep.written`).  A writer asks the index for
  room and the bytes (:meth:`~kvtier.core.upkeep.IndexUpkeep.begin_write`), writes, and reports
  (:meth:`~kvtier.core.upkeep.IndexUpkeep.end_write`).
- **Landing buffers**: a read the index planned into a private buffer (no cpu page could be freed,
  so the chunk is not promoted) lands in one of the :class:`~kvtier.core.landing.LandingPool`'s
  reused, page-aligned buffers instead (pinned on a GPU host), swapped in before the first read;
  they go back once the load is released and its reads have ended (:meth:`MoverState.give_landed`).
- **Presence** in a shared tier: :meth:`MoverState.leading_present`, one pipelined batch.
- **Why a read was not served**: :func:`miss_reason`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvtier.core.context import Counts, EngineLoad, MissReason, Sink, WriteDropped
from kvtier.core.handles import LoadHandle, LoadPlan, Read, WriteJob
from kvtier.core.index import Index
from kvtier.core.keys import ChunkKey
from kvtier.core.landing import LandingPool
from kvtier.core.tiers.base import GetResult, PutResult, Tier
from kvtier.core.tiers.wrappers import MissWhy

log = logging.getLogger("kvtier.core.store")


class MoverState:
    """The mover's threads, queues and buffers (see the module docstring).

    Args:
        index: the store's index.
        io_threads: writer threads per lower tier; reads before ``prepare_load`` returns with
            read-ahead, and per background batch.
        queue_depth: write jobs queued per lower tier at most.
        counters: the store's counters: bytes and seconds written, dropped saves (reads report to
            their load's context, :mod:`kvtier.core.context`).
        landing: where reads without a cpu page land (default: :meth:`LandingPool.sized`).
    """

    def __init__(self, index: Index, io_threads: int, queue_depth: int, counters: Counts,
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

    # ---- a load's rare steps: a cancel, a shared tier's presence, the landing buffers -------
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
    def leading_present(self, tier: str, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` the (shared) tier holds: one pipelined batch; blocks up to
        the tier's deadline; a fault is 0."""
        present = self.tiers[tier].contains_many(keys)
        return next((i for i, hit in enumerate(present) if not hit), len(present))

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


def miss_reason(read: Read, result: GetResult, stale: bool, why: MissWhy, gone: set[ChunkKey]) -> MissReason:
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
