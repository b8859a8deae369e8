"""One scrape of a vLLM server's ``/metrics``, reduced to what the doctor reads.

Parsed with :mod:`prometheus_client.parser` (never by hand).  Metric names are vLLM 0.32's
(``vllm/v1/metrics/loggers.py``): counters ``vllm:prefix_cache_queries``/``_hits`` and
``vllm:external_prefix_cache_queries``/``_hits`` (tokens; exposed with ``_total``), the histogram
``vllm:time_to_first_token_seconds``, and the info gauge ``vllm:cache_config_info`` whose labels
are every ``CacheConfig`` field (``kv_offloading_size`` in GiB, total across TP; ``None`` when
unset).  kvtier's connector adds ``kvtier_capacity_bytes{tier}`` (summed over ranks) and, with the
shared tiers, :data:`SHARED` (the scheduler's lookups) and per tier :data:`TIER_SERIES`
(the workers' faults, reads, breaker;
src/kvtier/integrations/vllm/stats.py).  Values of several engines (data parallel) are summed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.errors import UserError
from kvtier.doctor.causes import CauseSeries, cause_series
from kvtier.doctor.faults import FaultSeries, fault_series
from kvtier.tools.scrape import metric_families

COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
            "vllm:external_prefix_cache_hits")
TTFT = "vllm:time_to_first_token_seconds"
CACHE_INFO = "vllm:cache_config_info"
KVTIER_CAPACITY = "kvtier_capacity_bytes"
KVTIER_USAGE = "kvtier_usage_bytes"
KVTIER_LOADED = "kvtier_loaded_tokens"
SHARED = ("kvtier_shared_lookup_chunks", "kvtier_shared_lookup_hit_chunks", "kvtier_shared_lookups_timed_out",
          "kvtier_shared_lookups_skipped")
"""The scheduler's shared-tier lookups (counters, ``_total``): it asks the first shared tier of ``tiers``."""
TIER_BREAKER = re.compile(r"kvtier_([a-z0-9_]+)_breaker_state")
"""A shared tier's breaker gauge, ``kvtier_<tier>_breaker_state`` (src/kvtier/integrations/vllm/stats.py
exports one per registered shared tier whose workers have it): its presence names the tier."""
TIER_SERIES = ("errors", "skipped_calls", "skipped_writes", "reads", "read_seconds", "read_bytes", "breaker_state")
"""Each shared tier's own series, ``kvtier_<tier>_<name>`` (counters with ``_total``, the breaker gauge)."""
PINS = ("kvtier_ttl_pinned_chunks", "kvtier_ttl_pinned_bytes", "kvtier_ttl_pin_refused_chunks")
"""Requests' TTL pins (docs/vllm.md "Pinning a prefix"): the cpu tier's pinned chunks and bytes
(gauges, summed over ranks) and pins refused past ``pin_max_share`` (a counter, ``_total``)."""
SETTINGS = ("kvtier_kv_events_enabled", "kvtier_tenant_quota_default_share", "kvtier_tenant_quota_salts",
            "kvtier_tenant_quota_no_salt_share")
"""What the operator turned on (docs/vllm.md "Tenant quotas", "KV events"): KV events (1/0) and the
tenant quotas' default share, listed salts and the share of requests without a salt (0 when no
default share / no salts / no such share; an older kvtier sends no no-salt gauge), gauges each
engine's scheduler sends once.  Settings, not counters: every engine's value is kept (never summed)."""
CONTROLS = ("kvtier_quota_evictions",)
"""Evictions whose victim the quotas chose (a counter, ``_total``, summed over tiers and engines)."""
TENANTS = "kvtier_tenant_usage_bytes"
"""Bytes per tenant label (a ``cache_salt`` digest, ``no-salt``, ``other``, ``unknown``) and tier."""


