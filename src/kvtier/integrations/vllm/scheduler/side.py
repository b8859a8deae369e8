"""``SchedulerSide``: the scheduler-side connector vLLM's scheduler calls, step by step (the
contract, per call, is the package's docstring: :mod:`kvtier.integrations.vllm.scheduler`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from kvtier.core.config import KVTierConfig
from kvtier.core.receipt import ReceiptSink
from kvtier.core.receiptsinks import build_receipt_sinks
from kvtier.core.tiers.registry import local_tiers
from kvtier.integrations.vllm.cache_groups import GroupKind
from kvtier.integrations.vllm.protocol import KVTierMetadata, KVTierWorkerMeta, LoadJob, SaveJob
from kvtier.integrations.vllm.scheduler.eventfeed import event_tracker, observe_reports
from kvtier.integrations.vllm.scheduler.pages import handoffs_of
from kvtier.integrations.vllm.scheduler.pins import PIN_PARAM, pin_seconds
from kvtier.integrations.vllm.scheduler.remote import RemoteLookups, shared_tier_configured, unheld_pages
from kvtier.integrations.vllm.scheduler.requests import ReceiptDesk, ReceiptFacts, RequestState
from kvtier.integrations.vllm.scheduler.reset import Resets
from kvtier.integrations.vllm.scheduler.setup import checked_plan, settings_gauges, shut_down, sync_settings
from kvtier.integrations.vllm.scheduler.steps import (
    DeferredSaves,
    IndexMirror,
    KeyMemo,
    PagePlanner,
    Settle,
    begin_step,
    fold_reports,
)
from kvtier.integrations.vllm.worker.loader import tokens_by_tier

log = logging.getLogger(__name__)

READY_WAIT_S = 60.0  # how long admissions wait for the workers' first index snapshot, at most


class SyncBudget:
    """This step's bytes for synchronous loads, promised to the requests answered ``(n, False)``
    (design: docs/scheduler.md § Synchronous loads; built by :mod:`~kvtier.integrations.vllm.scheduler.setup`).

    Args:
        step_bytes: ``sync_load_max_bytes`` (0: synchronous loads off).
        bytes_per_token: KV bytes one token takes in one rank's engine cache (``setup.bytes_per_token``).
        tiers: the tiers a synchronous load reads (``setup.sync_tiers``; a chunk elsewhere loads asynchronously).
        chunk_tokens: tokens per chunk.
    """

    def __init__(self, step_bytes: int, bytes_per_token: int, tiers: frozenset[str], chunk_tokens: int) -> None:
        self.step_bytes = step_bytes
        self.bytes_per_token = bytes_per_token
        self.tiers = tiers
        self.chunk_tokens = chunk_tokens
        self.left_bytes = step_bytes  # this step's budget not yet promised
        self.promised: dict[str, int] = {}
        """Requests answered ``(n, False)`` this step -> bytes promised (empty: nothing to give back or take)."""

    def offer(self, req_id: str, tiers: list[str], num_computed_tokens: int, hit: int) -> bool:
        """Promise the load of tokens ``[num_computed_tokens, hit)`` to ``req_id`` in this step when
        every chunk to load is in :attr:`tiers` (by the plan) and its copy fits what is left."""
        if not self.step_bytes:
            return False
        need = (hit - num_computed_tokens) * self.bytes_per_token
        if need > self.left_bytes:
            return False
        first = num_computed_tokens // self.chunk_tokens  # every chunk from there in a tier read synchronously
        if not self.tiers.issuperset(tiers[first:]):
            return False
        self.left_bytes -= need
        self.promised[req_id] = need
        return True

    def give_back(self, req_id: str) -> bool:
        """Take back ``req_id``'s promise (asked again, not allocated, or finished); whether it had one."""
        promised = self.promised.pop(req_id, None)
        if promised is None:
            return False
        self.left_bytes += promised
        return True

    def taken(self, req_id: str) -> bool:
        """``req_id``'s load job was built: whether it was promised this step (a synchronous load)."""
        return self.promised.pop(req_id, None) is not None

    def new_step(self) -> None:
        """The next step's budget, whole."""
        self.left_bytes = self.step_bytes
        self.promised.clear()


