"""What the scheduler side works out once per engine, at start-up, off every step: the budget of
synchronous loads (:func:`sync_budget`; the budget itself, asked at every hit and step, is
:class:`~kvtier.integrations.vllm.scheduler.steps.SyncBudget`): the tiers a synchronous load reads
(:func:`sync_tiers`) and the bytes it copies per token (:func:`bytes_per_token`).
"""

from __future__ import annotations

from typing import Any

from kvtier.core.config import KVTierConfig
from kvtier.core.tiers.factory import shared_configured
from kvtier.core.tiers.registry import spec, top_tier
from kvtier.integrations.vllm.scheduler.steps import SyncBudget


def sync_budget(config: KVTierConfig, kv_cache_config: Any, on: bool) -> SyncBudget:
    """The engine's budget: ``sync_load_max_bytes`` when ``on`` (one full-attention KV cache group,
    loads enabled), over :func:`sync_tiers`; ``config.chunk_tokens`` resolved."""
    return SyncBudget(int(config.sync_load_max_bytes) if on else 0, bytes_per_token(kv_cache_config),
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
