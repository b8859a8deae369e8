"""One asynchronous load's path on a loader thread: store → (disk read, verify) → engine blocks.

:class:`LoadPath` runs one :class:`LoadJob` (a request admitted with a kvtier hit, any model: a dense
model's pages are its chunks) on the loader thread :class:`~.side.AsyncLoader` hands it to: prepare
(pin, read the first chunks, the rest ahead), copy each page into its engine blocks as it is ready
(:func:`load_pages`: host caches one ``memmove`` per run; at most ``load_wait_s`` for the tail),
complete (the store counts what the engine got), report into :class:`Outcomes` (the blocks not
filled, or the load failed whole, then the finish) and the load's facts (:func:`load_facts`) into
:class:`FactsBook`.  Synchronous loads (:mod:`~.syncload`) end through :meth:`LoadPath.finish` too.
Each step and what a short load reports: docs/architecture.md, "Load", step 4.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import wait
from itertools import groupby
from operator import attrgetter, ne
from typing import Any

import numpy as np

from kvtier.core.context import EngineLoad, OpContext
from kvtier.core.handles import NO_BUFFER, LoadHandle
from kvtier.core.keys import ChunkKey
from kvtier.core.mover import RequestRecord
from kvtier.core.store import TieredStore
from kvtier.core.tiers.registry import slowest
from kvtier.integrations.vllm.protocol import LoadJob, PageMove, RequestFacts
from kvtier.integrations.vllm.worker.copy import BlockCopier, GroupCopiers, load_run_by_run
from kvtier.integrations.vllm.worker.direct import DirectTargets
from kvtier.integrations.vllm.worker.outcomes import Outcomes

log = logging.getLogger(__name__)

READ_AHEAD_POLL_S = 0.002  # how often a load looks for more chunks read ahead (on its own thread)
CHUNK_OF = attrgetter("chunk")  # a PageMove's chunk (in C: no generator frame per page on the hit path)
KEY_OF = attrgetter("key")  # a PageMove's key (in C: no comprehension's frame)
BLOCK_IDS_OF = attrgetter("block_ids")  # a PageMove's block ids


class LoadPath:
    """Runs one :class:`LoadJob` at a time on the calling (loader) thread: prepare, copy each page as
    it is ready, complete, report to :attr:`outcomes`.

    Args:
        store: this rank's store.
        copiers: copy pages into the engine's blocks (one copier per KV cache group).
        chunk_tokens: tokens per chunk.
        partial: a short load keeps its valid prefix and reports the rest as block-level
            errors (one full-attention KV cache group); otherwise it fails whole.
        wait_s: longest a job waits for the pages read ahead from a lower tier, seconds.
        direct: node-tier chunks read straight into the blocks (:mod:`~.direct`); ``None``: into pages.
        sync_within_s: deadline of a synchronous load's shared-tier read (``shared_deadline_s``).
    """

    def __init__(self, store: TieredStore, copiers: GroupCopiers, chunk_tokens: int, partial: bool,
                 wait_s: float = 10.0, direct: DirectTargets | None = None, sync_within_s: float = 0.25) -> None:
        self.store = store
        self.sync_within_s = sync_within_s
        self.copiers = copiers
        self.direct = direct
        self.chunk_tokens = chunk_tokens
        self.partial = partial
        self.wait_s = wait_s  # longest wait for pages read ahead (config load_wait_s)
        self.outcomes = Outcomes()
        self.facts = FactsBook()  # what loads (and the worker's saves) learned, for the requests' receipts

    def run(self, job: LoadJob) -> None:
        """Load ``job``: its outcome goes to :attr:`outcomes`, its facts to :attr:`facts`."""
        handle = None
        delivered = 0  # leading pages copied into the engine
        ok = skipped = False
        record = RequestRecord(self.chunk_tokens)  # the load's events, for the request's receipt
        budget_cut: int | None = None
        t0 = time.perf_counter()
        epoch = self.store.epoch  # before anything is read: a reset from here on fails the load
        try:
            with self.outcomes.lock:
                skipped = job.req_id in self.outcomes.aborted
            if skipped:
                return
            # max_chunks: the plan already asked the shared tier, so its reads need no second presence batch
            handle = self.store.prepare_load(job_keys(job), max_chunks=len(job.pages), read_ahead=True,
                                             ctx=job_context(job, record),
                                             into=self.direct.into(job) if self.direct is not None else None)
            delivered, timed_out = self._copy_as_ready(job, handle)
            budget_cut = delivered if timed_out else None
            ok = True
        except Exception:
            log.exception("kvtier: loading request %s's pages failed; recomputing them", job.req_id)
        finally:
            self.finish(job, handle, delivered, ok, skipped, time.perf_counter() - t0, epoch, record=record,
                        budget_cut=budget_cut)

    def _copy_as_ready(self, job: LoadJob, handle: LoadHandle) -> tuple[int, bool]:
        """Copy the handle's pages into the engine as they become ready; returns pages copied and
        whether it stopped waiting for the rest (``load_wait_s`` passed).  The handle's reads ahead
        are its ``pending`` future, watched here directly (``handle.wait`` and ``handle.ready_chunks``
        without a call per poll: the hit path)."""
        delivered = 0
        timed_out = False
        ahead = handle.pending  # the reads still running; None: every chunk is in place
        deadline = time.monotonic() + self.wait_s
        while True:
            if ahead is not None and ahead.done():
                ahead.result()  # a read ahead that raised fails the load
                ahead = None  # (num_chunks is final now)
            ready = len(handle.keys) if ahead is None else handle.ahead_from
            if ready > delivered:  # (a chunk read into its blocks, NO_BUFFER, is there already)
                moves = [m for m in zip(job.pages[delivered:ready], handle.buffers[delivered:ready])
                         if m[1] is not NO_BUFFER]
                if moves:
                    load_pages(self.copiers, moves)
                delivered = ready
            if ahead is None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("kvtier: request %s: pages %d.. were not read within load_wait_s=%s; "
                            "recomputing them", job.req_id, delivered, self.wait_s)
                timed_out = True
                break
            wait((ahead,), min(left, READ_AHEAD_POLL_S))
        if delivered < len(job.pages):
            log.info("kvtier: request %s: %d of %d planned pages loaded; recomputing the rest",
                     job.req_id, delivered, len(job.pages))
        return delivered, timed_out

    def _filled_end(self, job: LoadJob, delivered: int) -> int:
        """The token the engine's KV is valid up to after ``delivered`` leading pages."""
        if delivered == len(job.pages):
            return job.hit_tokens
        if not self.partial or delivered == 0:
            return job.first_token
        return min(job.hit_tokens, (job.pages[delivered - 1].chunk + 1) * self.chunk_tokens)

    def finish(self, job: LoadJob, handle: LoadHandle | None, delivered: int, ok: bool, skipped: bool,
                seconds: float, epoch: int, sync: bool = False, record: RequestRecord | None = None,
                budget_cut: int | None = None) -> set[int]:
        """Count the outcome in the store (once), then report errors and the finish to vLLM
        (``sync``: return the blocks not filled instead; a synchronous load has no finish to report)."""
        pages, whole = job.pages, ok and not skipped and delivered == len(job.pages)  # whole: every page copied
        end = job.hit_tokens if whole else self._filled_end(job, delivered if ok else 0) if not skipped \
            else job.first_token
        failed_whole = not whole and not skipped and end < job.hit_tokens and not self.partial
        unfilled_pages = () if whole or skipped else pages if failed_whole else pages[delivered:]
        # (each comprehension below runs only when it has something to go through: a frame per hit, cold)
        errors = () if (failed_whole or not unfilled_pages) else [b for p in unfilled_pages for b in p.block_ids]
        # none rerouted if every chunk was found in the one tier all were planned in (a page's chunk lies past the
        # engine's own hit, planned ""): asked of the two lists in C, not of each page (cold after the copy)
        rerouted, found = 0, handle.tiers if handle is not None else []
        if found and (found.count(found[0]) < len(found) or job.tiers.count(found[0]) + job.tiers.count("") < len(job.tiers)):
            chunks = list(map(CHUNK_OF, pages if whole else pages[:delivered]))
            if len(set(chunks)) == len(chunks):  # a page per chunk (a dense model): its tier against the plan's
                rerouted = sum(map(ne, found, map(job.tiers.__getitem__, chunks)))
            else:
                by_chunk: dict[int, list[str]] = {}
                for chunk, tier in zip(chunks, found):
                    by_chunk.setdefault(chunk, []).append(tier)
                rerouted = sum(1 for c, t in by_chunk.items() if (t[0] if len(t) == 1 else slowest(t)) != job.tiers[c])
        engine = EngineLoad(tokens=tokens_by_tier(job.tiers, job.first_token, end, self.chunk_tokens),
                            unfilled_tokens=tokens_by_tier(job.tiers, end, job.hit_tokens, self.chunk_tokens)
                            if end < job.hit_tokens else {}, resumed=job.resumed,
                            failed_blocks=sum(len(p.block_ids) for p in unfilled_pages) if unfilled_pages else 0,
                            rerouted_chunks=rerouted,
                            engine_bytes=moved_bytes(self.copiers, pages if whole else pages[:delivered]) if ok else 0,
                            seconds=seconds)
        if handle is None:
            self.store.load_skipped(engine, job_context(job))
        elif ok and end > job.first_token:
            self.store.complete_load(handle, True, engine=engine)
        elif ok:
            self.store.cancel_load(handle, engine=engine)
        else:
            self.store.complete_load(handle, False, engine=engine)
        if record is not None and not skipped:  # for the request's receipt (load_facts)
            self.facts.add(job.req_id, load_facts(job, record, engine, self.store.cpu.name, self.chunk_tokens,
                                                  budget_cut))
        if sync:
            return set(errors)
        out = self.outcomes
        with out.lock:
            out.errors.update(errors)  # errors first: they must not reach vLLM after the finish
            if failed_whole:
                out.failed.add(job.req_id)
            elif not skipped and end > job.first_token:  # checked against a reset when taken
                out.filled[job.req_id] = (epoch, None if not self.partial else tuple(
                    b for p in job.pages[:delivered] for b in p.block_ids))
            out.finished.add(job.req_id)
            out.version += 1
            out.inflight.pop(job.req_id, None)
            out.aborted.discard(job.req_id)
            out.ended.notify_all()
        return set()


