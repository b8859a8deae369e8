"""kvtier numbers in vLLM's own ``/metrics``, through vLLM's connector metrics hooks: what runs each
step on the stats payload.

Path of a number: the worker-side connector fills a :class:`KVTierStats` each step
(``get_kv_connector_stats``) with :func:`store_report`, the change of its store's snapshot in one
pass; vLLM sums the ranks' stats with :meth:`KVTierStats.aggregate`, ships them to the front-end
process, and calls :meth:`KVTierPromMetrics.observe`, whose collectors were created with vLLM's
metric classes and so land in the same registry as ``vllm:prefix_cache_*`` and
``vllm:external_prefix_cache_*``.  The table of names (payload → metric, and how each is read from
the store), read when the collectors are created: :mod:`kvtier.integrations.vllm.stats_table`.

Exported (Prometheus adds ``_total`` to counters; ``tier`` is a registered tier's name, and
the per-tier series follow the registry, :mod:`kvtier.core.tiers.registry`; with the built-in
tiers: cpu, disk, redis):

- ``kvtier_loaded_tokens_total{tier}``: tokens copied from kvtier into the engine, labelled with
  the tier the scheduler's plan named for their chunk: the source vLLM was told at admission
  (``get_external_cache_hit_sources``).  ``kvtier_unfilled_tokens_total{tier}``: tokens vLLM
  admitted as kvtier hits that no load filled (request aborted before its load began, a chunk
  gone or corrupt, ``load_wait_s`` passed), by planned tier.  Per tier, loaded + unfilled equals
  ``vllm:prompt_tokens_cached_by_source_total`` of the tier's hit source, and over all tiers
  ``vllm:external_prefix_cache_hits_total``, exactly (neither counts re-admissions after
  preemption).  ``kvtier_rerouted_chunks_total``: chunks a load read from another tier than
  planned (evicted or promoted in between); the store's own ``kvtier_load_hit_chunks{tier}``
  (``kvtier.core.metrics``) counts chunks by the tier they were actually read from.
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
- ``kvtier_ttl_pinned_chunks{tier}``, ``kvtier_ttl_pinned_bytes{tier}``: chunks requests pinned
  with a TTL (``kv_transfer_params`` ``kvtier_pin_s``) that has not passed, cpu tier;
  ``kvtier_ttl_pin_chunks_total`` (pins made or renewed) and ``kvtier_ttl_pin_refused_chunks_total``
  (refused: ``pin_max_share`` reached).
- Tenant quotas (``tenant_quotas``, :mod:`kvtier.core.quota`): ``kvtier_tenant_usage_bytes{tier,
  tenant}`` (bytes per tenant, labelled by a 12-hex-digit digest of its ``cache_salt``, ``no-salt``,
  at most ``top_tenants`` of them, then ``other`` and ``unknown``: bounded, never a salt in clear;
  summed over ranks), ``kvtier_quota_evictions_total{tier}`` (evictions whose victim the quotas
  chose); the scheduler's ``kvtier_tenant_quota_default_share``, ``kvtier_tenant_quota_salts``
  and ``kvtier_tenant_quota_no_salt_share`` (0, 0 and 0 without quotas) and ``kvtier_kv_events_enabled`` (1 with ``--kv-events-config``), sent
  once, for ``kvtier doctor``.
- Receipts (issue 35; the scheduler side, from each finished request's receipt,
  :class:`~kvtier.integrations.vllm.scheduler.requests.ReceiptDesk`): ``kvtier_served_tokens_total{tier}``,
  prompt tokens served by source, ``tier`` = ``engine`` (vLLM's own prefix cache) or a kvtier
  tier; ``kvtier_missed_tokens_total{reason,tier}``, prompt tokens computed, by the receipt's miss
  reason and the tier it names (``none``: no tier).  Over a run, served + missed = the finished
  requests' prompt tokens, and each equals the sum over their receipts exactly.
- ``kvtier_ghost_hit_distance_bytes{tier}`` (histogram, workers' side): per ghost hit, the bytes the
  tier evicted between evicting the chunk and its being wanted again (:mod:`kvtier.core.ghosts`).
- ``kvtier_receipts_dropped_total{sink}``: receipts the scheduler's receipt log (``log``) or trace
  spans (``otlp``) dropped: queue full, emitted after close, a failed write
  (:func:`kvtier.core.receiptsinks.receipt_counters`).
- ``kvtier_chunk_tokens``: tokens per chunk the engine runs with (``chunk_tokens``, ``auto``
  resolved from the KV cache groups' block sizes; rank 0 reports it, so the sum is the value).
- ``kvtier_flush_missed_chunks_total``: dirty chunks a graceful stop could not write in time.
- Resets (vLLM's ``/reset_prefix_cache?reset_external=true``): ``kvtier_resets_total`` (asked of
  the scheduler side), ``kvtier_reset_failures_total`` (answered ``False``: a tier not cleared
  whole), ``kvtier_reset_chunks_total{tier}`` (chunks the workers' stores removed, all ranks).
- KV events (scheduler side, with ``--kv-events-config``; :mod:`kvtier.integrations.vllm.scheduler.events`):
  ``kvtier_kv_events_stored_total``, ``kvtier_kv_events_removed_total`` (chunks announced held /
  gone), ``kvtier_kv_events_dropped_total`` (removals dropped past the backlog),
  ``kvtier_kv_events_seconds_total`` (scheduler time spent on them: their cost).
- Shared tier (workers' side, from each store's snapshot ``TierStats.wire``; summed over ranks):
  ``kvtier_redis_errors_total`` (calls that failed), ``kvtier_redis_skipped_calls_total`` (not
  made: breaker open or queue full), ``kvtier_redis_skipped_writes_total`` (chunks not written),
  ``kvtier_redis_breaker_state`` (0 closed; 1 half-open, 2 open, per rank);
  ``kvtier_redis_reads_total``, ``kvtier_redis_read_seconds_total``, ``kvtier_redis_read_bytes_total``
  (read batches that returned, their seconds and payload bytes: the mean read latency).  Every
  shared tier has these under its own name (``kvtier_s3_*``).
- Shared tier (scheduler side, :meth:`RemoteLookups.counters
  <kvtier.integrations.vllm.scheduler.remote.RemoteLookups.counters>`): ``kvtier_shared_lookups_total``
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

from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvtier.core.codecstats import CodecNumbers
from kvtier.core.ghosts import DISTANCE_BUCKETS_BYTES
from kvtier.core.stats import StoreStats, TierStats, WireStats
from kvtier.core.tiers import registry
from kvtier.integrations.vllm.stats_table import (
    GHOST_DISTANCE,
    GHOST_PREFIX,
    LABELS,
    TENANT_GAUGE,
    TENANT_PREFIX,
    counters,
    gauges,
    rank0_only,
    store_counter_readers,
)

__all__ = ["LABELS", "TENANT_GAUGE", "TENANT_PREFIX", "KVTierPromMetrics", "KVTierStats", "counters", "gauges",
           "ghost_observations", "rank0_only", "store_counter_readers", "store_counters", "store_gauges",
           "store_report"]


def ghost_observations(distances: list[tuple[str, int]]) -> dict[str, list[float]]:
    """A store's ghost-hit distances (:meth:`~kvtier.core.store.TieredStore.take_ghost_distances`)
    as the payload's ``observations`` (``ghost_hit_distance_bytes|<tier>`` -> list of bytes)."""
    out: dict[str, list[float]] = {}
    for tier, distance in distances:
        out.setdefault(GHOST_PREFIX + tier, []).append(float(distance))
    return out


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
        if observed := other.data.get("observations"):  # histograms' observations: every rank's
            mine_obs = self.data.setdefault("observations", {})
            for name, values in observed.items():
                mine_obs[name] = [*mine_obs.get(name, []), *values]
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(v, 4) if isinstance(v, float) else v for name, v in self.data["counters"].items() if v}

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not self.data["gauges"] and not self.data.get("observations")


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Registers the ``kvtier_*`` collectors with vLLM's metric classes and feeds them."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        extra_config = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        registry.import_tier_modules(tuple(extra_config.get("tier_modules", ())))  # this process's registry
        self._counter_table = counters()
        self._gauge_table = gauges()
        self._counters: dict[str, Any] = {}
        for prom_name, help_text, _ in self._counter_table.values():
            if prom_name not in self._counters:
                names = LABELS.get(prom_name, ())
                extra = [names] if isinstance(names, str) else list(names)
                self._counters[prom_name] = self._counter_cls(name=prom_name, documentation=help_text,
                                                              labelnames=labelnames + extra)
        self._gauges: dict[str, Any] = {}
        for prom_name, help_text, tier in self._gauge_table.values():
            if prom_name not in self._gauges:
                self._gauges[prom_name] = self._gauge_cls(name=prom_name, documentation=help_text,
                                                          labelnames=labelnames + (["tier"] if tier else []),
                                                          multiprocess_mode="mostrecent")  # type: ignore[call-arg]
        self._tenants: Any = self._gauge_cls(name=TENANT_GAUGE, documentation=(  # type: ignore[call-arg]
            "Bytes held per tenant (12-hex-digit cache_salt digest; the top_tenants largest, then other and "
            "unknown), by tier (all ranks); with tenant_quotas."), labelnames=labelnames + ["tier", "tenant"],
            multiprocess_mode="mostrecent")
        self._tenant_children: dict[int, set[tuple[str, str]]] = {}
        self._created: set[int] = set()  # engines whose counter children exist
        self._ghost_distance: Any = self._histogram_cls(
            name=GHOST_DISTANCE, documentation=("Bytes a kvtier tier evicted between evicting a chunk and that chunk "
                                                "being wanted again (ghost hits), by tier (all ranks)."),
            labelnames=labelnames + ["tier"], buckets=list(DISTANCE_BUCKETS_BYTES))
        # Create every labelled child up front so a scrape shows zeros, not absence.
        for engine_idx in per_engine_labelvalues:
            self.observe({"counters": {}, "gauges": {}}, engine_idx)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        counters = transfer_stats_data.get("counters", {})
        if engine_idx not in self._created:  # every child once, up front: a scrape shows zeros
            self._created.add(engine_idx)
            for prom_name, _help, label in self._counter_table.values():
                self._counters[prom_name].labels(*base, *label)
        for key, value in counters.items():
            entry = self._counter_table.get(key)
            if entry is not None and value:
                self._counters[entry[0]].labels(*base, *entry[2]).inc(value)
        gauges = transfer_stats_data.get("gauges", {})
        for key, value in gauges.items():
            if key in self._gauge_table:
                prom_name, _help, tier = self._gauge_table[key]
                self._gauges[prom_name].labels(*base, *([tier] if tier else [])).set(value)
        if "dirty_bytes" in gauges:  # the workers' report (every step): its tenants replace the last ones
            self._observe_tenants(gauges, base, engine_idx)
        for name, values in transfer_stats_data.get("observations", {}).items():
            if name.startswith(GHOST_PREFIX):
                child = self._ghost_distance.labels(*base, name.removeprefix(GHOST_PREFIX))
                for value in values:
                    child.observe(value)

    def _observe_tenants(self, gauges: dict[str, Any], base: list[str], engine_idx: int) -> None:
        now: dict[tuple[str, str], float] = {}
        for key, value in gauges.items():
            if key.startswith(TENANT_PREFIX):
                tier, _, label = key.removeprefix(TENANT_PREFIX).partition("|")
                now[(tier, label)] = value
        for labels in self._tenant_children.get(engine_idx, set()) - set(now):  # left the top: bounded
            try:
                self._tenants.remove(*base, *labels)
            except (KeyError, AttributeError):  # a metric class without remove: zero it instead
                self._tenants.labels(*base, *labels).set(0)
        for labels, value in now.items():
            self._tenants.labels(*base, *labels).set(value)
        self._tenant_children[engine_idx] = set(now)


