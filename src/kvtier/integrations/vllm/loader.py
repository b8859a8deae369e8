"""Asynchronous loads on a worker rank: store → (disk read, verify) → engine blocks, off the engine's thread.

One :class:`LoadJob` per request admitted with a kvtier hit.  ``submit`` returns at once; a
loader thread (``threads`` of them) then:

1. ``store.prepare_load(chain, read_ahead=True)``: pins the chunks still held and reads/verifies
   the first ``io_threads`` of those only on disk or in the shared tier before it returns; the
   rest are read into cpu pages in the background (promotion); the mirror that planned the load
   may be stale, so this can end with fewer chunks than planned, never other bytes;
2. copies each chunk into the job's engine blocks as soon as it is ready
   (``handle.ready_chunks()``), so the head is copied while the tail is still being read, and
   waits at most ``load_wait_s`` in all for the tail (a chunk that failed verification ends the
   prefix there; a tail that did not arrive in time is recomputed);
3. ``store.complete_load`` in ``finally`` (unpins; hits counted only for delivered chunks);
4. records the blocks it could not fill (short or failed load) as load errors, then the request
   as finished receiving, in that order, so both reach vLLM no later than the same step.

A reset (the store's :attr:`~kvtier.core.store.TieredStore.epoch` changed) fails every load that
started before it and is reported after it: its blocks are reported as load errors (a hybrid
model's request as failed), so vLLM recomputes them and nothing read before the reset reaches a
request after it; the check is made when the outcome is taken (:meth:`AsyncLoader.take`), which
the worker does after applying the order.

Bounds: jobs in flight are bounded by the engine's KV cache (each holds its request's blocks
until reported); a job waits for its read-ahead at most ``load_wait_s``; ``shutdown`` cancels
jobs not started and waits for running ones.  A job whose
request was aborted before it started is skipped and reported as finished (vLLM waits for that
report before it frees the blocks; vllm/v1/core/sched/scheduler.py ``finish_requests``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.core.handles import LoadHandle
from kvtier.core.keys import ChunkKey
from kvtier.core.store import TieredStore
from kvtier.core.tiers.registry import slowest
from kvtier.integrations.vllm.copy import BlockCopier, Span
from kvtier.integrations.vllm.group_io import GroupCopiers, load_pages
from kvtier.integrations.vllm.protocol import LoadJob

log = logging.getLogger(__name__)

READ_AHEAD_POLL_S = 0.002  # how often a load looks for more chunks read ahead (on its own thread)


class AsyncLoader:
    """Runs :class:`LoadJob` s on a bounded thread pool and collects their outcomes.

    Args:
        store: this rank's store.
        copier: copies pages into the engine's blocks.
        blocks_per_chunk: ``chunk_tokens // block_size``.
        block_size: tokens per engine block.
        threads: loader threads (> 0).
        groups: hybrid models: one copier per KV cache group.
        wait_s: longest a job waits for the chunks read ahead from a lower tier, seconds.
    """

    def __init__(self, store: TieredStore, copier: BlockCopier | None, blocks_per_chunk: int, block_size: int,
                 threads: int, groups: GroupCopiers | None = None, wait_s: float = 10.0) -> None:
        self.store = store
        self.wait_s = wait_s  # longest wait for chunks read ahead (config load_wait_s)
        self.copier = copier
        self.groups = groups  # hybrid models: one copier per KV cache group, page jobs
        self._failed: set[str] = set()
        self.k = blocks_per_chunk
        self.block_size = block_size
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-load")
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._errors: set[int] = set()
        self._aborted: set[str] = set()
        self._inflight: dict[str, Future[None]] = {}
        # ended loads not yet taken: req_id -> (store epoch at their start, blocks filled; None: a page load)
        self._filled: dict[str, tuple[int, tuple[int, ...] | None]] = {}

    def submit(self, job: LoadJob) -> None:
        """Start ``job`` in the background (never blocks)."""
        with self._lock:
            self._aborted.discard(job.req_id)
            self._inflight[job.req_id] = self._pool.submit(self._run, job)

    def abort(self, req_ids: set[str]) -> None:
        """Requests vLLM finished (aborted): their loads not started yet are skipped."""
        with self._lock:
            self._aborted.update(r for r in req_ids if r in self._inflight)

    def take(self) -> tuple[set[str], set[int]]:
        """Requests whose load ended since the last call, and the blocks that could not be filled."""
        with self._lock:
            finished, errors = self._finished, self._errors
            self._finished, self._errors = set(), set()
            epoch = self.store.epoch
            for req_id, (started, filled) in self._filled.items():
                if started == epoch:
                    continue
                if filled is None:  # a hybrid model's load: failed whole
                    self._failed.add(req_id)
                elif filled:
                    errors.update(filled)
                    self.store.counters.engine_load_failed(len(filled))
            self._filled.clear()
            return finished, errors

    def take_failed(self) -> set[str]:
        """Hybrid models: requests whose page load failed whole since the last call (they are
        also in :meth:`take`'s finished set, no later than this)."""
        with self._lock:
            failed, self._failed = self._failed, set()
            return failed

    @property
    def num_inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def _run(self, job: LoadJob) -> None:
        if job.pages:
            self._run_pages(job)
            return
        first_chunk = job.first_block // self.k
        delivered = first_chunk  # chunks whose blocks are filled (chunks before first_chunk need none)
        handle = None
        ok = skipped = False
        t0 = time.perf_counter()
        epoch = self.store.epoch  # before anything is read: a reset from here on fails the load
        try:
            with self._lock:
                skipped = job.req_id in self._aborted
            if skipped:
                return
            # max_chunks: the plan already asked the shared tier, so its reads need no second presence batch
            handle = self.store.prepare_load([ChunkKey(k) for k in job.keys], max_chunks=job.num_chunks,
                                             read_ahead=True)
            assert self.copier is not None
            deadline = time.monotonic() + self.wait_s
            num_blocks = 0
            while True:
                complete = handle.wait(0)  # True once the read-ahead ended: num_chunks is final
                ready = handle.num_chunks if complete else handle.ready_chunks()
                if ready > delivered:
                    num_blocks += self._copy(job, handle, delivered, ready)
                    delivered = ready
                if complete:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("kvtier: request %s: chunks %d.. were not read within load_wait_s=%s; "
                                "recomputing them", job.req_id, delivered, self.wait_s)
                    break
                handle.wait(min(left, READ_AHEAD_POLL_S))
            ok = True
            if delivered < job.num_chunks:
                log.info("kvtier: request %s: %d of %d planned chunks loaded; recomputing the rest",
                         job.req_id, delivered, job.num_chunks)
            self.store.counters.moved("cpu_to_engine", num_blocks * self.copier.layout.block_bytes
                                      * self.copier.layout.num_layers, time.perf_counter() - t0)
        except Exception:
            log.exception("kvtier: loading request %s's chunks failed; recomputing them", job.req_id)
        finally:
            if handle is not None:
                self.store.complete_load(handle, ok and delivered > first_chunk, first_chunk=first_chunk)
            failed = () if skipped else job.block_ids[max(delivered * self.k - job.first_block, 0):]
            if failed:
                self.store.counters.engine_load_failed(len(failed))
            with self._lock:
                self._errors.update(failed)  # errors first: they must not reach vLLM after the finish
                self._finished.add(job.req_id)
                if not skipped:
                    self._filled[job.req_id] = (epoch, job.block_ids[:max(delivered * self.k - job.first_block, 0)])
                self._inflight.pop(job.req_id, None)
                self._aborted.discard(job.req_id)

    def _copy(self, job: LoadJob, handle: LoadHandle, start: int, end: int) -> int:
        """Copy chunks ``start .. end - 1`` of ``handle`` into the job's blocks; returns blocks copied."""
        assert self.copier is not None
        spans = []
        for c in range(start, end):
            lo, hi = max(job.first_block, c * self.k), (c + 1) * self.k
            spans.append(Span(handle.buffers[c], lo - c * self.k, job.block_ids[lo - job.first_block:hi - job.first_block]))
        self.copier.load(spans)
        for c, span in zip(range(start, end), spans):
            # vLLM counts hits of re-admitted (preempted) requests apart; so do we.
            self.store.counters.engine_loaded(handle.tiers[c], len(span.block_ids) * self.block_size, job.resumed)
        return sum(len(s.block_ids) for s in spans)

    def _run_pages(self, job: LoadJob) -> None:
        """A hybrid model's load: every page of every group, or a failed request."""
        assert self.groups is not None
        tiers = None
        t0 = time.perf_counter()
        epoch = self.store.epoch  # before anything is read: a reset from here on fails the load
        try:
            with self._lock:
                skipped = job.req_id in self._aborted
            if not skipped:
                tiers = load_pages(self.store, self.groups, job.pages)
                if tiers is None:
                    log.info("kvtier: request %s: the store no longer holds every planned page; recomputing it",
                             job.req_id)
        except Exception:
            log.exception("kvtier: loading request %s's pages failed; recomputing it", job.req_id)
            tiers = None
            skipped = False
        if tiers is not None:
            slowest_tier = slowest(tiers)
            tokens = job.hit_tokens - job.first_block * self.block_size  # first_block: the engine's own hit
            self.store.counters.engine_loaded(slowest_tier, tokens, job.resumed)
            self.store.counters.moved("cpu_to_engine", self.groups.moved_bytes(job.pages), time.perf_counter() - t0)
        with self._lock:
            if tiers is None and not skipped:
                self._failed.add(job.req_id)
                self.store.counters.engine_load_failed(sum(len(p.block_ids) for p in job.pages))
            if tiers is not None:
                self._filled[job.req_id] = (epoch, None)
            self._finished.add(job.req_id)
            self._inflight.pop(job.req_id, None)
            self._aborted.discard(job.req_id)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Cancel jobs not started, wait up to ``timeout_s`` for running ones.  Idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout_s
        while self.num_inflight and time.monotonic() < deadline:
            with self._lock:
                pending = [f for f in self._inflight.values() if not f.cancelled()]
                if not pending:
                    break
            time.sleep(0.01)