def job_keys(job: LoadJob) -> list[ChunkKey]:
    """The job's page keys (``ChunkKey`` is ``bytes`` by type only: no call per page, nor ``typing.cast``'s)."""
    return list(map(KEY_OF, job.pages))


def job_context(job: LoadJob, record: RequestRecord | None = None) -> OpContext:
    """The load's context: its request's id and tenant, and ``record`` as its sink (the handle
    carries it to ``complete_load``)."""
    return OpContext(job.req_id, job.tenant) if record is None else OpContext(job.req_id, job.tenant, record)


def moved_bytes(copiers: GroupCopiers, pages: Sequence[PageMove]) -> int:
    """Engine bytes the pages cover (all layers of their groups): a load's, and a save's (:mod:`~.saves`)."""
    if len(copiers.block_bytes) == 1:  # one group (a dense model): in C, no generator frame per page
        (block_bytes,) = copiers.block_bytes.values()
        return block_bytes * sum(map(len, map(BLOCK_IDS_OF, pages)))
    return sum(len(p.block_ids) * copiers.block_bytes[p.group] for p in pages)


def load_pages(copiers: GroupCopiers, moves: Sequence[tuple[PageMove, np.ndarray]], hold_gil: bool = False) -> None:
    """Copy each ``(page, buffer)`` of ``moves`` into the page's engine blocks, every layer of its group
    (``buffer``: uint8, its group's page of ``copiers.group_page_bytes`` in front); returns when they are
    there.  Host caches of a few runs a block: :func:`load_runs` (``hold_gil``: one group, on the engine's
    thread); CUDA and strided layouts: ``BlockCopier.load``.

    Raises:
        ValueError: a page's slots or block ids out of range (:func:`load_runs`: nothing copied).
    """
    if len(copiers.copiers) == 1:  # one group (a dense model): no regrouping, no span objects
        (copier,) = copiers.copiers.values()
        if copier.runs is not None:  # (one group: its page is the whole buffer, no front slice to take)
            load_runs(copier, [(buffer, page.first_slot, page.block_ids) for page, buffer in moves], hold_gil)
            return
    for group, spans in copiers.spans(moves).items():
        one = copiers.copiers[group]
        if one.runs is not None:
            load_runs(one, [(span.page, span.first_slot, span.block_ids) for span in spans])
        else:
            one.load(spans)