# -- what the worker runs each step: its report of its store's snapshot (no table lookup) -----------
_NO_TIER = TierStats()
_NO_WIRE = WireStats()
_NO_CODEC = CodecNumbers()

_per_step: tuple[int, frozenset[str], list[registry.TierSpec]] = (-1, frozenset(), [])
"""(registry generation, :func:`rank0_only`, the records) as last derived: the worker's per-step
stats ask the registry nothing while no tier was registered since."""


def _registered() -> tuple[int, frozenset[str], list[registry.TierSpec]]:
    global _per_step
    if _per_step[0] != (generation := registry.generation):
        _per_step = (generation, frozenset(rank0_only()), registry.specs())
    return _per_step


_last: tuple[StoreStats | None, dict[str, float]] = (None, {})
"""The last snapshot :func:`store_counters` read, and its values: the next step's ``before``."""


def store_values(s: StoreStats) -> dict[str, float]:
    """Every :func:`store_counter_readers` value of ``s``, read in one pass (what the worker's
    per-step report diffs; equal to calling each reader)."""
    specs, top = _registered()[2], ""
    out: dict[str, float] = {}
    loaded, unfilled, tiers = s.loaded_tokens, s.unfilled_tokens, s.tiers
    for spec in specs:
        t = spec.name
        top = top or (t if spec.top else "")  # registry.top_tier() (the first top tier), without a call
        stats = tiers.get(t) or _NO_TIER
        out[f"loaded_tokens_{t}"] = loaded.get(t, 0)
        out[f"unfilled_tokens_{t}"] = unfilled.get(t, 0)
        out[f"reset_chunks_{t}"] = stats.reset_chunks
        if not spec.shared:
            out[f"evictions_{t}"] = stats.evictions
            out[f"quota_evictions_{t}"] = stats.quota_evictions
        if not spec.top:
            codec = stats.codec or _NO_CODEC
            out[f"codec_bytes_before_{t}"] = codec.encoded_bytes
            out[f"codec_bytes_after_{t}"] = codec.stored_bytes
            out[f"codec_seconds_{t}"] = codec.encode_seconds + codec.decode_seconds
            out[f"decrypt_failures_{t}"] = codec.decrypt_failures
            if not spec.shared:
                out[f"{t}_write_errors"] = stats.write_errors
        if spec.shared:
            wire = stats.wire or _NO_WIRE
            out[f"{t}_errors"] = sum(wire.errors.values())
            out[f"{t}_skipped_calls"] = sum(wire.skipped_calls.values())
            out[f"{t}_skipped_writes"] = wire.skipped_writes
            out[f"{t}_reads"] = wire.calls.get("read", 0)
            out[f"{t}_read_seconds"] = wire.seconds.get("read", 0.0)
            out[f"{t}_read_bytes"] = wire.bytes.get("read", 0)
    out.update(reloaded_tokens=s.reloaded_tokens, saved_tokens=s.saved_tokens, load_failed_blocks=s.load_failed_blocks,
               rerouted_chunks=s.rerouted_chunks, ttl_pin_chunks=s.ttl_pin_chunks,
               ttl_pin_refused_chunks=s.ttl_pin_refused_chunks, dropped_saves=s.dropped_saves,
               corrupt_chunks=sum(t.corrupt_chunks for t in tiers.values()),
               flush_missed_chunks=s.flush_missed_chunks,
               load_bytes=s.transfer_bytes[f"{top}_to_engine"], load_seconds=s.transfer_seconds[f"{top}_to_engine"],
               save_bytes=s.transfer_bytes[f"engine_to_{top}"], save_seconds=s.transfer_seconds[f"engine_to_{top}"])
    return out


