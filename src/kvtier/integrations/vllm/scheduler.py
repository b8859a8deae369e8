"""Scheduler side of the connector: decides what each step loads and saves, from memory only.

Every model takes one path: a dense model is a one-group plan
(:class:`~kvtier.integrations.vllm.group_jobs.GroupJobs` over
:class:`~kvtier.integrations.vllm.groups.HybridPlan`), its pages are its chunks.  Per request::

    get_num_new_matched_tokens(req, local)   hash the prompt's full chunks (cached per request),
        look the pages up in the mirror of every rank's index -> hit = the largest chunk
        boundary every group can resume at (capped so ≥ 1 prompt token is computed), and the
        tier of each chunk (the slowest of its pages'); returns (hit - local, True): vLLM
        allocates the blocks and parks the request in WAITING_FOR_REMOTE_KVS.  A hit whose
        chunks to load are all in the cpu tier and fit what is left of this step's
        ``sync_load_max_bytes`` (one full-attention group only) returns (hit - local, False)
        instead: vLLM schedules the request's tail in this very step and the workers copy the
        chunks in start_load_kv before its forward (a synchronous load).  No file, socket
        or network I/O.  Before the workers' first report it answers None ("ask next step").
        With a shared tier (``redis_url``), the pages no local tier holds are asked about in
        the background (:mod:`~kvtier.integrations.vllm.remote`); None while that runs, at most
        ``shared_deadline_s``, then the pages found there join the hit.
    get_external_cache_hit_sources           the hit split by planned tier (tokens_by_tier)
    update_state_after_alloc(req, blocks, n) n > 0: queue a LoadJob: the pages that resume every
                                             group at the hit, and the planned tier per chunk
    build_connector_meta(step)               ship queued loads; for every scheduled request
                                             whose computed tokens complete new full chunks
                                             this step, a SaveJob with those chunks' pages
    update_connector_output(out)             fold each rank's index changes into the mirror
    request_finished(req)                    forget the request (blocks freed at once: the
                                             copy out of the engine finished in its own step)
    (pins)                                   a request whose kv_transfer_params carry
                                             ``kvtier_pin_s`` gets its prompt's chunks pinned in
                                             the cpu tier by the workers as they save them
                                             (SaveJob.pin_s; TieredStore.ttl_pin)
    reset_cache()                            vLLM's external prefix-cache reset: see below

An asynchronous load job always ends with the request in ``finished_recving`` (the worker reports
it whether the load succeeded, came up short or failed).  A synchronous one never does: its
missing blocks (a chunk evicted since the mirror said it was there; the worker pins what it finds
before copying) come back as ``invalid_block_ids`` of its own step, vLLM recomputes the running
request from the first one (``_handle_invalid_blocks`` on ``self.running``), the worker did not
save that step's chunks from there, and the scheduler saves them again once recomputed.  With one KV cache group, missing blocks are
reported through ``get_block_ids_with_load_errors`` in the same step or earlier, so vLLM (policy
``recompute``) keeps the valid prefix and recomputes the rest (vllm/v1/core/sched/scheduler.py:
``_update_requests_with_invalid_blocks``, ``_update_waiting_for_remote_kv``); with several,
vLLM takes no block ids and a load that cannot deliver every page fails whole
(``failed_recving``).  The number of groups chooses; the path is the same.

Hit attribution: vLLM asks for the hit's sources at admission, from this plan; the load job
carries the plan's tier per chunk and the workers label their loaded-token counters with it
(:class:`~kvtier.core.stats.StoreStats` ``loaded_tokens``, ``unfilled_tokens``), so the two agree
per tier exactly.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import chunk_keys, request_root
from kvtier.core.tenant import TenantId
from kvtier.core.tiers.factory import state_dir
from kvtier.core.tiers.registry import reset_tiers, top_tier
from kvtier.integrations.vllm.events import EventGroup, KVEventTracker, events_enabled
from kvtier.integrations.vllm.group_jobs import GroupJobs, handoffs_of
from kvtier.integrations.vllm.groups import GroupKind, engine_plan, resolved_config
from kvtier.integrations.vllm.mirror import IndexMirror
from kvtier.integrations.vllm.protocol import (
    KVTierMetadata,
    KVTierWorkerMeta,
    LoadJob,
    ResetOrder,
    SaveJob,
    tokens_by_tier,
)
from kvtier.integrations.vllm.remote import RemoteLookups, shared_tier_configured
from kvtier.integrations.vllm.reset import reset_outside
from kvtier.integrations.vllm.settle import Settle
from kvtier.integrations.vllm.stats import KVTierStats

log = logging.getLogger(__name__)

READY_WAIT_S = 60.0  # how long admissions wait for the workers' first index snapshot, at most
PIN_PARAM = "kvtier_pin_s"
"""The ``kv_transfer_params`` key a request names its prompt's pin TTL with, seconds (issue 22 item 4)."""