def load_runs(copier: BlockCopier, spans: Sequence[tuple[np.ndarray, int, Sequence[int]]],
              hold_gil: bool = False) -> None:
    """Copy each span's page slots into its blocks of every layer of ``copier`` (host caches: one
    ``memmove`` per run of ``copier.runs``; ``hold_gil``, the engine's thread: a slice assignment of flat
    memoryviews): ``(page, first slot, block ids)`` per span.  Every span is checked (block ids in range,
    slots within the page, pages contiguous and long enough) before the first byte moves; the addresses
    are Python ints, computed in the loop that moves the runs (numpy's set-up of small arrays costs more).

    Raises:
        ValueError: a span out of range (nothing copied).
    """
    runs = copier.runs
    assert runs is not None
    views = runs.layer_views if hold_gil else None
    bpc, block_bytes, layers = copier.blocks_per_chunk, copier.layout.block_bytes, len(runs.layer_list)
    slot_bytes = bpc * block_bytes
    page_bytes = layers * slot_bytes
    todo: list[tuple[Any, int, Sequence[int]]] = []  # (the page's address or flat view, first slot, block ids)
    blocks: list[int] = []
    for page, first_slot, block_ids in spans:
        n = len(block_ids)
        if not n:
            continue
        if not page.flags.c_contiguous or page.nbytes < page_bytes or first_slot < 0 or first_slot + n > bpc:
            raise ValueError(f"span of {n} blocks at slot {first_slot} does not fit a contiguous page of "
                             f"{page_bytes} bytes ({page.nbytes} given, {bpc} slots)")
        todo.append((memoryview(page).cast("B") if views is not None else _address(page), first_slot, block_ids))  # type: ignore[arg-type]
        blocks += block_ids
    if not blocks:
        return
    if min(blocks) < 0 or max(blocks) >= runs.num_blocks:
        raise ValueError(f"block ids must lie in [0, {runs.num_blocks}), got {blocks}")
    if runs.run_bytes == block_bytes == runs.block_stride:  # a block is one run, the next follows (vLLM's CPU)
        _load_adjacent(todo, views, runs.layer_list, block_bytes, slot_bytes)
    else:
        load_run_by_run(copier, todo, views)


