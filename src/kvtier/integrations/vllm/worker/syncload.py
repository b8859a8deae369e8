"""Synchronous loads on a worker rank: a hit copied on the engine's thread, before the forward.

A hit held whole in the cpu tier (or the node pool) and within ``sync_load_max_bytes``
(``LoadJob.sync``) is copied on the engine's thread in ``start_load_kv``, before the forward of
the step that scheduled the request (:func:`load_now`; layer by layer with ``layerwise_loads``,
:func:`load_layers`): the same prepare / copy / complete as an asynchronous load
(:mod:`~.loader`) over the cpu tier's pinned pages and the pool's values (pinned and verified, the
pin within ``shared_deadline_s``), no thread hand-off, no ``finished_recving``; the blocks it could
not fill are vLLM load errors in that same step.  Each ends through
:meth:`LoadPath.finish <kvtier.integrations.vllm.worker.loader.LoadPath.finish>` (counted
in the store, the request's facts kept), as an asynchronous load does.
"""

from __future__ import annotations

import logging
import time

from kvtier.core.handles import NO_BUFFER, LoadHandle
from kvtier.core.mover import RequestRecord
from kvtier.integrations.vllm.protocol import LoadJob
from kvtier.integrations.vllm.worker.finisher import Finisher
from kvtier.integrations.vllm.worker.layerwise import LayerLoads
from kvtier.integrations.vllm.worker.loader import CHUNK_OF, LoadPath, job_context, job_keys, load_pages

log = logging.getLogger(__name__)
NO_EPOCH = 0
"""What a synchronous load passes :meth:`LoadPath.finish` as its epoch: it is read only to report an
asynchronous load later (checked against a reset then); a synchronous one is reported in its own step."""


def load_now(loader: LoadPath, job: LoadJob, finisher: Finisher | None = None) -> tuple[set[int], int | None]:
    """Run a synchronous ``job`` on the calling (engine) thread: pin the leading pages the cpu
    tier holds (``prepare_load(top_only=True)``: no I/O, no re-hashing of pages that never left
    memory) and, for a job planned in the node pool too, the pool's values after them (one pin
    within :attr:`LoadPath.sync_within_s`, read and verified into the blocks), copy the cpu pages
    straight into the engine's blocks, count, unpin (:meth:`LoadPath.finish`: on ``finisher``'s
    thread while the forward runs, :mod:`~.finisher`; ``None``: here).

    Never raises: a failure is logged and its pages are reported as unfilled.

    Returns:
        ``(blocks not filled, first chunk not filled)``: the blocks go to vLLM through
        ``get_block_ids_with_load_errors`` in this same step (vLLM recomputes from the first
        one, vllm/v1/core/sched/scheduler.py ``_handle_invalid_blocks``); the chunk is ``None``
        when every page was copied (the worker keeps this step's saves of the request before
        that chunk: the KV computed over unfilled blocks is wrong).

    Raises:
        ValueError: the loader reports block-level errors only with one KV cache group
            (``partial``); the scheduler plans no synchronous load otherwise.
    """
    if not loader.partial:
        raise ValueError("a synchronous load needs block-level load errors (one full-attention KV cache group)")
    handle = None
    delivered = 0
    ok = False
    t0 = time.perf_counter()
    # a hit planned beyond the cpu tier (the node pool: SyncBudget's tiers) pins and reads it here, within
    # sync_within_s (a stalled owner costs this step that much, then its breaker makes it a miss at once);
    # a store with no shared tier has nothing beyond it (no look at the pages: the hit path)
    shared = bool(loader.store.index.shared) and any(map(loader.store.cpu.name.__ne__, map(
        job.tiers.__getitem__, map(CHUNK_OF, job.pages))))
    # the request's context and record: made here when the pool's reads report to them, else on the finisher's
    # thread (finish_sync: a cpu-tier pin reports nothing but a cut, which the handle keeps until then)
    record = RequestRecord(loader.chunk_tokens) if shared else None
    try:
        handle = loader.store.prepare_load(job_keys(job), max_chunks=len(job.pages), top_only=True,
                                           ctx=job_context(job, record) if record is not None else None,
                                           into=loader.direct.into(job) if shared and loader.direct is not None else None,
                                           shared_within_s=loader.sync_within_s if shared else None)
        held = len(handle.keys)  # (num_chunks: no property's frame)
        moves = [m for m in zip(job.pages[:held], handle.buffers[:held]) if m[1] is not NO_BUFFER] if shared \
            else list(zip(job.pages[:held], handle.buffers[:held]))  # (cpu pages only: no comprehension's frame)
        if moves:  # (a chunk read into its blocks, NO_BUFFER, is there already)
            load_pages(loader.copiers, moves, hold_gil=True)  # (the engine's thread: it holds the GIL anyway)
        delivered, ok = held, True  # a copy that raised part-way filled nothing vLLM may use
        if delivered < len(job.pages):
            log.info("kvtier: request %s: %d of %d planned pages were found for its synchronous load; "
                     "recomputing the rest", job.req_id, delivered, len(job.pages))
    except Exception:
        log.exception("kvtier: loading request %s's pages synchronously failed; recomputing them", job.req_id)
    if finisher is None:
        errors = finish_sync(loader, job, handle, delivered, ok, time.perf_counter() - t0, record)
    else:  # the blocks finish() reports for a partial load (one group): those of the pages not delivered
        errors = {b for p in job.pages[delivered:] for b in p.block_ids} if delivered < len(job.pages) else set()
        finisher.submit(finish_sync, loader, job, handle, delivered, ok, time.perf_counter() - t0, record)
    first_unfilled = None if not errors else job.pages[delivered].chunk
    return errors, first_unfilled