def pin_seconds(params: Any, max_s: float) -> tuple[float, str | None]:
    """A request's pin TTL from its ``kv_transfer_params`` (OpenAI ``extra_body``), seconds.

    Returns:
        ``(ttl_s, problem)``: ``ttl_s`` 0 when the request asks for no pin or asks wrongly, capped
        at ``max_s`` (``pin_max_s``); ``problem`` one sentence for the log when the value was
        refused or cut, else ``None``.
    """
    value = params.get(PIN_PARAM) if isinstance(params, dict) else None
    if value is None:
        return 0.0, None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return 0.0, (f"kv_transfer_params.{PIN_PARAM} must be a positive number of seconds, got {value!r}; "
                     "the prompt is not pinned")
    if value > max_s:
        return max_s, f"kv_transfer_params.{PIN_PARAM}={value:g} is above pin_max_s; pinned for {max_s:g} s"
    return float(value), None


class RequestChain:
    """Chunk keys of one request, extended as its tokens grow (hashing each chunk once)."""

    def __init__(self, request: Any, key_root: bytes, chunk_tokens: int) -> None:
        lora = getattr(request, "lora_request", None)
        lora_id = f"{lora.lora_name}@{lora.lora_path}" if lora is not None else None
        mm = [str(f.identifier) for f in (getattr(request, "mm_features", None) or ())]
        self.root = request_root(key_root, getattr(request, "cache_salt", None), lora_id, mm)
        self.tenant = TenantId.of(getattr(request, "cache_salt", None), lora.lora_name if lora is not None else None)
        self.chunk_tokens = chunk_tokens
        self.keys: list[bytes] = []

    def upto(self, token_ids: Any, num_chunks: int) -> list[bytes]:
        """Keys of chunks ``0 .. num_chunks - 1`` (``token_ids`` must hold them)."""
        have = len(self.keys)
        if num_chunks > have:
            parent = self.keys[-1] if self.keys else self.root
            more = token_ids[have * self.chunk_tokens:num_chunks * self.chunk_tokens]
            self.keys.extend(chunk_keys(parent, list(more), self.chunk_tokens))
        return self.keys[:num_chunks]