def store_counters(now: StoreStats, before: StoreStats | None, tp_rank: int = 0) -> dict[str, float]:
    """The :func:`store_counter_readers` that changed from ``before`` (``None``: the store's start)
    to ``now``, without the :func:`rank0_only` ones on other ranks than ``tp_rank`` 0.  Reads each
    snapshot once (:func:`store_values`; ``before``'s values are kept from the call that read it
    as ``now``), no call per counter: this runs at every engine step."""
    global _last
    rank0 = _registered()[1] if tp_rank else frozenset()
    last, last_values = _last
    old = {} if before is None else last_values if before is last else store_values(before)
    new = store_values(now)
    _last = (now, new)
    return {name: delta for name, value in new.items()
            if name not in rank0 and (delta := value - old.get(name, 0))}


def store_gauges(s: StoreStats) -> dict[str, float]:
    """The :func:`gauges` of one rank, read from its store's snapshot."""
    out: dict[str, float] = {"dirty_bytes": s.dirty_bytes}
    for spec in _registered()[2]:
        t = spec.name
        stats = s.tiers.get(t) or _NO_TIER
        if spec.shared:
            if stats.wire is not None:
                out[f"{t}_breaker_state"] = stats.wire.breaker_state
            out[f"usage_bytes_{t}"] = stats.used_bytes
            continue
        out.update({f"{TENANT_PREFIX}{t}|{label}": used for label, used in stats.tenant_used_bytes.items()})
        out.update({f"usage_bytes_{t}": stats.used_bytes, f"capacity_bytes_{t}": stats.capacity_bytes,
                    f"pinned_chunks_{t}": stats.pinned_chunks, f"pinned_bytes_{t}": stats.pinned_chunks * s.chunk_bytes})
        if spec.top:
            out.update({f"ttl_pinned_chunks_{t}": stats.ttl_pinned_chunks,
                        f"ttl_pinned_bytes_{t}": stats.ttl_pinned_chunks * s.chunk_bytes})
    return out


def store_report(now: StoreStats, before: StoreStats | None, tp_rank: int = 0) -> tuple[dict[str, float], dict[str, float]]:
    """One step's :func:`store_counters` and :func:`store_gauges` of ``now``, in one call (the worker's report)."""
    return store_counters(now, before, tp_rank), store_gauges(now)
