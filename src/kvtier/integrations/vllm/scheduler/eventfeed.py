"""The scheduler side's KV event tracker: built for this engine's cache groups, and fed the ranks'
index changes each step (:mod:`kvtier.integrations.vllm.scheduler.events`)."""

from __future__ import annotations

from typing import Any

from kvtier.core.config import KVTierConfig
from kvtier.core.tiers.factory import state_dir
from kvtier.integrations.vllm.cache_groups import GroupKind
from kvtier.integrations.vllm.protocol import KVTierWorkerMeta
from kvtier.integrations.vllm.scheduler.events import EventGroup, KVEventTracker, events_enabled
from kvtier.integrations.vllm.scheduler.steps import IndexMirror


def event_tracker(vllm_config: Any, kv_cache_config: Any, plan: Any, config: KVTierConfig,
                  mirror: IndexMirror, load: bool = True) -> KVEventTracker | None:
    """The KV event tracker of this engine: its full-attention groups are announced, with vLLM's
    ``kv_cache_spec_kind`` of each (vllm/v1/kv_cache_interface.py ``get_kv_cache_spec_kind``).
    ``None`` when vLLM publishes no KV events, or when the engine never loads (``load`` false: a
    ``kv_producer``): an announced chunk tells a router the engine would serve it, and a producer
    recomputes every prompt (docs/vllm.md "KV events")."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    if not load or not events_enabled(vllm_config):
        return None

    groups = []
    for g in plan.groups:
        spec = kv_cache_config.kv_cache_groups[g.index].kv_cache_spec
        groups.append(EventGroup(g.index, g.block_size, g.kind is GroupKind.FULL, get_kv_cache_spec_kind(spec).value))
    hash_block_size = int(getattr(kv_cache_config, "hash_block_size", 0) or vllm_config.cache_config.block_size)
    assert isinstance(config.chunk_tokens, int)
    return KVEventTracker(mirror.tier, groups, hash_block_size, config.chunk_tokens,
                          journal_dir=state_dir(config))


def observe_reports(events: KVEventTracker, mirror: IndexMirror, meta: KVTierWorkerMeta) -> None:
    """Feed one step's rank reports to ``events`` (loading its journal once the mirror knows the key root)."""
    if not events.journal_loaded and mirror.ready and mirror.key_root:
        events.load_journal(mirror.key_root)
    reports = meta.ranks.values()
    if any(r.full for r in reports):
        events.observe((), full=True)
    else:
        for report in reports:
            events.observe(key for key, _ in report.changes)