class SchedulerSide:
    """Scheduler-side state of the connector.

    Args:
        vllm_config, kv_cache_config: vLLM's configs.
        config: the engine's kvtier configuration
            (:func:`~kvtier.integrations.vllm.engine_config.engine_config`: ``chunk_tokens`` resolved).
        load, save: whether this role loads (``kv_both``, ``kv_consumer``) and saves
            (``kv_both``, ``kv_producer``).

    Raises:
        ConfigError, TypeError: what :func:`~kvtier.integrations.vllm.scheduler.setup.checked_plan` raises
            (settings kvtier cannot serve, ``chunk_tokens`` still ``"auto"``).
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: KVTierConfig, load: bool, save: bool) -> None:
        self.block_size = int(vllm_config.cache_config.block_size)
        plan = checked_plan(vllm_config, kv_cache_config, config)  # the errors above
        self.config = config
        self.chunk_tokens = int(config.chunk_tokens)
        self.load_enabled, self.save_enabled = load, save
        self.mirror = IndexMirror(int(vllm_config.parallel_config.tensor_parallel_size))
        self.pages = PagePlanner(plan, self.mirror)  # a dense model is a one-group plan
        # deferred saves (async_saves): full-attention pages only (a window's or state's blocks change)
        self._deferrable = {g.index for g in plan.groups if g.kind is GroupKind.FULL} if config.async_saves else set()
        self.deferred = DeferredSaves(int(vllm_config.parallel_config.tensor_parallel_size))
        self.sync = SyncBudget(*sync_settings(config, kv_cache_config, plan, load))
        self.requests: dict[str, RequestState] = {}  # every request between admission and request_finished
        self.key_memo = KeyMemo.of_engine(vllm_config, kv_cache_config, self.chunk_tokens)  # chunk keys found again
        self._local_tiers = frozenset(local_tiers())  # (the registry is read here, never on the hit path)
        self._loads: list[LoadJob] = []
        self._kv_cache_manager: Any = None
        self._waiting_since: float | None = None
        # idle longer than a disk rescan: a lookup asks again once, for the workers' news (docs/purge.md)
        self._refresh_after_s = float(config.disk_rescan_s or 0.0) if config.disk_path else 0.0
        self._last_report_s = time.monotonic()
        self.remote = RemoteLookups(config) if load and shared_tier_configured(config) else None
        self.events = event_tracker(vllm_config, kv_cache_config, plan, config, self.mirror, load)
        # keeps an idle engine stepping until the workers' gauges are true (and the events are out and counted)
        self.settle = Settle(more=self.events.wants_step if self.events is not None else None)
        self.resets = Resets(config)
        self._settings_sent = False  # kv_events_enabled and the quota gauges go out with the first stats
        self.receipts = ReceiptDesk(self.chunk_tokens, self.mirror.tp_size, build_receipt_sinks(config))

    @property
    def receipt_sinks(self) -> list[ReceiptSink]:
        """Where every finished request's receipt (issue 35) goes besides its response: the receipt log,
        a tracer (:func:`~kvtier.core.receiptsinks.build_receipt_sinks` of the config; append to it)."""
        return self.receipts.sinks

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    def _chain(self, state: RequestState, num_chunks: int) -> list[bytes] | None:
        """Keys of the request's first ``num_chunks`` chunks; ``None`` if it cannot be keyed."""
        request = state.request
        if getattr(request, "prompt_embeds", None) is not None or self.mirror.key_root is None:
            return None  # prompt embeddings have no token ids to key on
        return state.keys(self.mirror.key_root, self.chunk_tokens, self.key_memo, num_chunks)

    # ---- admission ---------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        state = self.requests[request.request_id] = RequestState(request)
        params = getattr(request, "kv_transfer_params", None)
        if self.save_enabled and isinstance(params, dict) and PIN_PARAM in params:  # asks for a pin
            ttl_s, problem = pin_seconds(params, self.config.pin_max_s)
            if problem:
                log.warning("kvtier: request %s: %s", request.request_id, problem)
            if ttl_s > 0 and self.config.pin_max_share > 0:
                state.pin_s = ttl_s
            state.receipt.pin = (state.pin_s, problem)  # the receipt says what became of it

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        state = self.requests.get(req_id) or self.requests.setdefault(req_id, RequestState(request))
        state.planned_tiers = None
        receipt = state.receipt  # vLLM asks for the hit beyond its own num_computed_tokens: the receipt's ask, set here
        receipt.asked, receipt.shared_asked = num_computed_tokens, None
        if self.sync.promised:  # asked again in this step (not scheduled after the first answer)
            self.sync.give_back(req_id)
        # vLLM must compute at least the last prompt token itself (to sample from its logits).
        max_chunks = (request.num_tokens - 1) // self.chunk_tokens
        loadable = self.load_enabled and max_chunks * self.chunk_tokens > num_computed_tokens
        if not (ready := self.mirror.ready) and (loadable or (self.save_enabled and request.num_tokens >= self.chunk_tokens)):
            # The workers' first report (their index and the key root chunk keys hang from) comes
            # with the next step.  A producer waits too: keys for its saves need the root, and a
            # sliding-window page is gone from the engine by the step after its prefill.
            now = time.monotonic()
            self._waiting_since = self._waiting_since or now
            if not (self.mirror.broken or now - self._waiting_since > READY_WAIT_S):
                return None, False
        if not loadable or not ready:
            return 0, False
        if state.load_failed:
            return 0, False  # its load failed once: recompute rather than load again
        if (self._refresh_after_s and not state.refreshed
                and time.monotonic() - self._last_report_s > self._refresh_after_s):
            state.refreshed = True  # idle longer than a rescan: let one step bring the workers' news
            return None, False
        if getattr(request, "prompt_embeds", None) is not None or (root := self.mirror.key_root) is None:
            return 0, False  # (_chain, inlined: no frame) prompt embeddings have no token ids to key on
        chain = state.keys(root, self.chunk_tokens, self.key_memo, max_chunks)
        hit, tiers = self.pages.lookup(chain, num_computed_tokens, request.num_tokens)
        if self.remote is not None and hit < max_chunks * self.chunk_tokens and not self.remote.bind(
                self.mirror.namespaces):
            state.receipt.shared_asked = ("breaker_open", self.remote.tier_name)  # not ready: not asked
        elif self.remote is not None and hit < max_chunks * self.chunk_tokens:
            found = self.remote.poll_pages(req_id, unheld_pages(self.pages, chain, num_computed_tokens,
                                                                request.num_tokens))
            if found is None:
                return None, False  # the shared tier has not answered yet: ask again next step
            state.receipt.shared_asked = self.remote.outcome(req_id)
            if found:
                hit, tiers = self.pages.lookup(chain, num_computed_tokens, request.num_tokens, found,
                                                self.remote.tier_name)
        if hit <= num_computed_tokens:
            return 0, False
        state.planned_tiers = tiers
        if self.sync.offer(req_id, tiers, num_computed_tokens, hit):
            return hit - num_computed_tokens, False  # loaded in this step's start_load_kv, before the forward
        return hit - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        if self.remote is not None:
            self.remote.forget(req_id)
        state = self.requests.get(req_id)
        tiers = state.planned_tiers if state is not None else None
        if state is not None and state.receipt.asked is not None:  # (else a re-allocation: nothing to record)
            state.receipt.admitted(request, tiers, num_external_tokens, self.chunk_tokens, state.load_failed)
        if num_external_tokens <= 0 or tiers is None or state is None or state.chain is None:
            if state is not None:
                state.planned_tiers = None
            if self.sync.promised:
                self.sync.give_back(req_id)
            if num_external_tokens > 0:  # vLLM asked us to load what we never offered
                raise RuntimeError(f"kvtier: request {req_id} was allocated external tokens kvtier did not offer")
            return
        hit = len(tiers) * self.chunk_tokens
        local = hit - num_external_tokens
        pages = self.pages.load_pages(state.chain.keys, blocks.get_block_ids(), local, hit)
        if self.events is not None:  # a hit whose hashes were unknown (after a crash) is announced now
            for page in pages:
                self.events.record(request, page.key, page.group, page.chunk)
        resumed = getattr(request, "num_preemptions", 0) > 0
        sync = bool(self.sync.promised) and self.sync.taken(req_id)
        if self.pages.dense:  # its loaded chunks are held: no save job carries them again
            state.loaded(local // self.chunk_tokens, tiers, sync, self._local_tiers)
        self._loads.append(LoadJob(req_id, pages, local, hit, tuple(tiers), resumed, sync=sync, tenant=state.tenant))

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """``num_external_tokens`` by planned tier, split as the workers' loaded tokens (:func:`tokens_by_tier`)."""
        state = self.requests.get(request.request_id)
        tiers = (state.planned_tiers if state is not None else None) or []
        hit = len(tiers) * self.chunk_tokens
        return tokens_by_tier(tiers, hit - num_external_tokens, hit, self.chunk_tokens)

    # ---- per step ----------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        preempted = frozenset(getattr(scheduler_output, "preempted_req_ids", None) or ())
        # a request whose load is in flight is still in self.requests (vLLM finishes it after the load)
        held = begin_step(self.settle, self.deferred, preempted,
                          idle=not scheduler_output.num_scheduled_tokens and not self.requests)
        self.sync.new_step()
        meta = KVTierMetadata(loads=self._loads, reset=self.resets.take_order() if self.resets.order else None,
                              preempted=preempted, no_forward=scheduler_output.total_num_scheduled_tokens == 0,
                              held=held)
        self._loads = []
        for load in meta.loads:
            state = self.requests.get(load.req_id)
            if state is None:
                continue  # finished since its job was queued: vLLM frees its blocks, nothing to follow
            state.planned_tiers = None
            if load.sync:  # no finished_recving will come: its blocks are checked against this step's errors
                state.sync_pages, state.sync_outputs_left = tuple((p.chunk, p.block_ids) for p in load.pages), 2
            else:
                state.loading_blocks = frozenset(b for p in load.pages for b in p.block_ids)
        if self.save_enabled:
            for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
                save = self._save_job(req_id, num_scheduled, scheduler_output)
                if save is not None:
                    meta.saves.append(save)
        return meta

    def _save_job(self, req_id: str, num_scheduled: int, scheduler_output: Any) -> SaveJob | None:
        state = self.requests.get(req_id)
        if state is None:
            return None
        request = state.request
        # KV of tokens [0, computed + scheduled) exists once this step's forward pass is done.
        done = min(request.num_computed_tokens + num_scheduled, len(request.all_token_ids))
        end = done // self.chunk_tokens
        start = state.saved_chunks
        if end <= start:
            return None
        keys = self._chain(state, end)
        if keys is None:
            return None
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is not None:
            all_block_ids = block_state.resolve_block_ids(req_id)
        else:
            all_block_ids = self._kv_cache_manager.get_block_ids(req_id)
        state.saved_chunks = end
        pages = self.pages.save_pages(keys, start, end, all_block_ids, handoffs_of(scheduler_output, req_id),
                                       request.num_prompt_tokens)
        if self.events is not None:
            for page in pages:
                self.events.record(request, page.key, page.group, page.chunk)
        if not pages:
            return None
        # a TTL pin is applied after the copy: pinned requests save in the step, so their receipt knows it
        deferred = bool(self._deferrable) and not state.pin_s and all(p.group in self._deferrable for p in pages)
        return SaveJob(req_id, pages, self.pages.parent_of(keys, pages[0]), pin_s=state.pin_s,
                       pin_chunks=request.num_prompt_tokens // self.chunk_tokens, tenant=state.tenant,
                       explain_chunk=state.receipt.explain_in(start, end),
                       seq=self.deferred.ship(req_id) if deferred else -1,
                       touch_chunks=(state.receipt.engine or 0) // self.chunk_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        """Fold the ranks' index changes (vLLM's worker → scheduler metadata) into the mirror."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self._last_report_s = time.monotonic()
        fold_reports(meta, self.mirror, self.settle, self.deferred)
        if isinstance(meta, KVTierWorkerMeta):
            for rank in sorted(meta.ranks):
                for req_id, facts in meta.ranks[rank].facts.items():  # for the receipts
                    if (known := self.requests.get(req_id)) is not None:
                        known.receipt.observe(rank, facts)
                    else:
                        self.receipts.observe(req_id, rank, facts)
            if self.remote is not None:  # the shared tier set up (bind) once every rank named its namespace,
                self.remote.bind(self.mirror.namespaces)  # not at the first lookup: that one is answered now
            if self.events is not None:
                observe_reports(self.events, self.mirror, meta)
        invalid = getattr(connector_output, "invalid_block_ids", None) or set()
        failed = getattr(connector_output, "failed_recving", None) or set()
        finished = getattr(connector_output, "finished_recving", None) or set()
        for req_id, state in self.requests.items():
            if state.sync_outputs_left:
                state.check_sync_load(req_id, invalid)
            if state.loading_blocks is not None:
                state.receipt.waited_steps += 1
                bad = req_id in failed or not state.loading_blocks.isdisjoint(invalid)
                if bad and not state.load_failed:
                    log.info("kvtier: request %s: its load failed; it recomputes from there and is not "
                             "loaded again", req_id)
                state.load_failed = state.load_failed or bad
                if req_id in finished or req_id in failed:
                    state.loading_blocks = None
                    state.load_ended(ok=not bad)

    def take_events(self) -> list[Any]:
        """vLLM's ``take_events``: the KV events since the last step (:mod:`.events`); empty when vLLM publishes none."""
        return self.events.take_events() if self.events is not None else []

    # ---- end of a request --------------------------------------------------------------------
    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any]]:
        """Forget ``request``.  A load in flight still ends in ``finished_recving``; vLLM keeps the
        request's blocks until then (it delays freeing blocks of WAITING_FOR_REMOTE_KVS requests).

        Returns:
            held: True when a deferred save of the request may still read its blocks: vLLM keeps them
                until every rank names it in ``finished_sending`` (docs/scheduler.md § Deferred saves).
            receipt: its receipt's dict, empty until this step's worker facts are in: filled in place by
                :meth:`stats` in the same ``update_from_output`` (docs/scheduler.md § Receipts, When)."""
        req_id = request.request_id
        state = self.requests.pop(req_id, None)
        if self.sync.promised:
            self.sync.give_back(req_id)
        if self.remote is not None:
            self.remote.forget(req_id)
        held = state is not None and req_id in self.deferred.by_req and self.deferred.finish(req_id)
        return held, self.receipts.finished(request, state.receipt if state is not None else ReceiptFacts())

    # ---- reset ---------------------------------------------------------------------------------
    def reset_cache(self) -> bool:
        """vLLM's external prefix-cache reset (``/reset_prefix_cache?reset_external=true``):
        :meth:`.reset.Resets.run`; ``False`` when a tier could not be cleared."""
        for state in self.requests.values():
            state.planned_tiers = None
        self.settle.wake()  # an idle engine steps for the order and the router's removals
        return self.resets.run(self.mirror, self.events, self.remote)

    def stats(self) -> dict[str, Any] | None:
        """The scheduler's counters' change since the last call: resets (``kvtier_resets_total``,
        ``kvtier_reset_failures_total``) and, with a shared tier, its lookups and those in flight
        (``kvtier_shared_lookups_*``), as the stats payload's ``{"counters": ..., "gauges": ...}`` (the
        connector sends it as its ``KVTierStats``); ``None`` when nothing changed."""
        counters: dict[str, float] = dict(self.resets.take_counts()) if self.resets.counts else {}
        if self.receipts.pending or self.receipts.sinks:  # this step's finished requests' receipts, complete now
            counters |= self.receipts.finish()
        if self.events is not None:
            counters |= self.events.take_counters()
        gauges: dict[str, float] = {}
        if not self._settings_sent:  # what kvtier doctor shows: events on, quotas (sent once)
            self._settings_sent = True
            gauges |= settings_gauges(self.config, self.events is not None)
        if self.remote is not None:
            counters |= self.remote.take_counters()
            gauges |= self.remote.pending_gauge(bool(counters))
        if not counters and not gauges:
            return None
        return {"counters": counters, "gauges": gauges}

    def shutdown(self) -> None:
        """Emit the last receipts and close the receipt sinks, stop the shared-tier lookups and write
        the KV-event journal (idempotent): :func:`~kvtier.integrations.vllm.scheduler.setup.shut_down`."""
        shut_down(self.receipts, self.remote, self.events)
