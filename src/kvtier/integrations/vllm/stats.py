"""kvtier numbers in vLLM's own ``/metrics``, through vLLM's connector metrics hooks.

Path of a number: the worker-side connector fills a :class:`KVTierStats` each step
(``get_kv_connector_stats``); vLLM sums the ranks' stats with :meth:`KVTierStats.aggregate`,
ships them to the front-end process, and calls :meth:`KVTierPromMetrics.observe`, whose
collectors were created with vLLM's metric classes and so land in the same registry as
``vllm:prefix_cache_*`` and ``vllm:external_prefix_cache_*``.

Exported (Prometheus adds ``_total`` to counters; ``tier`` is ``cpu``, ``disk`` or ``redis``):

- ``kvtier_loaded_tokens_total{tier}``: tokens copied from kvtier into the engine.  Over a run
  it equals ``vllm:external_prefix_cache_hits_total`` (both count only loads that happened, and
  neither counts re-admissions after preemption).
- ``kvtier_reloaded_tokens_total``: tokens loaded into requests resumed after a preemption
  (vLLM reports those as preempted hits, apart from its external hits).
- ``kvtier_saved_tokens_total``: tokens newly written into kvtier.
- ``kvtier_load_failed_blocks_total``: blocks reported to vLLM as failed loads (recomputed).
- ``kvtier_transfer_seconds_total{direction}`` and ``kvtier_transfer_bytes_total{direction}``,
  ``direction`` = ``load`` (kvtier → engine) or ``save`` (engine → kvtier).
- ``kvtier_evictions_total{tier}``, ``kvtier_dropped_saves_total``, ``kvtier_corrupt_chunks_total``.
- ``kvtier_disk_write_errors_total``: chunk writes to the disk tier that failed (a full or
  read-only directory, an I/O error); those chunks were not stored.
- ``kvtier_usage_bytes{tier}``, ``kvtier_capacity_bytes{tier}``: summed over ranks.
- ``kvtier_pinned_chunks{tier}``, ``kvtier_pinned_bytes{tier}``: chunks held by loads or disk
  writes in flight (zero when idle: a leaked pin shows); ``kvtier_dirty_bytes``: bytes in DRAM not
  yet on the disk tier (the restart-loss window when the stop is not graceful).
- ``kvtier_chunk_tokens``: tokens per chunk the engine runs with (``chunk_tokens``, ``auto``
  resolved from the KV cache groups' block sizes; rank 0 reports it, so the sum is the value).
- ``kvtier_flush_missed_chunks_total``: dirty chunks a graceful stop could not write in time.
- Shared tier (workers' side, from each store's snapshot ``TierStats.wire``; summed over ranks):
  ``kvtier_redis_errors_total`` (calls that failed), ``kvtier_redis_skipped_calls_total`` (not
  made: breaker open or queue full), ``kvtier_redis_skipped_writes_total`` (chunks not written),
  ``kvtier_redis_breaker_state`` (0 closed; 1 half-open, 2 open, per rank).
- Shared tier (scheduler side, :meth:`RemoteLookups.counters
  <kvtier.integrations.vllm.remote.RemoteLookups.counters>`): ``kvtier_shared_lookups_total``
  (sent), ``kvtier_shared_lookups_answered_total``, ``kvtier_shared_lookups_timed_out_total``,
  ``kvtier_shared_lookups_superseded_total`` (replaced by a newer lookup, or dropped with the
  request, before the answer was read: sent = answered + superseded + pending),
  ``kvtier_shared_lookups_skipped_total``, ``kvtier_shared_lookup_chunks_total`` and
  ``kvtier_shared_lookup_hit_chunks_total`` (their ratio is the shared tier's hit rate),
  ``kvtier_shared_lookups_pending`` (sent, answer not read yet).

Token counts are reported by tensor-parallel rank 0 only (every rank moves the same tokens);
bytes, seconds, evictions, dropped saves, corrupt chunks, write errors and usage are summed over ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvtier.core.stats import StoreStats, WireStats

# counter name in the stats payload -> (prometheus name, help, label value or None)
COUNTERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "loaded_tokens_cpu": ("kvtier_loaded_tokens", "Tokens loaded from kvtier into the engine.", ("cpu",)),
    "loaded_tokens_disk": ("kvtier_loaded_tokens", "Tokens loaded from kvtier into the engine.", ("disk",)),
    "loaded_tokens_redis": ("kvtier_loaded_tokens", "Tokens loaded from kvtier into the engine.", ("redis",)),
    "reloaded_tokens": ("kvtier_reloaded_tokens", ("Tokens loaded from kvtier into requests resumed after "
                                                   "preemption (vLLM counts these apart from external hits)."), ()),
    "saved_tokens": ("kvtier_saved_tokens", "Tokens newly saved into kvtier.", ()),
    "load_failed_blocks": ("kvtier_load_failed_blocks", "Engine blocks whose kvtier load failed.", ()),
    "load_seconds": ("kvtier_transfer_seconds", "Seconds copying KV between engine and kvtier.", ("load",)),
    "save_seconds": ("kvtier_transfer_seconds", "Seconds copying KV between engine and kvtier.", ("save",)),
    "load_bytes": ("kvtier_transfer_bytes", "Bytes copied between engine and kvtier.", ("load",)),
    "save_bytes": ("kvtier_transfer_bytes", "Bytes copied between engine and kvtier.", ("save",)),
    "evictions_cpu": ("kvtier_evictions", "Chunks evicted from a kvtier tier.", ("cpu",)),
    "evictions_disk": ("kvtier_evictions", "Chunks evicted from a kvtier tier.", ("disk",)),
    "dropped_saves": ("kvtier_dropped_saves", ("Chunk saves given up by any tier: no room in the cpu tier, a write "
                      "queue full, or a write that failed (see redis_skipped_writes, disk_write_errors)."), ()),
    "corrupt_chunks": ("kvtier_corrupt_chunks", "Chunks that failed verification and were recomputed.", ()),
    "disk_write_errors": ("kvtier_disk_write_errors", ("Chunk writes to the disk tier that failed (full or read-only "
                          "directory, I/O error); those chunks were not stored."), ()),
    "redis_errors": ("kvtier_redis_errors", "Shared-tier (redis) calls that failed: timeout, connection, server error.",
                     ()),
    "redis_skipped_calls": ("kvtier_redis_skipped_calls", "Shared-tier calls not made: breaker open or queue full.", ()),
    "redis_skipped_writes": ("kvtier_redis_skipped_writes", ("Chunks not written to the shared tier (breaker open, "
                             "queue full or the write failed)."), ()),
    "flush_missed_chunks": ("kvtier_flush_missed_chunks", "Dirty chunks a graceful stop could not write to disk in time.",
                            ()),
    # the scheduler's shared-tier lookups (integrations/vllm/remote.py)
    "shared_lookups": ("kvtier_shared_lookups", "Shared-tier lookups the scheduler sent.", ()),
    "shared_lookups_answered": ("kvtier_shared_lookups_answered", "Shared-tier lookups answered (timed out included).",
                                ()),
    "shared_lookups_timed_out": ("kvtier_shared_lookups_timed_out", "Shared-tier lookups that passed shared_deadline_s.",
                                 ()),
    "shared_lookups_superseded": ("kvtier_shared_lookups_superseded", ("Shared-tier lookups replaced by a newer "
                                  "lookup for the same request (its local hit grew) or dropped with the request "
                                  "before their answer was read; sent = answered + superseded + pending."), ()),
    "shared_lookups_skipped": ("kvtier_shared_lookups_skipped", ("Shared-tier lookups not sent: shared_queue_depth "
                               "lookups in flight, or the tier not ready; each answered 0 chunks."), ()),
    "shared_lookup_chunks": ("kvtier_shared_lookup_chunks", "Chunks asked of the shared tier by answered lookups.", ()),
    "shared_lookup_hit_chunks": ("kvtier_shared_lookup_hit_chunks", ("Chunks found in the shared tier (every rank's "
                                 "value present) by answered lookups."), ()),
}
LABELS: dict[str, str] = {"kvtier_loaded_tokens": "tier", "kvtier_transfer_seconds": "direction",
                          "kvtier_transfer_bytes": "direction", "kvtier_evictions": "tier"}
GAUGES: dict[str, tuple[str, str, str | None]] = {
    "usage_bytes_cpu": ("kvtier_usage_bytes", "Bytes held by kvtier, by tier (all ranks).", "cpu"),
    "usage_bytes_disk": ("kvtier_usage_bytes", "Bytes held by kvtier, by tier (all ranks).", "disk"),
    "capacity_bytes_cpu": ("kvtier_capacity_bytes", "kvtier capacity in bytes, by tier (all ranks).", "cpu"),
    "capacity_bytes_disk": ("kvtier_capacity_bytes", "kvtier capacity in bytes, by tier (all ranks).", "disk"),
    "pinned_chunks_cpu": ("kvtier_pinned_chunks", "Chunks pinned by loads or disk writes in flight (all ranks).", "cpu"),
    "pinned_chunks_disk": ("kvtier_pinned_chunks", "Chunks pinned by loads or disk writes in flight (all ranks).", "disk"),
    "pinned_bytes_cpu": ("kvtier_pinned_bytes", "Bytes of chunks pinned by loads or disk writes (all ranks).", "cpu"),
    "pinned_bytes_disk": ("kvtier_pinned_bytes", "Bytes of chunks pinned by loads or disk writes (all ranks).", "disk"),
    "chunk_tokens": ("kvtier_chunk_tokens", ("Tokens per kvtier chunk this engine runs with (chunk_tokens; auto "
                     "resolved from the KV cache groups' block sizes); reported by rank 0."), None),
    "dirty_bytes": ("kvtier_dirty_bytes", "Bytes in DRAM not yet on the disk tier: what a crash loses (all ranks).",
                    None),
    "redis_breaker_state": ("kvtier_redis_breaker_state", ("Shared-tier circuit breaker, summed over ranks: 0 closed "
                            "everywhere; 1 half-open, 2 open per rank."), None),
    "shared_lookups_pending": ("kvtier_shared_lookups_pending", ("Shared-tier lookups sent whose answer the "
                               "scheduler has not read yet."), None),
}

def _wire(s: StoreStats) -> WireStats:
    """The redis tier's wire numbers (zeros when the store has none)."""
    return s.tier("redis").wire or WireStats()