class SchedulerSide:
    """Scheduler-side state of the connector.

    Args:
        vllm_config, kv_cache_config: vLLM's configs.
        config: kvtier configuration.
        load, save: whether this role loads (``kv_both``, ``kv_consumer``) and saves
            (``kv_both``, ``kv_producer``).

    Raises:
        ConfigError: an explicit ``chunk_tokens`` not a multiple of the block size of every KV
            cache group (``auto`` is resolved from them:
            :func:`~kvtier.integrations.vllm.groups.resolved_config`), a KV cache group kind kvtier
            does not store, or
            pipeline parallelism.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: KVTierConfig, load: bool, save: bool) -> None:
        self.block_size = int(vllm_config.cache_config.block_size)
        config = resolved_config(config, kv_cache_config)  # as the workers resolve it: the same KV cache groups
        assert isinstance(config.chunk_tokens, int)
        config.validate_block_size(self.block_size)
        plan = engine_plan(vllm_config, kv_cache_config, config.chunk_tokens)  # ConfigError: unsupported groups
        for note in plan.advice():
            log.warning("kvtier: %s", note)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("kvtier does not support pipeline parallelism yet; use tensor parallelism only")
        self.config = config
        self.chunk_tokens = config.chunk_tokens
        self.load_enabled, self.save_enabled = load, save
        self.mirror = IndexMirror(int(vllm_config.parallel_config.tensor_parallel_size))
        self.groups = GroupJobs(plan, self.mirror)  # a dense model is a one-group plan
        # synchronous loads: one full-attention group only (vLLM takes a sync load's failures as
        # block ids, which it refuses with several groups: Scheduler._handle_invalid_blocks)
        one_group = len(kv_cache_config.kv_cache_groups) == 1 and plan.groups[0].kind is GroupKind.FULL
        self.sync_budget_bytes = int(config.sync_load_max_bytes) if one_group and load else 0
        self.bytes_per_token = _bytes_per_token(kv_cache_config)
        self._top_tier = top_tier()
        self._sync_left_bytes = self.sync_budget_bytes  # this step's budget not yet promised
        self._sync_planned: dict[str, int] = {}  # requests answered (n, False) this step -> bytes promised
        # synchronous loads shipped: req -> ((chunk, its engine blocks) per page, outputs left to check:
        # 2, as with asynchronous scheduling a step's output comes after the next step is scheduled)
        self._sync_loads: dict[str, tuple[tuple[tuple[int, tuple[int, ...]], ...], int]] = {}
        self._requests: dict[str, Any] = {}
        self._chains: dict[str, RequestChain] = {}
        self._planned: dict[str, list[str]] = {}  # req -> tier of each chunk of its planned load
        self._loads: list[LoadJob] = []
        # loads shipped and not yet reported finished: req_id -> the engine blocks they fill
        self._loading: dict[str, frozenset[int]] = {}
        # requests whose load failed (blocks reported invalid, or the whole load failed): vLLM
        # asks again for them at once, and the same answer would fail the same way (e.g. a worker
        # whose shared tier skips reads while the scheduler's lookups succeed): they recompute.
        self._load_failed: set[str] = set()
        self._saved_chunks: dict[str, int] = {}
        self._pins: dict[str, float] = {}  # req -> its prompt's pin TTL, seconds (asked and valid)
        self._kv_cache_manager: Any = None
        self._waiting_since: float | None = None
        # An idle engine runs no step, so the workers' rescans (files other engines or kvtier purge
        # removed or wrote) wait in their change feeds: after an idle gap longer than a rescan, a
        # lookup asks again once, and the one step that takes brings the news (docs/purge.md).
        self._refresh_after_s = float(config.disk_rescan_s or 0.0) if config.disk_path else 0.0
        self._last_report_s = time.monotonic()
        self._refreshed: set[str] = set()  # requests that asked again for it already (once each)
        self.remote = RemoteLookups(config) if load and shared_tier_configured(config) else None
        self._remote_seen: dict[str, int] = {}
        self._remote_pending_sent: int | None = None
        # vLLM KV events (--kv-events-config): None when vLLM publishes none
        self.events = _event_tracker(vllm_config, kv_cache_config, plan, config, self.mirror) if events_enabled(vllm_config) \
            else None
        # keeps an idle engine stepping until the workers' gauges are true (and the events are out)
        self.settle = Settle(more=self.events.pending if self.events is not None else None)
        self._reset_epoch = 0  # resets acknowledged so far
        self._reset_order: ResetOrder | None = None  # shipped with the next step's metadata
        self._reset_counts: dict[str, int] = {}  # reset counters not yet sent to /metrics
        self._settings_sent = False  # kv_events_enabled and the quota gauges go out with the first stats

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    def _chain(self, request: Any, num_chunks: int) -> list[bytes] | None:
        """Keys of the request's first ``num_chunks`` chunks; ``None`` if it cannot be keyed."""
        if getattr(request, "prompt_embeds", None) is not None or self.mirror.key_root is None:
            return None  # prompt embeddings have no token ids to key on
        chain = self._chains.get(request.request_id)
        if chain is None:
            chain = self._chains[request.request_id] = RequestChain(request, self.mirror.key_root, self.chunk_tokens)
        return chain.upto(request.all_token_ids, num_chunks)

    # ---- admission ---------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request
        if self.save_enabled:
            ttl_s, problem = pin_seconds(getattr(request, "kv_transfer_params", None), self.config.pin_max_s)
            if problem:
                log.warning("kvtier: request %s: %s", request.request_id, problem)
            if ttl_s > 0 and self.config.pin_max_share > 0:
                self._pins[request.request_id] = ttl_s

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        self._planned.pop(req_id, None)
        # asked again in this step (not scheduled after the first answer): its promise is given back
        self._sync_left_bytes += self._sync_planned.pop(req_id, 0)
        self._requests.setdefault(req_id, request)
        # vLLM must compute at least the last prompt token itself (to sample from its logits).
        max_chunks = (request.num_tokens - 1) // self.chunk_tokens
        loadable = self.load_enabled and max_chunks * self.chunk_tokens > num_computed_tokens
        if not self.mirror.ready and (loadable or (self.save_enabled and request.num_tokens >= self.chunk_tokens)):
            # The workers' first report (their index and the key root chunk keys hang from) comes
            # with the next step.  A producer waits too: keys for its saves need the root, and a
            # sliding-window page is gone from the engine by the step after its prefill.
            now = time.monotonic()
            self._waiting_since = self._waiting_since or now
            if not (self.mirror.broken or now - self._waiting_since > READY_WAIT_S):
                return None, False
        if not loadable or not self.mirror.ready:
            return 0, False
        if req_id in self._load_failed:
            return 0, False  # its load failed once: recompute rather than load again
        if (self._refresh_after_s and req_id not in self._refreshed
                and time.monotonic() - self._last_report_s > self._refresh_after_s):
            self._refreshed.add(req_id)  # idle longer than a rescan: let one step bring the workers' news
            return None, False
        chain = self._chain(request, max_chunks)
        if chain is None:
            return 0, False
        hit, tiers = self.groups.lookup(chain, num_computed_tokens, request.num_tokens)
        if self.remote is not None and hit < max_chunks * self.chunk_tokens and self.remote.bind(
                self.mirror.namespaces):
            found = self.remote.poll_pages(req_id, self.groups.unheld_pages(chain, num_computed_tokens,
                                                                             request.num_tokens))
            if found is None:
                return None, False  # the shared tier has not answered yet: ask again next step
            if found:
                hit, tiers = self.groups.lookup(chain, num_computed_tokens, request.num_tokens, found,
                                                self.remote.tier_name)
        if hit <= num_computed_tokens:
            return 0, False
        self._planned[req_id] = tiers
        if self._sync_fits(tiers, num_computed_tokens, hit):
            promised = (hit - num_computed_tokens) * self.bytes_per_token
            self._sync_left_bytes -= promised
            self._sync_planned[req_id] = promised
            return hit - num_computed_tokens, False  # loaded in this step's start_load_kv, before the forward
        return hit - num_computed_tokens, True

    def _sync_fits(self, tiers: list[str], num_computed_tokens: int, hit: int) -> bool:
        """Load in the scheduling step itself: every chunk to load is in the cpu tier (by the mirror)
        and the copy fits what is left of this step's ``sync_load_max_bytes``."""
        if not self.sync_budget_bytes:
            return False
        if (hit - num_computed_tokens) * self.bytes_per_token > self._sync_left_bytes:
            return False
        return all(t == self._top_tier for t in tiers[num_computed_tokens // self.chunk_tokens:])

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        if self.remote is not None:
            self.remote.forget(req_id)
        tiers = self._planned.get(req_id)
        if num_external_tokens <= 0 or tiers is None:
            self._planned.pop(req_id, None)
            self._sync_left_bytes += self._sync_planned.pop(req_id, 0)
            if num_external_tokens > 0:  # vLLM asked us to load what we never offered
                raise RuntimeError(f"kvtier: request {req_id} was allocated external tokens kvtier did not offer")
            return
        hit = len(tiers) * self.chunk_tokens
        local = hit - num_external_tokens
        pages = self.groups.load_pages(self._chains[req_id].keys, blocks.get_block_ids(), local, hit)
        if self.events is not None:  # a hit whose hashes were unknown (after a crash) is announced now
            for page in pages:
                self.events.record(request, page.key, page.group, page.chunk)
        resumed = getattr(request, "num_preemptions", 0) > 0
        sync = self._sync_planned.pop(req_id, None) is not None
        self._loads.append(LoadJob(req_id, pages, local, hit, tuple(tiers), resumed, sync=sync))

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """Split ``num_external_tokens`` by the tier each planned chunk is in (the same split the
        workers label ``loaded_tokens`` with: :func:`~kvtier.integrations.vllm.protocol.tokens_by_tier`)."""
        tiers = self._planned.get(request.request_id, [])
        hit = len(tiers) * self.chunk_tokens
        return tokens_by_tier(tiers, hit - num_external_tokens, hit, self.chunk_tokens)

    # ---- per step ----------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        meta = KVTierMetadata(loads=self._loads, reset=self._reset_order,
                              no_forward=scheduler_output.total_num_scheduled_tokens == 0)
        self._loads, self._reset_order = [], None
        self.settle.step(idle=not scheduler_output.num_scheduled_tokens and not self._requests and not self._loading)
        self._sync_left_bytes = self.sync_budget_bytes  # the next step's budget
        self._sync_planned.clear()
        for load in meta.loads:
            self._planned.pop(load.req_id, None)
            if load.sync:  # no finished_recving will come: its blocks are checked against this step's errors
                self._sync_loads[load.req_id] = (tuple((p.chunk, p.block_ids) for p in load.pages), 2)
            else:
                self._loading[load.req_id] = load.block_ids
        if self.save_enabled:
            for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
                save = self._save_job(req_id, num_scheduled, scheduler_output)
                if save is not None:
                    meta.saves.append(save)
        return meta

    def _save_job(self, req_id: str, num_scheduled: int, scheduler_output: Any) -> SaveJob | None:
        request = self._requests.get(req_id)
        if request is None:
            return None
        # KV of tokens [0, computed + scheduled) exists once this step's forward pass is done.
        done = min(request.num_computed_tokens + num_scheduled, len(request.all_token_ids))
        end = done // self.chunk_tokens
        start = self._saved_chunks.get(req_id, 0)
        if end <= start:
            return None
        keys = self._chain(request, end)
        if keys is None:
            return None
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if state is not None:
            all_block_ids = state.resolve_block_ids(req_id)
        else:
            all_block_ids = self._kv_cache_manager.get_block_ids(req_id)
        self._saved_chunks[req_id] = end
        pages = self.groups.save_pages(keys, start, end, all_block_ids, handoffs_of(scheduler_output, req_id),
                                       request.num_prompt_tokens)
        if self.events is not None:
            for page in pages:
                self.events.record(request, page.key, page.group, page.chunk)
        if not pages:
            return None
        tenant = self._chains[req_id].tenant if req_id in self._chains else None
        return SaveJob(req_id, pages, self.groups.parent_of(keys, pages[0]), pin_s=self._pins.get(req_id, 0.0),
                       pin_chunks=request.num_prompt_tokens // self.chunk_tokens, tenant=tenant)

    def update_connector_output(self, connector_output: Any) -> None:
        """Fold the ranks' index changes (vLLM's worker → scheduler metadata) into the mirror."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self._last_report_s = time.monotonic()
        self.settle.observe(meta)
        if isinstance(meta, KVTierWorkerMeta):
            for rank in sorted(meta.ranks):
                self.mirror.apply(rank, meta.ranks[rank])
            if self.events is not None:
                self._observe_events(meta)
        if self._sync_loads:
            invalid = getattr(connector_output, "invalid_block_ids", None) or set()
            for req_id, (pages, left) in list(self._sync_loads.items()):
                bad = [chunk for chunk, blocks in pages if invalid and not invalid.isdisjoint(blocks)]
                if bad:
                    # vLLM recomputes it from the first invalid block (the request keeps running); the
                    # worker did not save the chunks from there: save them again once recomputed
                    log.info("kvtier: request %s: its synchronous load came up short; vLLM recomputes from chunk %d",
                             req_id, min(bad))
                    self._saved_chunks[req_id] = min(self._saved_chunks.get(req_id, 0), min(bad))
                    left = 1
                if left <= 1:
                    del self._sync_loads[req_id]
                else:
                    self._sync_loads[req_id] = (pages, left - 1)
        if self._loading:
            invalid = getattr(connector_output, "invalid_block_ids", None) or set()
            failed = getattr(connector_output, "failed_recving", None) or set()
            finished = getattr(connector_output, "finished_recving", None) or set()
            for req_id, blocks in list(self._loading.items()):
                if req_id in failed or not blocks.isdisjoint(invalid):
                    if req_id not in self._load_failed:
                        log.info("kvtier: request %s: its load failed; it recomputes from there and is not "
                                 "loaded again", req_id)
                    self._load_failed.add(req_id)
                if req_id in finished or req_id in failed:
                    del self._loading[req_id]

    def _observe_events(self, meta: KVTierWorkerMeta) -> None:
        assert self.events is not None
        if not self.events.journal_loaded and self.mirror.ready and self.mirror.key_root:
            self.events.load_journal(self.mirror.key_root)
        reports = meta.ranks.values()
        if any(r.full for r in reports):
            self.events.observe((), full=True)
        else:
            for report in reports:
                self.events.observe(key for key, _ in report.changes)

    def take_events(self) -> list[Any]:
        """vLLM's ``take_events``: the KV events since the last step (:mod:`kvtier.integrations.vllm.events`);
        empty when vLLM publishes none."""
        return self.events.take_events() if self.events is not None else []

    # ---- end of a request --------------------------------------------------------------------
    def request_finished(self, request: Any) -> None:
        """Forget ``request``.  A load in flight still ends in ``finished_recving``; vLLM keeps the
        request's blocks until then (it delays freeing blocks of WAITING_FOR_REMOTE_KVS requests)."""
        req_id = request.request_id
        self._planned.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._loading.pop(req_id, None)
        self._sync_loads.pop(req_id, None)
        self._sync_left_bytes += self._sync_planned.pop(req_id, 0)
        self._load_failed.discard(req_id)
        self._refreshed.discard(req_id)
        self._chains.pop(req_id, None)
        self._saved_chunks.pop(req_id, None)
        self._pins.pop(req_id, None)
        if self.remote is not None:
            self.remote.forget(req_id)

    # ---- reset ---------------------------------------------------------------------------------
    def reset_cache(self) -> bool:
        """vLLM's external prefix-cache reset (``/reset_prefix_cache?reset_external=true``): clear the
        tiers ``reset_scope`` names, for this engine's namespaces only.

        "Done" (the return value ``True``) means, when this returns: no hit is planned from anything
        held before (the mirror is emptied and drops the ranks' reports until they applied the
        order); the order rides the next step's metadata, where every rank fails its loads that
        started before (recomputed), then clears its store before that step's loads and saves; the
        tiers that outlive the process (disk files, the shared tier's keys under ``all``) are
        already cleared here, for every rank's namespace, and a disk directory carries a marker
        until its rank applied the order, so a restart before the next step serves nothing of
        before either (:mod:`kvtier.core.tiers.disk.reset`).  The cpu tier is emptied by the next
        step (the engine idle: its pages wait, unreachable, since nothing plans a hit from them).

        Returns:
            ``False`` (one log line saying why) when a tier could not be cleared (a disk file not
            removed, the shared server unreachable); the rest is done all the same.
        """
        self._reset_epoch += 1
        tiers = tuple(reset_tiers(self.config.reset_scope))
        planned = self.mirror.reset(self._reset_epoch)
        if self.events is not None:
            self.events.reset()  # every announced chunk: BlockRemoved at the next step
        self._planned.clear()
        if self.remote is not None:
            self.remote.forget_all()  # answers asked before the reset may count chunks it removes
        self._reset_order = ResetOrder(self._reset_epoch, tiers)
        outcome = reset_outside(self.config, tiers, self.mirror.namespaces)
        self.removed_by_reset({t: list(dict.fromkeys((*planned.get(t, ()), *outcome.removed.get(t, ()))))
                               for t in dict.fromkeys((*planned, *outcome.removed))})
        self._count_reset("resets")
        if outcome.problems:
            self._count_reset("reset_failures")
            log.warning("kvtier: reset (scope %s) not complete: %s; the other tiers were cleared",
                        self.config.reset_scope, "; ".join(outcome.problems))
            return False
        log.info("kvtier: reset %d (scope %s: %s): no hit is planned from before it; removed %s; the workers "
                 "clear their stores at the next step", self._reset_epoch, self.config.reset_scope, ", ".join(tiers),
                 outcome.describe())
        return True

    def removed_by_reset(self, keys_by_tier: dict[str, list[bytes]]) -> None:
        """The chunks a reset removed that this process knows, by tier: what the mirror held (every
        rank, in the slowest tier of each) and what the scheduler itself removed from the tiers that
        outlive the process, logged.  The KV events' ``BlockRemoved`` of a reset come from
        :meth:`KVEventTracker.reset <kvtier.integrations.vllm.events.KVEventTracker.reset>`: every
        chunk the router was told of, whatever tier held it."""
        log.debug("kvtier: reset removed %s", ", ".join(f"{len(keys)} {tier} chunks" for tier, keys in
                                                       keys_by_tier.items()) or "nothing the scheduler knew of")

    def _count_reset(self, name: str) -> None:
        self._reset_counts[name] = self._reset_counts.get(name, 0) + 1

    def stats(self) -> KVTierStats | None:
        """The scheduler's counters' change since the last call: resets (``kvtier_resets_total``,
        ``kvtier_reset_failures_total``) and, with a shared tier, its lookups and those in flight
        (``kvtier_shared_lookups_*``); ``None`` when nothing changed."""
        counters: dict[str, float] = dict(self._reset_counts)
        self._reset_counts = {}
        if self.events is not None:
            counters |= self.events.take_counters()
        gauges: dict[str, float] = {}
        if not self._settings_sent:  # what kvtier doctor shows: events on, quotas (sent once)
            self._settings_sent = True
            quotas = self.config.tenant_quotas
            gauges |= {"kv_events_enabled": float(self.events is not None),
                       "tenant_quota_default_share": (quotas.default_share or 0.0) if quotas is not None else 0.0,
                       "tenant_quota_salts": float(len(quotas.salts)) if quotas is not None else 0.0,
                       "tenant_quota_no_salt_share": quotas.no_salt_guarantee if quotas is not None else 0.0}
        if self.remote is not None:
            totals = self.remote.counters()
            counters |= {k: v - self._remote_seen.get(k, 0) for k, v in totals.items()
                         if v != self._remote_seen.get(k, 0)}
            self._remote_seen = totals
            pending = self.remote.pending
            if pending != self._remote_pending_sent or counters:
                gauges["shared_lookups_pending"] = pending
                self._remote_pending_sent = pending
        if not counters and not gauges:
            return None
        return KVTierStats(data={"counters": counters, "gauges": gauges})

    def shutdown(self) -> None:
        """Stop the shared-tier lookups and write the KV-event journal (idempotent)."""
        if self.remote is not None:
            self.remote.close()
        if self.events is not None and self.events.journal_loaded:
            self.events.save_journal()


def _bytes_per_token(kv_cache_config: Any) -> int:
    """KV bytes one token takes in one rank's engine cache, every layer of every group
    (``kv_cache_spec.page_size_bytes`` is one layer's block): what a synchronous load copies per token."""
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += -(-int(spec.page_size_bytes) * len(group.layer_names) // int(spec.block_size))
    return max(total, 1)


def _event_tracker(vllm_config: Any, kv_cache_config: Any, plan: Any, config: KVTierConfig,
                   mirror: IndexMirror) -> KVEventTracker:
    """The KV event tracker of this engine: its full-attention groups are announced, with vLLM's
    ``kv_cache_spec_kind`` of each (vllm/v1/kv_cache_interface.py ``get_kv_cache_spec_kind``)."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    groups = []
    for g in plan.groups:
        spec = kv_cache_config.kv_cache_groups[g.index].kv_cache_spec
        groups.append(EventGroup(g.index, g.block_size, g.kind is GroupKind.FULL, get_kv_cache_spec_kind(spec).value))
    hash_block_size = int(getattr(kv_cache_config, "hash_block_size", 0) or vllm_config.cache_config.block_size)
    assert isinstance(config.chunk_tokens, int)
    return KVEventTracker(mirror.tier, groups, hash_block_size, config.chunk_tokens,
                          journal_dir=state_dir(config))
