"""Saves: after the forward pass, each save job's pages not stored yet are copied out of the engine's
blocks into cpu pages and published; disk and shared writes then happen on the store's threads
through its bounded queue (full: dropped and counted).  The store's two-phase contract:
``prepare_store`` reserves (on the engine's thread, under the eviction gate as it stands there),
the copy runs, ``complete_store`` runs on every path.

Two ways, chosen per job by the scheduler (``SaveJob.deferred``: config ``async_saves``, and only
full-attention pages, whose blocks neither change nor leave while their request runs):

- **deferred**: the engine's thread reserves the pages, records an event after the forward
  (:meth:`~kvtier.integrations.vllm.worker.copy.GroupCopiers.mark`: CUDA; on the host nothing,
  the forward is over when ``wait_for_save`` is called), hands the job to the
  :class:`SaveQueue` and returns: no wait on the device.  The saver thread copies (on CUDA its
  streams wait for that event, on the device), publishes (``complete_store``) and pins
  (``ttl_pin``).  vLLM keeps the request's blocks after it finishes until every rank names it in
  ``finished_sending`` (``request_finished`` returned True), and a preempted request's saves are
  waited for in ``handle_preemptions`` before the forward that may reuse its blocks: vLLM's
  native offload does the same (vllm/v1/kv_offload/cpu/gpu_worker.py, the offloading
  connector's ``handle_preemptions``).
- **inline** (sliding-window and state pages, or ``async_saves: false``): the copy runs on the
  engine's thread and is done when :func:`save_jobs` returns.

Bounds: :data:`SAVE_QUEUE_DEPTH` deferred jobs queued; when full, the engine's thread waits for
room at most :data:`SAVE_QUEUE_WAIT_S` (each such wait counted: ``backpressure_waits``,
``backpressure_s``), then drops the job (its pages released, counted in ``dropped``): a dropped
save is a future miss, never an engine failure.  Every wait for the saver thread is bounded; a
save still running when its blocks must be given back (a preemption, a reset, shutdown) past its
bound is *voided*: its pages are released, never published (they may hold bytes of another request).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import torch

from kvtier.core.context import EngineSave, OpContext
from kvtier.core.handles import StoreHandle
from kvtier.core.keys import ChunkKey
from kvtier.core.mover import RequestRecord
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.protocol import PageMove, RequestFacts, SaveJob
from kvtier.integrations.vllm.worker.copy import GroupCopiers
from kvtier.integrations.vllm.worker.loader import FactsBook, moved_bytes

log = logging.getLogger(__name__)

SAVE_QUEUE_DEPTH = 256
"""Deferred save jobs queued at most (each holds cpu pages it reserved, no other memory)."""
SAVE_QUEUE_WAIT_S = 2.0
"""Longest the engine's thread waits for room in a full save queue, seconds (then the job is dropped)."""


@dataclasses.dataclass(eq=False)
class Deferred:
    """One deferred save: the job, its reserved pages (``handle``; ``stored`` their page moves), the
    event the copy waits for (CUDA; ``None`` on the host)."""

    job: SaveJob
    handle: StoreHandle
    stored: list[PageMove]
    after: Any
    void: bool = False  # its blocks were given back before it ended: release, never publish