# every payload counter is read from the store's snapshot (kvtier.core.stats) and sent as the change
# between two snapshots
STORE_COUNTERS: dict[str, Callable[[StoreStats], float]] = {
    "loaded_tokens_cpu": lambda s: s.loaded_tokens.get("cpu", 0),
    "loaded_tokens_disk": lambda s: s.loaded_tokens.get("disk", 0),
    "loaded_tokens_redis": lambda s: s.loaded_tokens.get("redis", 0),
    "reloaded_tokens": lambda s: s.reloaded_tokens,
    "saved_tokens": lambda s: s.saved_tokens,
    "load_failed_blocks": lambda s: s.load_failed_blocks,
    "evictions_cpu": lambda s: s.tier("cpu").evictions,
    "evictions_disk": lambda s: s.tier("disk").evictions,
    "dropped_saves": lambda s: s.dropped_saves,
    "corrupt_chunks": lambda s: s.corrupt_chunks,
    "disk_write_errors": lambda s: s.tier("disk").write_errors,
    "flush_missed_chunks": lambda s: s.flush_missed_chunks,
    "redis_errors": lambda s: _wire(s).total_errors,
    "redis_skipped_calls": lambda s: _wire(s).total_skipped_calls,
    "redis_skipped_writes": lambda s: _wire(s).skipped_writes,
    "load_bytes": lambda s: s.transfer_bytes["cpu_to_engine"],
    "load_seconds": lambda s: s.transfer_seconds["cpu_to_engine"],
    "save_bytes": lambda s: s.transfer_bytes["engine_to_cpu"],
    "save_seconds": lambda s: s.transfer_seconds["engine_to_cpu"],
}


