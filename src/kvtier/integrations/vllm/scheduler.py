"""Scheduler side of the connector: decides what each step loads and saves.

Per request (``k = chunk_tokens // block_size``)::

    get_num_new_matched_tokens(req, local)   ask every rank to pin the cached prefix
        -> hit = pinned chunks × chunk_tokens (capped so ≥ 1 prompt token is computed);
           returns hit - local (0 if the engine's own prefix cache already covers it)
    update_state_after_alloc(req, blocks, n) n > 0: queue a LoadJob for blocks local/bs .. hit/bs
                                             n = 0: release the pin
    build_connector_meta(step)               emit queued loads; for every scheduled request
                                             whose computed tokens complete new full chunks
                                             this step, emit a SaveJob for those chunks
    request_finished(req)                    release any pin left (aborted before its load)

Loads are synchronous (returned ``load_kv_async=False``): the worker copies before the forward
pass of the step that schedules the request.  The pin taken at admission guarantees the chunks
are still there and already verified, so the count vLLM records as an external hit is what is
copied; a copy that fails anyway is reported per block through vLLM's load-error path.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.integrations.vllm.protocol import KVTierMetadata, LoadJob, RequestKeys, SaveJob
from kvtier.integrations.vllm.service import (
    Endpoint,
    ServiceUnavailable,
    authkey_for,
    connect,
    service_address,
)

log = logging.getLogger(__name__)


def request_keys(request: Any, num_tokens: int) -> RequestKeys | None:
    """Key inputs of a vLLM ``Request``'s first ``num_tokens`` tokens; ``None`` if it cannot be keyed.

    Requests given as prompt embeddings have no token ids to key on and are skipped.
    """
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    lora_id = f"{lora.lora_name}@{lora.lora_path}" if lora is not None else None
    mm = tuple(str(f.identifier) for f in (getattr(request, "mm_features", None) or ()))
    tokens = tuple(int(t) for t in request.all_token_ids[:num_tokens])
    return RequestKeys(tokens, getattr(request, "cache_salt", None), lora_id, mm)


class SchedulerSide:
    """Scheduler-side state of the connector.

    Args:
        vllm_config, kv_cache_config: vLLM's configs.
        config: kvtier configuration.
        engine_id, dp_rank: identify this engine's rank services.
        load, save: whether this role loads (``kv_both``, ``kv_consumer``) and saves
            (``kv_both``, ``kv_producer``).

    Raises:
        ConfigError: ``chunk_tokens`` not a multiple of the block size, several KV cache
            groups, or pipeline parallelism.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: KVTierConfig, engine_id: str,
                 dp_rank: int, load: bool, save: bool) -> None:
        self.block_size = int(vllm_config.cache_config.block_size)
        config.validate_block_size(self.block_size)
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(f"the model has {len(kv_cache_config.kv_cache_groups)} KV cache groups; kvtier "
                              "handles models with one (plain full attention); drop the kvtier connector for it")
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("kvtier does not support pipeline parallelism yet; use tensor parallelism only")
        self.chunk_tokens = config.chunk_tokens
        self.k = self.chunk_tokens // self.block_size
        self.load_enabled, self.save_enabled = load, save
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._addresses = [service_address(engine_id, dp_rank, r) for r in range(tp_size)]
        self._authkey = authkey_for(engine_id)
        self._endpoints: list[Endpoint] | None = None
        self._requests: dict[str, Any] = {}
        self._pinned: dict[str, tuple[str, ...]] = {}  # req -> tier of each pinned chunk (rank 0)
        self._loads: list[LoadJob] = []
        self._saved_chunks: dict[str, int] = {}
        self._kv_cache_manager: Any = None
        self._pins_taken = False

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    def _ranks(self) -> list[Endpoint]:
        if self._endpoints is None:
            self._endpoints = [connect(a, self._authkey) for a in self._addresses]
        return self._endpoints

    # ---- admission ---------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.load_enabled:
            return 0, False
        self._requests.setdefault(request.request_id, request)
        # vLLM must compute at least the last prompt token itself (to sample from its logits).
        max_chunks = (request.num_tokens - 1) // self.chunk_tokens
        if max_chunks * self.chunk_tokens <= num_computed_tokens:
            self.release(request.request_id)
            return 0, False
        keys = request_keys(request, max_chunks * self.chunk_tokens)
        if keys is None:
            return 0, False
        try:
            tiers = self._pin_all(request.request_id, keys, max_chunks)
        except ServiceUnavailable as exc:
            log.warning("kvtier: %s; serving request %s without kvtier", exc, request.request_id)
            return 0, False
        hit = len(tiers) * self.chunk_tokens
        if self._pins_taken:
            self._pinned[request.request_id] = tiers
        if hit <= num_computed_tokens:
            self.release(request.request_id)
            return 0, False
        return hit - num_computed_tokens, False

    def _pin_all(self, req_id: str, keys: RequestKeys, max_chunks: int) -> tuple[str, ...]:
        """Pin on every rank; the usable prefix is the shortest any rank holds."""
        ranks = self._ranks()
        tiers = ranks[0].pin(req_id, keys, max_chunks)
        self._pins_taken = bool(tiers)  # later ranks are only asked when rank 0 pinned something
        for endpoint in ranks[1:]:
            if tiers:
                tiers = tiers[:len(endpoint.pin(req_id, keys, len(tiers)))]
        return tiers

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        if num_external_tokens <= 0:
            self.release(req_id)
            return
        tiers = self._pinned.get(req_id)
        if tiers is None:  # vLLM asked us to load what we never offered: refuse safely
            raise RuntimeError(f"kvtier: request {req_id} was allocated external tokens kvtier did not pin")
        hit = len(tiers) * self.chunk_tokens
        first = hit - num_external_tokens
        block_ids = blocks.get_block_ids()[0]
        first_block, end_block = first // self.block_size, hit // self.block_size
        resumed = getattr(request, "num_preemptions", 0) > 0
        self._loads.append(LoadJob(req_id, first_block, tuple(block_ids[first_block:end_block]), len(tiers),
                                   resumed))

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """Split ``num_external_tokens`` by the tier (``cpu``/``disk``) each chunk was pinned from."""
        tiers = self._pinned.get(request.request_id, ())
        hit = len(tiers) * self.chunk_tokens
        out: dict[str, int] = {}
        for pos in range(hit - num_external_tokens, hit, self.block_size):
            tier = tiers[pos // self.chunk_tokens]
            out[tier] = out.get(tier, 0) + self.block_size
        return out

    # ---- per step ----------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        meta = KVTierMetadata(loads=self._loads)
        self._loads = []
        for load in meta.loads:
            self._pinned.pop(load.req_id, None)  # the worker consumes the pin in this step
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
        keys = request_keys(request, end * self.chunk_tokens)
        if keys is None:
            return None
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if state is not None:
            block_ids = state.resolve_block_ids(req_id)[0]
        else:
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
        needed = block_ids[start * self.k:end * self.k]
        if len(needed) < (end - start) * self.k:
            return None  # blocks not all allocated (should not happen); skip rather than guess
        self._saved_chunks[req_id] = end
        return SaveJob(req_id, keys, start, end, tuple(needed))

    # ---- end of a request --------------------------------------------------------------------
    def release(self, req_id: str) -> None:
        """Drop ``req_id``'s pins on every rank (no-op if none)."""
        if self._pinned.pop(req_id, None) is None:
            return
        for endpoint in self._ranks():
            try:
                endpoint.release(req_id)
            except ServiceUnavailable as exc:
                log.warning("kvtier: %s; could not release request %s", exc, req_id)

    def request_finished(self, request: Any) -> None:
        req_id = request.request_id
        self.release(req_id)
        self._loads = [job for job in self._loads if job.req_id != req_id] if self._loads else self._loads
        self._requests.pop(req_id, None)
        self._saved_chunks.pop(req_id, None)