def finish_sync(loader: LoadPath, job: LoadJob, handle: LoadHandle | None, delivered: int, ok: bool, seconds: float,
                record: RequestRecord | None = None) -> set[int]:
    """End a synchronous load (:meth:`LoadPath.finish <kvtier.integrations.vllm.worker.loader.LoadPath.finish>`):
    count it, unpin, keep the request's facts; returns the blocks not filled.  ``record``: the request's
    record its prepare reported to already; ``None``: the load was prepared with the store's own context (a
    cpu-tier pin), so the request's context and record are made and bound to ``handle`` here first, and the
    cut its prepare met (``handle.cut``, counted in the store then) reaches the record now.  Off the engine's
    thread when handed to the :class:`Finisher` (what the pin does not need: 15-30 us with the caches cold,
    ``scripts/hit_cost.py --prompt-tokens 1000``)."""
    if record is None:
        record = RequestRecord(loader.chunk_tokens)
        if handle is not None:
            handle.ctx = loader.store.sink.bind(job_context(job, record))
            if handle.cut is not None:
                record.emit(handle.cut)
    return loader.finish(job, handle, delivered, ok, False, seconds, NO_EPOCH, sync=True, record=record)


def load_layers(loader: LoadPath, job: LoadJob, layers: LayerLoads) -> tuple[set[int], int | None]:
    """:func:`load_now`, layer by layer (``layerwise_loads``, :mod:`~.layerwise`): the pages are
    pinned and the unfilled blocks known here; the copies are issued per layer and the load is
    counted and unpinned once its last layer's copy ended (``LayerLoads.poll``).  Same returns."""
    if not loader.partial:
        raise ValueError("a synchronous load needs block-level load errors (one full-attention KV cache group)")
    t0 = time.perf_counter()
    handle = None
    record = RequestRecord(loader.chunk_tokens)
    try:
        handle = loader.store.prepare_load(job_keys(job), max_chunks=len(job.pages),
                                           top_only=True, ctx=job_context(job, record))
        held = handle.num_chunks
        ended = lambda: loader.finish(job, handle, held, True, False, time.perf_counter() - t0,
                                      NO_EPOCH, sync=True, record=record)
        if held:
            layers.issue(list(zip(job.pages[:held], handle.buffers[:held])), ended)
        else:
            ended()
    except Exception:
        log.exception("kvtier: loading request %s's pages layer by layer failed; recomputing them", job.req_id)
        errors = loader.finish(job, handle, 0, False, False, time.perf_counter() - t0, NO_EPOCH, sync=True,
                               record=record)
        return errors, job.pages[0].chunk if errors else None
    errors = {b for p in job.pages[held:] for b in p.block_ids}
    return errors, (job.pages[held].chunk if held < len(job.pages) else None)