# Every rank moves the same tokens (its own KV heads of them), and vLLM sums the ranks' stats:
# token counters are reported by rank 0 only; bytes, seconds and store counters by every rank.
RANK0_ONLY = ("loaded_tokens_cpu", "loaded_tokens_disk", "loaded_tokens_redis", "reloaded_tokens", "saved_tokens",
              "load_failed_blocks")


def store_counters(now: StoreStats, before: StoreStats | None, tp_rank: int = 0) -> dict[str, float]:
    """The :data:`STORE_COUNTERS` that changed from ``before`` (``None``: the store's start) to ``now``,
    without the :data:`RANK0_ONLY` ones on other ranks than ``tp_rank`` 0."""
    deltas = {name: read(now) - (read(before) if before is not None else 0) for name, read in STORE_COUNTERS.items()
              if tp_rank == 0 or name not in RANK0_ONLY}
    return {name: delta for name, delta in deltas.items() if delta}


def store_gauges(s: StoreStats) -> dict[str, float]:
    """The :data:`GAUGES` of one rank, read from its store's snapshot."""
    cpu, disk = s.tier("cpu"), s.tier("disk")
    return {"usage_bytes_cpu": cpu.used_bytes, "capacity_bytes_cpu": cpu.capacity_bytes,
            "usage_bytes_disk": disk.used_bytes, "capacity_bytes_disk": disk.capacity_bytes,
            "pinned_chunks_cpu": cpu.pinned_chunks, "pinned_chunks_disk": disk.pinned_chunks,
            "pinned_bytes_cpu": cpu.pinned_chunks * s.chunk_bytes, "pinned_bytes_disk": disk.pinned_chunks * s.chunk_bytes,
            "dirty_bytes": s.dirty_bytes,
            **({"redis_breaker_state": wire.breaker_state} if (wire := s.tier("redis").wire) else {})}