def _load_adjacent(todo: list[tuple[Any, int, Sequence[int]]], views: list[memoryview] | None,
                   layer_addresses: list[int], block_bytes: int, slot_bytes: int) -> None:
    """:func:`load_runs` where a block of a layer is one run and block ``b + 1`` follows block ``b``:
    as slots ``s, s + 1`` of a page's layer do, so ``k`` consecutive block ids of a span are one run
    of ``k`` blocks per layer (a fresh request's blocks mostly are: about a block per chunk's
    worth of calls instead of one per block).  Runs of blocks in span order, each layer by layer."""
    for page, first_slot, block_ids in todo:
        j, count = 0, len(block_ids)
        while j < count:
            first, k = block_ids[j], 1
            while j + k < count and block_ids[j + k] == first + k:
                k += 1
            src, dst, size = (first_slot + j) * block_bytes, first * block_bytes, k * block_bytes
            if views is not None:  # the engine's thread: slice assignments of flat memoryviews (no ctypes call)
                for view in views:
                    view[dst:dst + size] = page[src:src + size]
                    src += slot_bytes
            else:
                for layer_address in layer_addresses:
                    _memmove(layer_address + dst, page + src, size)
                    src += slot_bytes
            j += k


def _address(page: np.ndarray) -> int:
    """The first byte of a writable C-contiguous ``page``: ctypes' view of its buffer, a third of
    ``ndarray.ctypes.data``'s time warm (no Python frames); a read-only one through ``ndarray.ctypes``."""
    try:  # (an ndarray is a buffer; numpy's stubs do not say so)
        return ctypes.addressof(_BYTE.from_buffer(page))  # type: ignore[arg-type]
    except (TypeError, ValueError):  # read-only (or empty: the caller checked its length)
        return int(page.ctypes.data)


_BYTE = ctypes.c_ubyte
_memmove = ctypes.memmove