@dataclass
class Snapshot:
    """Counters (summed over engines), TTFT cumulative buckets ``le → count``, cache-config labels,
    and per kvtier tier (``tier → value``, empty when kvtier is not the connector): capacity and
    usage in bytes, and the tokens loaded from that tier into the engine (a counter)."""

    counters: dict[str, float] = field(default_factory=dict)
    ttft_buckets: dict[float, float] = field(default_factory=dict)
    cache_config: dict[str, str] = field(default_factory=dict)
    kvtier_capacity: dict[str, float] = field(default_factory=dict)
    kvtier_usage: dict[str, float] = field(default_factory=dict)
    kvtier_loaded: dict[str, float] = field(default_factory=dict)
    shared: dict[str, float] = field(default_factory=dict)
    """The scheduler's :data:`SHARED` lookup values by name (empty without a shared tier)."""
    pins: dict[str, float] = field(default_factory=dict)
    """The :data:`PINS` values by name (empty on a kvtier older than pins, or another connector)."""
    tiers_wire: dict[str, dict[str, float]] = field(default_factory=dict)
    """Each shared tier's :data:`TIER_SERIES` values (``tier → name → value``), for every tier whose
    breaker gauge the scrape has (``kvtier_<tier>_breaker_state``); summed over ranks."""
    controls: dict[str, float] = field(default_factory=dict)
    """The :data:`CONTROLS` values by name (empty on an older kvtier, or before its first step)."""
    settings: dict[str, list[float]] = field(default_factory=dict)
    """The :data:`SETTINGS` values by name, one per series (engine), as sent: NaN and infinities kept
    so the doctor can call them impossible (empty on an older kvtier, or before its first step)."""
    tenants: dict[str, float] = field(default_factory=dict)
    """:data:`TENANTS`: bytes per tenant label, summed over tiers and ranks (empty without quotas)."""
    causes: CauseSeries = field(default_factory=CauseSeries)
    """The requests' receipt series (miss reasons, tokens served, ghost-hit distances) and vLLM's
    prefill time (:mod:`kvtier.doctor.causes`); ``present`` False on an older kvtier."""
    faults: FaultSeries = field(default_factory=FaultSeries)
    """The local tiers' failed writes, dropped saves and corrupt chunks (:mod:`kvtier.doctor.faults`)."""
    process_start_s: float | None = None
    """``process_start_time_seconds`` of the scraped process (prometheus_client's process collector),
    Unix seconds; ``None`` when the page has none."""

    @property
    def has_shared_tier(self) -> bool:
        return bool(self.tiers_wire)

    def counter(self, name: str) -> float:
        return self.counters.get(name, 0.0)