@dataclass
class KVTierStats(KVConnectorStats):
    """One interval's kvtier numbers: ``data = {"counters": {...}, "gauges": {...}}``.

    Counters are increments over the interval; gauges are the latest values of one rank, so
    :meth:`aggregate` (which vLLM uses across ranks) sums both.
    """

    data: dict[str, Any] = field(default_factory=lambda: {"counters": {}, "gauges": {}})

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("gauges", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        for part in ("counters", "gauges"):
            mine = self.data[part]
            for name, value in other.data.get(part, {}).items():
                mine[name] = mine.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(v, 4) if isinstance(v, float) else v for name, v in self.data["counters"].items() if v}

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not self.data["gauges"]


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Registers the ``kvtier_*`` collectors with vLLM's metric classes and feeds them."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        for prom_name, help_text, _ in COUNTERS.values():
            if prom_name not in self._counters:
                extra = [LABELS[prom_name]] if prom_name in LABELS else []
                self._counters[prom_name] = self._counter_cls(name=prom_name, documentation=help_text,
                                                              labelnames=labelnames + extra)
        self._gauges: dict[str, Any] = {}
        for prom_name, help_text, tier in GAUGES.values():
            if prom_name not in self._gauges:
                self._gauges[prom_name] = self._gauge_cls(name=prom_name, documentation=help_text,
                                                          labelnames=labelnames + (["tier"] if tier else []),
                                                          multiprocess_mode="mostrecent")  # type: ignore[call-arg]
        # Create every labelled child up front so a scrape shows zeros, not absence.
        for engine_idx in per_engine_labelvalues:
            self.observe({"counters": {}, "gauges": {}}, engine_idx)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        counters = transfer_stats_data.get("counters", {})
        for key, (prom_name, _help, label) in COUNTERS.items():
            child = self._counters[prom_name].labels(*base, *label)
            value = counters.get(key, 0)
            if value:
                child.inc(value)
        for key, value in transfer_stats_data.get("gauges", {}).items():
            if key in GAUGES:
                prom_name, _help, tier = GAUGES[key]
                self._gauges[prom_name].labels(*base, *([tier] if tier else [])).set(value)