def tokens_by_tier(tiers: Sequence[str], start: int, end: int, chunk_tokens: int) -> dict[str, int]:
    """Tokens ``[start, end)`` split by the tier of the chunk each lies in (``tiers[c]``: the tier
    planned for chunk ``c``).  A load's tokens by tier (the loaded-token counters), and on the scheduler
    side a receipt's tokens by tier and the hit sources for vLLM, all come from this one function, so
    they split alike; it lives here, vLLM-free, on the path of every load."""
    out: dict[str, int] = {}
    if end <= start:
        return out
    first, last = start // chunk_tokens, (end - 1) // chunk_tokens
    if last >= len(tiers):
        raise IndexError(f"chunk {last} has no planned tier ({len(tiers)} planned)")
    c = first
    for tier, run in groupby(tiers[first:last + 1]):  # runs of one tier: no Python work per chunk
        lo = max(start, c * chunk_tokens)
        c += len(list(run))
        out[tier] = out.get(tier, 0) + min(end, c * chunk_tokens) - lo
    return out


class FactsBook:
    """Facts of this rank's requests since the last :meth:`take` (thread-safe: loads end on loader threads)."""

    def __init__(self) -> None:  # (a save job's facts come here too: saves.py save_facts)
        self._lock = threading.Lock()
        self._facts: dict[str, RequestFacts] = {}
        self.version = 0  # bumped under the lock by each add: unchanged since a take(), take() has nothing

    def add(self, req_id: str, facts: RequestFacts) -> None:
        with self._lock:
            self.version += 1
            mine = self._facts.get(req_id)
            if mine is None:
                self._facts[req_id] = facts
            else:
                mine.merge(facts)

    def take(self) -> dict[str, RequestFacts]:
        with self._lock:
            out, self._facts = self._facts, {}
        return out


def _token(pages: Sequence[PageMove], index: int, chunk_tokens: int) -> int:
    """The first token of page ``index``'s chunk (past the end: the last page's end)."""
    if index < len(pages):
        return pages[index].chunk * chunk_tokens
    return (pages[-1].chunk + 1) * chunk_tokens if pages else 0


def load_facts(job: LoadJob, record: RequestRecord, engine: EngineLoad, top: str, chunk_tokens: int,
               budget_cut: int | None) -> RequestFacts:
    """One load's facts: unfilled tokens by planned tier, seconds by tier, the first token it came
    up short at and why, the first token read from below the top tier and why.

    ``budget_cut``: the page at which the copy stopped waiting (``load_wait_s`` passed), else
    ``None``; a cut there is ``budget`` unless a read failed earlier.  The load's wall time
    (``engine.seconds``) is split: each lower tier gets its reads' seconds, the rest goes to the
    tiers in proportion to the tokens each delivered."""
    # (each comprehension runs only when it has something to go through: a cold frame per hit otherwise)
    delivered = dict(engine.tokens) if all(engine.tokens.values()) else {t: n for t, n in engine.tokens.items() if n}
    read_s = {t: s for t, s in record.read_seconds.items() if t in delivered or t in engine.unfilled_tokens} \
        if record.read_seconds else {}
    rest = max(engine.seconds - sum(read_s.values()), 0.0)
    total = sum(delivered.values())
    load_s = dict(read_s)
    for tier, n in delivered.items():
        load_s[tier] = load_s.get(tier, 0.0) + (rest * n / total if total else 0.0)
    miss = None
    if any(engine.unfilled_tokens.values()):
        m = record.miss
        if m is not None and (budget_cut is None or m.index <= budget_cut):
            miss = (_token(job.pages, m.index, chunk_tokens), m.reason, m.tier)
        elif budget_cut is not None:
            miss = (_token(job.pages, budget_cut, chunk_tokens), "budget", "")
        else:
            miss = (max(job.first_token, _token(job.pages, 0, chunk_tokens)), "load_failed", "")
    below = record.below
    return RequestFacts(unfilled={t: n for t, n in engine.unfilled_tokens.items() if n} if engine.unfilled_tokens
                        else {}, load_s=load_s, miss=miss,
                        below=(_token(job.pages, below.index, chunk_tokens), below.reason, top)
                        if below is not None else None)