class SaveQueue:
    """The saver thread and its bounded queue (see the module docstring).

    Args:
        store: this rank's store.  copiers: the engine's copiers.
        token_group: the group whose pages count saved tokens (-1: none).  chunk_tokens: tokens per chunk.
        depth: jobs queued at most.  wait_s: longest wait for room in a full queue, seconds.
    """

    def __init__(self, store: TieredStore, copiers: GroupCopiers, token_group: int, chunk_tokens: int,
                 depth: int = SAVE_QUEUE_DEPTH, wait_s: float = SAVE_QUEUE_WAIT_S) -> None:
        self.store, self.copiers = store, copiers
        self.token_group, self.chunk_tokens, self.wait_s = token_group, chunk_tokens, wait_s
        self._queue: queue.Queue[Deferred | None] = queue.Queue(maxsize=depth)
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # notified as each job ends
        self._jobs: dict[str, list[Deferred]] = {}  # request -> its jobs queued or running
        self._open = threading.Event()  # cleared by hold(): the saver thread takes no job
        self._open.set()
        self._closing = False
        self.backpressure_waits = 0  # submits that found the queue full and waited
        self.backpressure_s = 0.0  # seconds the engine's thread spent in those waits
        self.dropped = 0  # jobs dropped: the queue stayed full past wait_s
        self.voided = 0  # jobs released unpublished: their blocks were given back first
        self.completed = 0  # jobs ended (published, released or failed)
        self._ended_seqs: list[int] = []  # SaveJob.seq of deferred jobs ended since take_ended
        # bumped under the lock by every change a step's report reads (a job queued or ended, a count): a
        # reader that sees the same number as at its last read knows counts(), in_flight and take_ended()
        # would tell it nothing new, and asks nothing (the worker's per-step report, worker/side.py)
        self.version = 0
        self._thread = threading.Thread(target=self._loop, name="kvtier-save", daemon=True)
        self._thread.start()

    # ---- the engine's thread -----------------------------------------------------------------
    def submit(self, item: Deferred) -> bool:
        """Queue ``item``; a full queue is waited on at most ``wait_s`` (counted), then it is dropped
        (released, reported ended).  Returns False when it was dropped."""
        with self._lock:
            self._jobs.setdefault(item.job.req_id, []).append(item)
            self.version += 1
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            pass
        t0 = time.perf_counter()
        try:
            self._queue.put(item, timeout=self.wait_s)
            queued = True
        except queue.Full:
            queued = False
        with self._lock:
            self.backpressure_waits += 1
            self.backpressure_s += time.perf_counter() - t0
            self.version += 1
        if not queued:
            log.warning("kvtier: the save queue stayed full for %.1f s; request %s's save is dropped",
                        self.wait_s, item.job.req_id)
            self.dropped += 1
            self._end(item, published=False)
        return queued

    def counts(self) -> dict[str, float]:
        """Totals since start, by payload counter name (:mod:`kvtier.integrations.vllm.stats_table`):
        ``deferred_save_waits`` (submits that found the queue full), ``deferred_save_wait_seconds``
        (the engine thread's time in those waits, s), ``deferred_saves_dropped``, ``deferred_saves_voided``."""
        with self._lock:
            return {"deferred_save_waits": self.backpressure_waits, "deferred_save_wait_seconds": self.backpressure_s,
                    "deferred_saves_dropped": self.dropped, "deferred_saves_voided": self.voided}

    def note_ended(self, seq: int) -> None:
        """A deferred job that never reached the queue (nothing to copy, cut, failed) ended."""
        with self._lock:
            self._ended_seqs.append(seq)
            self.version += 1

    def take_ended(self) -> tuple[int, ...]:
        """The numbers of the deferred jobs ended since the last call (``RankReport.saves_ended``)."""
        with self._lock:
            ended, self._ended_seqs = tuple(self._ended_seqs), []
        return ended

    def pending(self, req_id: str) -> bool:
        """A save of ``req_id`` is queued or running."""
        with self._lock:
            return req_id in self._jobs

    @property
    def in_flight(self) -> int:
        """Deferred jobs queued or running."""
        with self._lock:
            return sum(len(jobs) for jobs in self._jobs.values())

    def wait_for(self, req_ids: Collection[str] | None, timeout_s: float) -> bool:
        """Block until no save of ``req_ids`` (``None``: of any request) is queued or running, at most
        ``timeout_s``; those still running then are voided (released unpublished, logged).

        Returns:
            True when they all ended in time."""
        def done() -> bool:
            return not self._jobs if req_ids is None else not any(r in self._jobs for r in req_ids)

        with self._ended:
            if self._ended.wait_for(done, max(timeout_s, 0.0)):
                return True
            late = [item for r, jobs in self._jobs.items() if req_ids is None or r in req_ids for item in jobs]
            for item in late:
                item.void = True
        log.warning("kvtier: %d saves still running after %.1f s while their blocks are given back; they are "
                    "released, not published", len(late), timeout_s)
        return False

    def wait_any(self, req_ids: Collection[str], timeout_s: float) -> bool:
        """Block until one of ``req_ids`` has no save queued or running (at once if one already has),
        at most ``timeout_s`` (an idle engine step: it does not spin while the saver copies)."""
        with self._ended:
            return self._ended.wait_for(lambda: any(r not in self._jobs for r in req_ids), max(timeout_s, 0.0))

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """While inside, the saver thread starts no job (jobs queue up; the queue's bound still holds):
        a save's copy is provably later than its ``wait_for_save``, which a test can check."""
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()

    def close(self, timeout_s: float) -> None:
        """Let queued saves end within ``timeout_s`` (then void the rest), stop the thread.  Idempotent."""
        if self._closing:
            return
        self.wait_for(None, timeout_s)
        self._closing = True
        self._open.set()
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(timeout=5.0)

    # ---- the saver thread --------------------------------------------------------------------
    def _loop(self) -> None:
        device = next(iter(self.copiers.copiers.values())).device
        if device.type == "cuda":  # the current device is per thread: this rank's, not device 0
            torch.cuda.set_device(device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            while not self._open.wait(0.1) and not self._closing:
                pass  # held (hold()): bounded by the holder, re-checked ten times a second
            try:
                self._run(item)
            except Exception:  # a failed save is a future miss, never an engine failure
                log.exception("kvtier: saving request %s's chunks failed", item.job.req_id)
                self._end(item, published=False)

    def _run(self, item: Deferred) -> None:
        t0 = time.perf_counter()
        ok = False
        try:
            if not item.void:
                self.copiers.save(list(zip(item.stored, item.handle.buffers)), item.after)
                ok = not item.void  # voided during the copy: the blocks may have changed under it
        finally:
            self._end(item, published=ok, seconds=time.perf_counter() - t0)

    def _end(self, item: Deferred, published: bool, seconds: float = 0.0) -> None:
        """Publish or release the item's pages (once), pin, and tell the waiters."""
        try:
            if not item.handle.done:
                tokens = sum(1 for p in item.stored if p.group == self.token_group) * self.chunk_tokens
                self.store.complete_store(item.handle, published, EngineSave(
                    tokens, moved_bytes(self.copiers, item.stored), seconds))
            if published and item.job.pin_s > 0:
                _pin(self.store, item.job)
        finally:
            with self._ended:
                if item.void:
                    self.voided += 1
                jobs = self._jobs.get(item.job.req_id, [])
                if item in jobs:
                    jobs.remove(item)
                    self.completed += 1
                    self._ended_seqs.append(item.job.seq)
                if not jobs:
                    self._jobs.pop(item.job.req_id, None)
                self.version += 1
                self._ended.notify_all()


def save_jobs(store: TieredStore, copiers: GroupCopiers, jobs: Sequence[SaveJob], sync_cut: Mapping[str, int],
              token_group: int, chunk_tokens: int, saver: SaveQueue | None = None,
              facts: FactsBook | None = None) -> None:
    """Run this step's save jobs: deferred ones (``SaveJob.deferred``, with a ``saver``) reserved here
    and copied by the saver thread, the others copied here.  Never raises: a failed save is a
    future miss, never an engine failure.

    Args:
        sync_cut: this step's synchronous loads that came up short, request → first chunk not
            filled: that request's pages from there on hold KV computed over unfilled blocks (wrong),
            and are not saved.
        token_group: the KV cache group whose pages count saved tokens (the first full-attention
            group; -1: none counted).
        facts: where each job's facts go, for its request's receipt (:class:`~.loader.FactsBook`, :func:`save_facts`); ``None``: nowhere.
            A deferred job's facts are taken here, when it is queued, so that they reach the
            receipt its request's ``request_finished`` returns (completed in the same step): its
            chunks reserved count as saved (a deferred copy that later fails or is voided is not
            taken back), a queue drop as ``save_dropped``; TTL-pinned requests are never deferred
            (the scheduler's ``_deferrable``), so a pin is always known within the step.
    """
    after: Any = None
    marked = False
    for job in jobs:
        queued = False
        record = RequestRecord(chunk_tokens)
        found: RequestFacts | None = None  # a deferred job's facts, taken before its copy
        try:
            cut = sync_cut.get(job.req_id)
            if cut is not None:
                job = dataclasses.replace(job, pages=tuple(p for p in job.pages if p.chunk < cut))
                if not job.pages:
                    continue
            handle, stored = _reserve(store, job, record)
            if not handle.num_chunks:
                if job.pin_s > 0:
                    _pin(store, job, record)
            elif job.deferred and saver is not None:
                if not marked:  # one event per step: after the forward, before any copy of it
                    after, marked = copiers.mark(), True
                found = save_facts(record, store.cpu.name, chunk_tokens, job.explain_chunk * chunk_tokens)
                queued = True  # handed to the saver: it reports the number ended, even when it drops the job
                if saver.submit(Deferred(job, handle, stored, after)):  # its copy runs later: what it queued
                    chunks = sum(1 for p in stored if p.group == token_group)
                    found.saved = {store.cpu.name: chunks} if chunks else {}
                else:
                    found.dropped["save_dropped"] = found.dropped.get("save_dropped", 0) + len(stored)
            else:
                _copy_now(store, copiers, job, handle, stored, token_group, chunk_tokens, record)
        except Exception:  # a failed save is a future miss, never an engine failure
            log.exception("kvtier: saving request %s's chunks failed", job.req_id)
        finally:
            if job.deferred and saver is not None and not queued:  # every rank reports every number
                saver.note_ended(job.seq)
        if facts is not None:
            facts.add(job.req_id, found or save_facts(record, store.cpu.name, chunk_tokens,
                                                      job.explain_chunk * chunk_tokens))


def _reserve(store: TieredStore, job: SaveJob, record: RequestRecord) -> tuple[StoreHandle, list[PageMove]]:
    """Reserve cpu pages for the job's pages not stored yet: the handle and those pages' moves
    (``record`` hears of them, with why the page of ``job.explain_chunk`` was in no tier)."""
    chain = [ChunkKey(job.parent)] if job.parent else []
    chain += [ChunkKey(p.key) for p in job.pages]
    first = len(chain) - len(job.pages)  # the parent only names the first page's parent
    ctx = OpContext(job.req_id, job.tenant, record)  # the request's context: its id and tenant, explicitly
    explain = next((first + i for i, p in enumerate(job.pages) if p.chunk == job.explain_chunk), -1) \
        if job.explain_chunk >= 0 else -1
    touch = first + next((i for i, p in enumerate(job.pages) if p.chunk >= job.touch_chunks), len(job.pages))
    handle = store.prepare_store(chain, start=first, ctx=ctx, explain=explain, touch_end=touch)
    return handle, [job.pages[i - first] for i in handle.indices]


def _copy_now(store: TieredStore, copiers: GroupCopiers, job: SaveJob, handle: StoreHandle,
              stored: list[PageMove], token_group: int, chunk_tokens: int, record: RequestRecord) -> None:
    """Copy on this thread, publish (the store counts what was saved), pin."""
    t0 = time.perf_counter()
    ok = False
    try:
        copiers.save(list(zip(stored, handle.buffers)))
        ok = True
    finally:
        # tokens: those of the full-attention chunks stored (one group's pages count each chunk once)
        tokens = sum(1 for p in stored if p.group == token_group) * chunk_tokens
        store.complete_store(handle, ok, EngineSave(tokens, moved_bytes(copiers, stored), time.perf_counter() - t0))
    if job.pin_s > 0:
        _pin(store, job, record)


def _pin(store: TieredStore, job: SaveJob, record: RequestRecord | None = None) -> None:
    """Pin the prompt's pages the job names when the request asked for a TTL pin (``record``
    hears what was kept or refused)."""
    store.ttl_pin([ChunkKey(p.key) for p in job.pages if p.chunk < job.pin_chunks], job.pin_s,
                  OpContext(job.req_id, job.tenant) if record is None else OpContext(job.req_id, job.tenant, record))


def save_facts(record: RequestRecord, top: str, chunk_tokens: int, explain_token: int) -> RequestFacts:
    """One save job's facts: chunks stored in the top tier, chunks dropped and why, the TTL pin,
    and why the chunk it was asked about was in no tier (at token ``explain_token``)."""
    dropped: dict[str, int] = {}
    if record.dropped_chunks:
        dropped["save_dropped"] = record.dropped_chunks
    for n in record.unwritten_chunks.values():
        dropped["save_dropped"] = dropped.get("save_dropped", 0) + n
    e = record.explained
    return RequestFacts(saved={top: record.saved_tokens // chunk_tokens} if record.saved_tokens else {},
                        dropped=dropped, pinned=record.ttl_pinned, pin_refused=record.ttl_refused,
                        explained=(explain_token, e.reason, e.tier) if e is not None else None)