def parse_metrics(text: str, where: str, from_file: bool = False) -> Snapshot:
    """Parse Prometheus exposition ``text`` from ``where`` (a URL, or with ``from_file`` a recorded file).

    Raises:
        UserError: the text is not Prometheus format; has no vLLM prefix-cache samples (a family
            with only HELP/TYPE lines counts as missing); a counter or TTFT bucket is NaN, infinite or
            negative; or hits exceed queries (both impossible in a real vLLM scrape).
    """
    snap = Snapshot()
    families = metric_families(text, where, from_file)
    for family in families:
        if family.name in COUNTERS or family.name == TTFT:
            for sample in family.samples:
                if not math.isfinite(sample.value) or sample.value < 0:
                    raise UserError(f"{where} has {sample.name} = {sample.value}, impossible for a counter; "
                                    "the scrape is corrupt.")
        if family.name in COUNTERS:
            totals = [s.value for s in family.samples if s.name.endswith("_total")]
            if not totals:
                continue  # HELP/TYPE without samples: treated as absent
            total = sum(totals)
            snap.counters[family.name] = snap.counters.get(family.name, 0.0) + total
        elif family.name == TTFT:
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])  # "+Inf" parses to inf
                    snap.ttft_buckets[le] = snap.ttft_buckets.get(le, 0.0) + sample.value
        elif family.name == "process_start_time_seconds" and family.samples and snap.process_start_s is None:
            snap.process_start_s = family.samples[0].value
        elif family.name == CACHE_INFO and not snap.cache_config:
            for sample in family.samples:
                snap.cache_config = {k: v for k, v in sample.labels.items()}
                break
        elif family.name == TENANTS:
            for sample in family.samples:
                if math.isfinite(sample.value) and sample.value >= 0:
                    label = sample.labels.get("tenant", "?")
                    snap.tenants[label] = snap.tenants.get(label, 0.0) + sample.value
        elif family.name in SETTINGS:
            values = [s.value for s in family.samples if not s.name.endswith("_created")]
            if values:
                snap.settings.setdefault(family.name, []).extend(values)
        elif family.name in SHARED or family.name in PINS or family.name in CONTROLS:
            into = snap.shared if family.name in SHARED else snap.pins if family.name in PINS else snap.controls
            values = [s.value for s in family.samples
                      if not s.name.endswith("_created") and math.isfinite(s.value) and s.value >= 0]
            if values:
                into[family.name] = into.get(family.name, 0.0) + sum(values)
        elif family.name in (KVTIER_CAPACITY, KVTIER_USAGE, KVTIER_LOADED):
            into = {KVTIER_CAPACITY: snap.kvtier_capacity, KVTIER_USAGE: snap.kvtier_usage,
                    KVTIER_LOADED: snap.kvtier_loaded}[family.name]
            for sample in family.samples:
                if sample.name.endswith("_created") or not math.isfinite(sample.value):
                    continue
                tier = sample.labels.get("tier", "?")
                into[tier] = into.get(tier, 0.0) + sample.value
    _tier_series(snap, families)
    snap.causes = cause_series(families)
    snap.faults = fault_series(families)
    if "vllm:prefix_cache_queries" not in snap.counters:
        fix = ("record it from a vLLM server with curl -s http://HOST:PORT/metrics > FILE" if from_file
               else "point --url at a vLLM server")
        raise UserError(f"{where} has no vllm:prefix_cache_queries samples (vLLM's counter "
                        f"vllm:prefix_cache_queries_total), so it is not a vLLM /metrics page; {fix}.")
    for prefix in ("vllm:", "vllm:external_"):
        hits, queries = snap.counter(f"{prefix}prefix_cache_hits"), snap.counter(f"{prefix}prefix_cache_queries")
        if hits > queries:
            raise UserError(f"{where} has {prefix}prefix_cache_hits {hits:g} > queries {queries:g}, "
                            "which vLLM cannot report; the scrape is corrupt.")
    if snap.ttft_buckets and math.inf not in snap.ttft_buckets:
        raise UserError(f"{where} has a TTFT histogram without its +Inf bucket; the scrape looks truncated.")
    return snap


def _tier_series(snap: Snapshot, families: list[Any]) -> None:
    """Fill :attr:`Snapshot.tiers_wire` (the tiers come from the breaker gauges the scrape holds,
    so a tier registered by a plug-in is read like a built-in one)."""
    by_name = {f.name: f for f in families}
    for name in by_name:
        found = TIER_BREAKER.fullmatch(name)
        if found is None or found.group(1) == "tier":  # kvtier_tier_breaker_state{tier}: a store's own registry
            continue
        tier = found.group(1)
        values: dict[str, float] = {}
        for series in TIER_SERIES:
            family = by_name.get(f"kvtier_{tier}_{series}")
            if family is None:
                continue
            numbers = [s.value for s in family.samples
                       if not s.name.endswith("_created") and math.isfinite(s.value) and s.value >= 0]
            if numbers:
                values[series] = sum(numbers)
        if "breaker_state" not in values:  # the family without a sample: the tier is not configured
            continue  # (its labelled gauge is set only by an engine whose store has it, stats.py store_gauges)
        snap.tiers_wire[tier] = values
