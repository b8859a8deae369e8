"""``WorkerSide``: the worker-side connector of one tensor-parallel rank, as vLLM's model runner
calls it (the contract, per call, is the package's docstring: :mod:`kvtier.integrations.vllm.worker`),
and ``AsyncLoader``, its end of the asynchronous loads (the loader threads' is :mod:`.loader`): what
the engine's thread does each step.  Resets and the graceful stop are :mod:`.lifecycle`'s."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvtier.core.config import KVTierConfig
from kvtier.core.context import EngineLoad
from kvtier.core.stats import StoreStats
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.cache_groups import GroupKind, GroupSpec, groups_from_kv_cache_config
from kvtier.integrations.vllm.protocol import (
    KVTierMetadata,
    KVTierWorkerMeta,
    LoadJob,
    RankReport,
    RequestFacts,
)
from kvtier.integrations.vllm.worker.copy import GroupCopiers
from kvtier.integrations.vllm.worker.finisher import Finisher
from kvtier.integrations.vllm.worker.layerwise import LayerLoads
from kvtier.integrations.vllm.worker.layout import KVLayout
from kvtier.integrations.vllm.worker.lifecycle import clear_for_reset, stop_loads, stop_rank
from kvtier.integrations.vllm.worker.loader import LoadPath, job_keys
from kvtier.integrations.vllm.worker.registration import Registered, key_root, rank_name, register, tp_rank
from kvtier.integrations.vllm.worker.saves import SaveQueue, save_jobs
from kvtier.integrations.vllm.worker.syncload import load_layers, load_now

log = logging.getLogger(__name__)

MAX_INDEX_CHANGES = 4096  # index changes per rank per step sent to the scheduler (a snapshot goes whole)
BLOCKS_BACK_WAIT_S = 10.0  # longest a preemption or a reset waits for deferred saves of blocks given back


class WorkerSide:
    """Per-rank state of the worker-side connector.

    Args:
        vllm_config, kv_cache_config: vLLM's configs.
        config: the engine's kvtier configuration
            (:func:`~kvtier.integrations.vllm.engine_config.engine_config`: ``chunk_tokens`` resolved).

    Raises:
        ConfigError: a KV cache group kind kvtier does not store.
        TypeError: ``config.chunk_tokens`` is still ``"auto"``.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: KVTierConfig) -> None:
        self._init(config, vllm_config.parallel_config.tensor_parallel_size, tp_rank(),
                   groups_from_kv_cache_config(kv_cache_config))
        self.rank_name = rank_name(vllm_config.parallel_config, self.tp_rank)  # log lines: + a data-parallel rank
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config

    @classmethod
    def over(cls, config: KVTierConfig, groups: tuple[GroupSpec, ...], parts: Registered) -> WorkerSide:
        """A rank-0 worker side over parts built without vLLM's configs (``scripts/gpu_check.py --mode
        runner`` drives it as vLLM's GPU model runner would, where vLLM is not installed)."""
        side = cls.__new__(cls)
        side._init(config, 1, 0, groups)
        side.vllm_config = side.kv_cache_config = None
        side._attach(parts)
        return side

    def _init(self, config: KVTierConfig, tp_size: int, rank: int, groups: tuple[GroupSpec, ...]) -> None:
        if not isinstance(config.chunk_tokens, int):
            raise TypeError("WorkerSide needs the engine's config (chunk_tokens resolved): engine_config()")
        self.config = config
        self.chunk_tokens: int = config.chunk_tokens
        self.tp_size = tp_size
        self.tp_rank = rank
        self.rank_name = f"rank {rank}"
        self.store: TieredStore | None = None
        self.loader: AsyncLoader | None = None
        self.layout: KVLayout | None = None
        self.key_root = b""
        self.namespace = b""
        self._store_seen: StoreStats | None = None
        self._saver_seen: dict[str, float] = {}  # the saver's totals at the last stats() call
        # SaveQueue.version at the last read of its counts (stats) and of its ended jobs (worker_meta); -1: never
        self._saver_version = self._ended_version = -1
        # Outcomes.version at the last take of its outcomes, FactsBook.version at the last take of its facts
        self._loads_version = self._facts_version = 0
        self._saver_busy = False  # deferred saves in flight at that read
        self._gate_open = False  # this side opened the store's eviction gate (start_load) and has not closed it since
        self._busy = False  # chunks pinned at the last stats() (loads or disk writes in flight)
        self._busy_reported: bool | None = None  # busy as last told to the scheduler
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        # this step's synchronous loads that came up short: req -> first chunk not filled
        self._sync_cut: dict[str, int] = {}
        self._no_forward = False  # this step computes no tokens: finished_loads may wait (idle_step_wait_s)
        self._closed = False
        self.reset_epoch = 0  # the last reset order applied (RankReport.epoch)
        self.kv_groups = groups
        self.layer_loads: LayerLoads | None = None  # layerwise_loads on a dense model
        # saved tokens are counted on one group's pages: the first full-attention group (none: not counted)
        self._token_group = next((g.index for g in self.kv_groups if g.kind is GroupKind.FULL), -1)
        self.groups: GroupCopiers | None = None
        self.saver: SaveQueue | None = None  # deferred saves (SaveJob.deferred): the saver thread
        self._held: set[str] = set()  # held by the scheduler (KVTierMetadata.held): finished_sending once saved
        self.finisher = Finisher()  # a synchronous load's bookkeeping, while the forward runs (joined before reports)

    # ---- setup -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build this rank's store and loader over vLLM's caches (:func:`~.registration.register`)."""
        self._attach(register(self.vllm_config, self.kv_cache_config, self.config, self.kv_groups, kv_caches,
                              self.tp_size, self.tp_rank))

    def _attach(self, done: Registered) -> None:
        self.layout, self.groups, self.store = done.layout, done.copiers, done.store
        self.loader = AsyncLoader(done.load_path, self.config.io_threads)
        self.saver = SaveQueue(self.store, self.groups, self._token_group, self.chunk_tokens)
        if self.config.layerwise_loads and len(self.kv_groups) == 1 and self.kv_groups[0].kind is GroupKind.FULL:
            self.layer_loads = LayerLoads(self.groups, self.kv_groups[0].index)  # on the engine's thread
        self.key_root = key_root(done.namespace)
        self.namespace = done.namespace.digest()  # reported to the scheduler, which asks the shared tier under it

    # ---- loads -------------------------------------------------------------------------------
    def start_load(self, meta: KVTierMetadata) -> None:
        """This step's reset order, then its loads: asynchronous ones handed to the loader threads
        (their cpu-tier pages pinned here first), synchronous ones (``LoadJob.sync``) copied here,
        before the forward; their unfilled blocks are this step's load errors and their requests'
        saves this step stop at the first chunk not filled (KV computed over a block that was not
        loaded is wrong).  Then the eviction gate opens: it was closed at the last
        :meth:`worker_meta`, whose index changes the scheduler planned these loads from, so no
        page they were planned from left in between (:mod:`kvtier.core.gate`)."""
        assert self.loader is not None and self.store is not None
        self._sync_cut = {}
        self._no_forward = meta.no_forward
        self._held |= meta.held
        self._bookkept()  # (joined at the last step's report: nothing waits unless it was skipped)
        if meta.reset is not None:
            if self.saver is not None:  # nothing saved before the order is published after it
                self.saver.wait_for(None, BLOCKS_BACK_WAIT_S)
            clear_for_reset(self.store, meta.reset, self.rank_name)  # (the module docstring)
            self.reset_epoch = meta.reset.epoch
        if self.layer_loads is not None:
            self.layer_loads.poll()
        for job in meta.loads:
            if job.sync:  # layer by layer: a hit held in the cpu tier alone (a node hit loads whole)
                errors, first_unfilled = load_now(self.loader.path, job, self.finisher) if self.layer_loads is None \
                    or not all(job.tiers[p.chunk] == self.store.cpu.name for p in job.pages) \
                    else load_layers(self.loader.path, job, self.layer_loads)
                self._errors |= errors
                if first_unfilled is not None:
                    self._sync_cut[job.req_id] = first_unfilled
            else:
                self.loader.submit(job)
        self.store.gate_evictions(False)  # this step's plans are pinned: pages may leave until the drain
        self._gate_open = True  # (this side is the only one to move the gate of its store)

    def _bookkept(self) -> None:
        """Wait for the synchronous loads' bookkeeping handed to :attr:`finisher` (none pending: no call
        into it, so a step without such a load runs nothing of finisher.py)."""
        if self.finisher.pending:
            self.finisher.join()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """``layerwise_loads``: the engine's current stream waits for this step's copies of that layer
        only (:mod:`~.layerwise`); otherwise nothing (loads are whole when ``start_load`` returns)."""
        if self.layer_loads is not None:
            self.layer_loads.wait_layer(layer_name)

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        """vLLM freed the blocks of ``meta.preempted`` before this step's forward: wait (at most
        :data:`BLOCKS_BACK_WAIT_S`; then voided) for their deferred saves, which read those blocks."""
        if self.saver is not None and any(self.saver.pending(r) for r in meta.preempted):
            self.saver.wait_for(meta.preempted, BLOCKS_BACK_WAIT_S)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """vLLM's ``get_finished``: (:meth:`finished_saves`, :meth:`finished_loads`), in one call."""
        return self.finished_saves(), self.finished_loads(finished_req_ids)

    def transfers(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """vLLM's ``get_transfer_results``: :meth:`finished`, then :meth:`take_failed`."""
        sending, recving = self.finished(finished_req_ids)
        return sending, recving, self.take_failed()

    def finished_saves(self) -> set[str]:
        """vLLM's ``finished_sending``: requests the scheduler held (``KVTierMetadata.held``: finished
        with a deferred save running) whose saves have all ended on this rank."""
        if self.saver is None:
            done, self._held = self._held, set()
            return done
        done = {r for r in self._held if not self.saver.pending(r)}
        self._held -= done
        return done

    def finished_loads(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose load ended (either way) since the last call; ``finished_req_ids``
        (requests vLLM finished) lets loads not started yet be skipped.

        In a step that computes no tokens (the last :meth:`start_load`'s ``meta.no_forward``) with a
        load in flight, it first blocks until a load ends or ``idle_step_wait_s`` passes (every rank
        the same bound at most), and a load that ended meanwhile is in this call's answer: vLLM
        would otherwise run the next empty step at once, spinning the engine's thread against the
        loader threads.  A step that computes tokens never waits."""
        if self.loader is None:
            return set()
        if finished_req_ids:
            self.loader.abort(finished_req_ids)
        no_forward, self._no_forward = self._no_forward, False  # one wait per step at most
        if no_forward and self.config.idle_step_wait_s > 0:
            if not self._held or self.saver is None or self.loader.num_inflight:  # (no held block: asks no count)
                self.loader.wait_ended(self.config.idle_step_wait_s)
            else:  # only held blocks wait: for their saves, so that the step does not spin
                self.saver.wait_any(self._held, self.config.idle_step_wait_s)
        if self.loader.outcomes.version == self._loads_version:  # (no load ended since the last take: nothing to take)
            return set()
        self._loads_version = self.loader.outcomes.version
        finished, errors, failed = self.loader.take()
        self._errors |= errors
        self._failed |= failed
        return finished

    def take_failed(self) -> set[str]:
        """Requests whose load failed whole (several KV cache groups: vLLM recomputes them from the start)."""
        failed, self._failed = self._failed, set()
        return failed

    def take_errors(self) -> set[int]:
        """Blocks of ended loads that could not be filled (vLLM recomputes from the first one)."""
        errors, self._errors = self._errors, set()
        return errors

    # ---- saves -------------------------------------------------------------------------------
    def save(self, meta: KVTierMetadata) -> None:
        """This step's save jobs, after the forward pass (:func:`~.saves.save_jobs`).  Saves may evict,
        so the eviction gate is open here: it already is when vLLM saves between ``start_load`` and
        ``worker_meta`` (0.32); a runner that saves after ``worker_meta`` (0.33's Model Runner V2 with a
        speculator, ``finalize_step``) opens it for the saves and closes it again: they are not
        dropped for want of a page, and a page they evict may have been planned (the race of
        :mod:`kvtier.core.gate`, left to that runner's saves)."""
        assert self.store is not None and self.groups is not None
        if not meta.saves and self._gate_open:  # (nothing to save, and the gate already open: nothing to do)
            return
        self._bookkept()  # this step's loads unpinned first: their pins never hold back a save
        late = not self._gate_open and self.store.gate_evictions(False)
        try:
            save_jobs(self.store, self.groups, meta.saves, self._sync_cut, self._token_group, self.chunk_tokens,
                      self.saver, self.loader.facts if self.loader is not None else None)
        finally:
            if late:
                self.store.gate_evictions(True)

    # ---- worker -> scheduler -----------------------------------------------------------------
    def worker_meta(self) -> KVTierWorkerMeta | None:
        """This rank's index changes since the last step (the first one is a full snapshot).  The
        eviction gate closes first: what the scheduler plans from these changes stays put until
        the next :meth:`start_load` has pinned it."""
        if self.store is None:
            return None
        self._bookkept()  # this step's synchronous loads counted, unpinned, their facts kept
        self.store.gate_evictions(True)  # nothing leaves until the loads planned from this drain are pinned
        self._gate_open = False
        delta = self.store.drain_changes(MAX_INDEX_CHANGES)
        facts: dict[str, RequestFacts] = {}  # for the requests' receipts (none added since the last take: none)
        if self.loader is not None and self.loader.facts.version != self._facts_version:
            self._facts_version = self.loader.facts.version
            facts = self.loader.facts.take()
        ended: tuple[int, ...] = ()
        if self.saver is not None and self.saver.version != self._ended_version:  # (else none ended since)
            self._ended_version = self.saver.version
            ended = self.saver.take_ended()
        if not delta.changes and not delta.full and self._busy == self._busy_reported and not facts and not ended:
            return None
        self._busy_reported = self._busy
        report = RankReport(self.key_root, [(bytes(key), tier) for key, tier in delta.changes], delta.full,
                            self.namespace, busy=self._busy, epoch=self.reset_epoch, facts=facts, saves_ended=ended)
        return KVTierWorkerMeta({self.tp_rank: report})

    # ---- metrics and lifecycle ---------------------------------------------------------------
    def stats(self) -> tuple[StoreStats, StoreStats | None, dict[str, float], list[tuple[str, int]]] | None:
        """This step's numbers for vLLM's stats (``None`` before the caches are registered): the store's
        snapshot, the one of the last call (``None``: none yet), the change of the deferred saves'
        counters since the last call, and the ghost hits' ``(tier, distance bytes)`` since then.  vLLM-free:
        the connector makes them its payload each step
        (:func:`~kvtier.integrations.vllm.connector.worker_stats`)."""
        if self.store is None:
            return None
        self._bookkept()
        snapshot, before = self.store.stats(), self._store_seen
        self._store_seen = snapshot
        counters: dict[str, float] = {}
        if self.saver is not None and self.saver.version != self._saver_version:  # (unchanged: nothing to ask)
            self._saver_version = self.saver.version  # the deferred saves' waits, drops and voids since the last step
            totals = self.saver.counts()
            counters = {k: v - self._saver_seen.get(k, 0) for k, v in totals.items() if v != self._saver_seen.get(k, 0)}
            self._saver_seen = totals
            self._saver_busy = bool(self.saver.in_flight)
        self._busy = snapshot.queued_writes > 0 or any(t.pinned_chunks for t in snapshot.tiers.values()) \
            or self._saver_busy
        return snapshot, before, counters, self.store.take_ghost_distances()

    def shutdown(self) -> None:
        """Stop loading, flush dirty chunks to disk within ``shutdown_flush_s``, stop the store.  Idempotent."""
        if self._closed or self.store is None:
            return
        self._closed = True
        self.finisher.close()
        if self.loader is not None:
            self.loader.shutdown()
        stop_rank(self.store, self.layer_loads, self.saver, self.config, self.rank_name)

class AsyncLoader:
    """The engine thread's end of the asynchronous loads: hands each :class:`LoadJob` to a bounded
    pool of loader threads (:meth:`LoadPath.run <kvtier.integrations.vllm.worker.loader.LoadPath.run>`)
    and takes their :class:`~kvtier.integrations.vllm.worker.outcomes.Outcomes`.

    Args:
        path: one load's path (the store, the copiers, ...), run on the loader threads.
        threads: loader threads (> 0).
    """

    def __init__(self, path: LoadPath, threads: int) -> None:
        self.path = path
        self.store = path.store
        self.outcomes = path.outcomes
        self.facts = path.facts  # what loads (and the worker's saves) learned, for the requests' receipts
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-load")

    def submit(self, job: LoadJob) -> None:
        """Start ``job`` in the background (never blocks).  Its pages the cpu tier holds are pinned
        here, on the caller's (engine) thread, so that they are still there when a loader thread
        prepares the load (released once the job is over, or cancelled)."""
        held = self.store.pin_resident(job_keys(job))
        out = self.outcomes
        try:
            with out.lock:
                out.aborted.discard(job.req_id)
                future = self._pool.submit(self.path.run, job)
                out.inflight[job.req_id] = future
        except BaseException:  # shut down: nothing will run
            self.store.cancel_load(held)
            raise
        if held.pinned:  # (none resident, nothing pinned: nothing to release)
            future.add_done_callback(lambda _: self.store.cancel_load(held))

    def abort(self, req_ids: set[str]) -> None:
        """Requests vLLM finished (aborted): their loads not started yet are skipped (their tokens counted
        as unfilled) and reported as finished (vLLM waits for that report before it frees the blocks;
        vllm/v1/core/sched/scheduler.py ``finish_requests``).  Jobs in flight are bounded by the engine's
        KV cache (each holds its request's blocks until reported)."""
        out = self.outcomes
        with out.lock:
            out.aborted.update(r for r in req_ids if r in out.inflight)

    def take(self) -> tuple[set[str], set[int], set[str]]:
        """Since the last call: requests whose load ended, the blocks that could not be filled
        (one group), and the requests whose load failed whole (several groups; also in the first set).

        A load that started before a reset (the store's :attr:`~kvtier.core.store.TieredStore.epoch`
        changed) is failed here, after the worker applied the order: its blocks are load errors (with
        several KV cache groups, the request failed), so nothing read before the reset reaches a request after it."""
        out = self.outcomes
        with out.lock:
            finished, errors, failed = out.finished, out.errors, out.failed
            out.finished, out.errors, out.failed = set(), set(), set()
            stale = 0
            epoch = self.store.epoch if out.filled else 0  # (nothing filled: no reset to check)
            for req_id, (started, filled) in out.filled.items():
                if started == epoch:
                    continue  # no reset since the load began
                if filled is None:
                    failed.add(req_id)
                else:
                    errors.update(filled)
                    stale += len(filled)
            out.filled.clear()
        if stale:  # filled before a reset, recomputed after it: counted as blocks not filled
            self.store.load_skipped(EngineLoad(failed_blocks=stale))
        return finished, errors, failed

    def wait_ended(self, timeout_s: float) -> bool:
        """Block until a load has ended that :meth:`take` has not returned yet (True) or ``timeout_s``
        seconds passed (False); True at once when one has already ended or none is in flight (a job
        queued behind busy loader threads counts as in flight).  A condition the loader threads notify
        (never a sleep loop): the engine's thread neither spins nor holds the GIL they need."""
        out = self.outcomes
        with out.ended:
            return out.ended.wait_for(lambda: bool(out.finished) or not out.inflight, max(timeout_s, 0.0))

    @property
    def num_inflight(self) -> int:
        with self.outcomes.lock:
            return len(self.outcomes.inflight)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Cancel jobs not started, wait up to ``timeout_s`` for running ones (:func:`~.lifecycle.stop_loads`)."""
        stop_loads(self._pool, self.outcomes, timeout_s)
