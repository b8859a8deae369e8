"""What the scheduler side does once per engine, off every step: at start-up, its checks and plan
(:func:`checked_plan`) and the budget of synchronous loads (:func:`sync_settings`; the budget itself,
asked at every hit and step, is :class:`~kvtier.integrations.vllm.scheduler.side.SyncBudget`): the
tiers a synchronous load reads (:func:`sync_tiers`) and the bytes it copies per token
(:func:`bytes_per_token`); the settings it reports once (:func:`settings_gauges`); at shutdown,
closing what it opened (:func:`shut_down`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.tiers.factory import shared_configured
from kvtier.core.tiers.registry import spec, top_tier
from kvtier.integrations.vllm.cache_groups import GroupKind
from kvtier.integrations.vllm.process_exit import skip_exit_collection
from kvtier.integrations.vllm.scheduler.pages import HybridPlan, engine_plan

if TYPE_CHECKING:
    from kvtier.integrations.vllm.scheduler.events import KVEventTracker
    from kvtier.integrations.vllm.scheduler.remote import RemoteLookups
    from kvtier.integrations.vllm.scheduler.requests import ReceiptDesk

log = logging.getLogger(__name__)


def checked_plan(vllm_config: Any, kv_cache_config: Any, config: KVTierConfig) -> HybridPlan:
    """The engine's per-group plan, once its settings are checked (the advice it has is logged).

    Raises:
        ConfigError: ``chunk_tokens`` not a multiple of ``--block-size``, a KV cache group kind
            kvtier does not store, a retention interval that is not a multiple of ``chunk_tokens``,
            or pipeline parallelism.
        TypeError: ``config.chunk_tokens`` is still ``"auto"``.
    """
    if not isinstance(config.chunk_tokens, int):
        raise TypeError("SchedulerSide needs the engine's config (chunk_tokens resolved): engine_config()")
    config.validate_block_size(int(vllm_config.cache_config.block_size))
    plan = engine_plan(vllm_config, kv_cache_config, config.chunk_tokens)  # ConfigError: unsupported groups
    for note in plan.advice():
        log.warning("kvtier: %s", note)
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ConfigError("kvtier does not support pipeline parallelism yet; use tensor parallelism only")
    return plan


def sync_settings(config: KVTierConfig, kv_cache_config: Any, plan: HybridPlan,
                  load: bool) -> tuple[int, int, frozenset[str], int]:
    """The engine's :class:`~kvtier.integrations.vllm.scheduler.side.SyncBudget` arguments:
    ``sync_load_max_bytes`` over :func:`sync_tiers` when the role loads (``load``) and the engine has
    one full-attention KV cache group only (vLLM takes a synchronous load's failures as block ids,
    which it refuses with several groups: ``Scheduler._handle_invalid_blocks``), else 0 (off);
    ``config.chunk_tokens`` resolved."""
    on = load and len(kv_cache_config.kv_cache_groups) == 1 and plan.groups[0].kind is GroupKind.FULL
    return (int(config.sync_load_max_bytes) if on else 0, bytes_per_token(kv_cache_config),
            sync_tiers(config), int(config.chunk_tokens))


def bytes_per_token(kv_cache_config: Any) -> int:
    """KV bytes one token takes in one rank's engine cache, every layer of every group
    (``kv_cache_spec.page_size_bytes`` is one layer's block): what a synchronous load copies per token."""
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += -(-int(spec.page_size_bytes) * len(group.layer_names) // int(spec.block_size))
    return max(total, 1)


def sync_tiers(config: KVTierConfig) -> frozenset[str]:
    """The tiers a synchronous load reads: the top (cpu) tier, and with ``sync_shared_loads`` the first
    shared tier when it answers from this host's memory (``answers_now``: the node pool, whose pin is
    one local round trip, bounded on the engine's thread by ``shared_deadline_s``)."""
    shared = shared_configured(config)
    if config.sync_shared_loads and shared and "answers_now" in spec(shared[0]).capabilities:
        return frozenset({top_tier(), shared[0]})
    return frozenset({top_tier()})


def settings_gauges(config: KVTierConfig, events_on: bool) -> dict[str, float]:
    """The settings the scheduler side reports once, with its first stats (what ``kvtier doctor``
    shows): KV events on, the tenant quotas."""
    quotas = config.tenant_quotas
    return {"kv_events_enabled": float(events_on),
            "tenant_quota_default_share": (quotas.default_share or 0.0) if quotas is not None else 0.0,
            "tenant_quota_salts": float(len(quotas.salts)) if quotas is not None else 0.0,
            "tenant_quota_no_salt_share": quotas.no_salt_guarantee if quotas is not None else 0.0}


def shut_down(receipts: ReceiptDesk, remote: RemoteLookups | None, events: KVEventTracker | None) -> None:
    """Emit the last receipts and close the receipt sinks, stop the shared-tier lookups and write
    the KV-event journal (idempotent)."""
    skip_exit_collection()  # the engine core exits without a slow final GC: process_exit
    receipts.finish()  # requests finished since the last step: their receipts reach the sinks
    for sink in receipts.sinks:
        try:
            sink.close()
        except Exception:  # one sink's failure must not keep the others open
            log.exception("kvtier: closing a receipt sink failed")
    receipts.sinks = []
    if remote is not None:
        remote.close()
    if events is not None and events.journal_loaded:
        events.save_journal()
