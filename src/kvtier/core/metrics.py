"""Prometheus metrics of one kvtier store: a view over its :class:`~kvtier.core.stats.StoreStats`.

All names start with ``kvtier_``.  Units follow Prometheus conventions: ``_bytes``, ``_seconds``,
``_total`` for counters.  Label ``tier`` is a registered tier's name (:mod:`kvtier.core.tiers.registry`); label ``direction``
is one of :func:`~kvtier.core.mover.directions`.  Counters and gauges are read from the store's snapshot at
scrape time (nothing is counted here); only the lookup latency histogram and the config info are
kept by this module.  Each store registers into its own :class:`CollectorRegistry` unless one is
passed, so several stores (tests, several TP ranks) never collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.core.codecstats import codec_families
from kvtier.core.ghosts import DISTANCE_BUCKETS_BYTES
from kvtier.core.stats import StoreStats
from kvtier.core.tiers.registry import available_tiers
from kvtier.core.tiers.tiermetrics import wire_families

__all__ = ["StoreMetrics"]


class StoreMetrics(Collector):
    """The collectors of one store.

    Exported (counters get ``_total``):
        kvtier_lookup_chunks / kvtier_lookup_tokens: chunks/tokens asked for by ``lookup``.
        kvtier_lookup_hit_chunks / kvtier_lookup_hit_tokens{tier}: of those, found (by the tier holding them).
        kvtier_load_hit_chunks / kvtier_load_hit_tokens{tier}: chunks/tokens delivered by a successful load.
        kvtier_transfer_bytes{direction}, kvtier_transfer_seconds{direction}: transfer volume and time.
        kvtier_lookup_seconds: histogram of ``lookup`` latency.
        kvtier_evictions{tier}, kvtier_dropped_saves, kvtier_corrupt_chunks{tier}, kvtier_failed_loads.
        kvtier_usage_bytes{tier}, kvtier_capacity_bytes{tier}; kvtier_config (info).
        kvtier_pinned_chunks{tier} / kvtier_pinned_bytes{tier}: chunks held by loads or disk writes in
            flight; zero when idle, so a leak shows.
        kvtier_ttl_pinned_chunks{tier}, kvtier_ttl_pin_refused_chunks: requests' TTL pins held, and
            pins refused past ``pin_max_share``.
        kvtier_dirty_bytes: bytes in DRAM not yet on the disk tier (what a crash would lose).
        kvtier_tenant_usage_bytes{tier, tenant}, kvtier_quota_evictions{tier}: with ``tenant_quotas``, bytes
            per tenant (a 12-hex-digit digest of its cache_salt, at most ``top_tenants`` of them, then
            ``other`` and ``unknown``) and evictions whose victim the quotas chose (:mod:`kvtier.core.quota`).
        kvtier_codec_*{tier}: a lower tier's codec chain (:mod:`kvtier.core.codecstats`).
        kvtier_tier_*{tier}: a remote tier's wire numbers (:func:`~kvtier.core.tiers.tiermetrics.wire_families`).
        kvtier_ghost_hit_distance_bytes{tier}: histogram, per ghost hit (a chunk the tier evicted,
            wanted again while its ghost list remembers it), the bytes the tier evicted in between
            (:mod:`kvtier.core.ghosts`): capacity + a high quantile of it holds the working set.

    Args:
        snapshot: returns the store's current :class:`StoreStats`.
        registry: where to register (a fresh one by default).
    """

    def __init__(self, snapshot: Callable[[], StoreStats], registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._snapshot = snapshot
        r = self.registry
        self.lookup_seconds = Histogram("kvtier_lookup_seconds", "Latency of store lookups.", registry=r,
                                        buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0))
        self.config = Info("kvtier_config", "Effective kvtier configuration.", registry=r)
        self.ghost_distance = Histogram(
            "kvtier_ghost_hit_distance_bytes", ("Bytes a tier evicted between evicting a chunk and that chunk being "
                                                "wanted again (ghost hits), by tier."),
            ["tier"], registry=r, buckets=DISTANCE_BUCKETS_BYTES)
        r.register(self)

    def ghost_hit(self, tier: str, distance_bytes: float) -> None:
        """Observe one ghost hit's distance (:mod:`kvtier.core.ghosts`)."""
        self.ghost_distance.labels(tier).observe(distance_bytes)

    def set_config(self, values: Mapping[str, Any]) -> None:
        """Publish the effective configuration as the ``kvtier_config_info`` labels."""
        self.config.info({k: str(v) for k, v in values.items()})

    def describe(self) -> Iterator[Metric]:
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._snapshot())

    @staticmethod
    def _families(s: StoreStats | None) -> Iterator[Metric]:
        def counter(name: str, doc: str, value: float = 0) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc)
            if s is not None:
                family.add_metric([], value)
            return family

        def by(name: str, doc: str, label: str, values: Mapping[str, float],
               family_cls: type[CounterMetricFamily | GaugeMetricFamily] = CounterMetricFamily) -> Metric:
            family = family_cls(name, doc, labels=[label])
            for key, value in values.items() if s is not None else ():
                family.add_metric([key], value)
            return family

        tiers = s.tiers if s is not None else {}
        all_tiers = {name: s.tier(name) for name in dict.fromkeys((*available_tiers(), *tiers))} if s is not None else {}
        tokens = s.chunk_tokens if s is not None else 0
        yield counter("kvtier_lookup_chunks", "Chunks asked for by lookups.", s.lookup_chunks if s else 0)
        yield counter("kvtier_lookup_tokens", "Tokens asked for by lookups.", s.lookup_chunks * tokens if s else 0)
        yield by("kvtier_lookup_hit_chunks", "Chunks found by lookups, by tier.", "tier",
                 {n: t.lookup_hit_chunks for n, t in all_tiers.items()})
        yield by("kvtier_lookup_hit_tokens", "Tokens found by lookups, by tier.", "tier",
                 {n: t.lookup_hit_chunks * tokens for n, t in all_tiers.items()})
        yield by("kvtier_load_hit_chunks", "Chunks delivered by successful loads, by tier.", "tier",
                 {n: t.load_hit_chunks for n, t in all_tiers.items()})
        yield by("kvtier_load_hit_tokens", "Tokens delivered by successful loads, by tier.", "tier",
                 {n: t.load_hit_chunks * tokens for n, t in all_tiers.items()})
        yield counter("kvtier_failed_loads", "Loads completed with success=False.", s.failed_loads if s else 0)
        yield by("kvtier_transfer_bytes", "Bytes moved, by direction.", "direction",
                 s.transfer_bytes if s else {})
        yield by("kvtier_transfer_seconds", "Seconds spent moving bytes, by direction.", "direction",
                 s.transfer_seconds if s else {})
        yield by("kvtier_evictions", "Chunks evicted, by tier.", "tier", {n: t.evictions for n, t in all_tiers.items()})
        yield counter("kvtier_dropped_saves", "Saves dropped by any tier: no room, a write queue full, a failed write.",
                      s.dropped_saves if s else 0)
        yield by("kvtier_corrupt_chunks", "Chunks that failed verification (served as misses).", "tier",
                 {n: t.corrupt_chunks for n, t in all_tiers.items()})
        yield by("kvtier_write_errors", "Chunk writes that failed in the tier's storage (full or read-only disk).",
                 "tier", {n: t.write_errors for n, t in all_tiers.items()})
        yield by("kvtier_usage_bytes", "Bytes held, by tier.", "tier",
                 {n: t.used_bytes for n, t in tiers.items()}, GaugeMetricFamily)
        yield by("kvtier_capacity_bytes", "Capacity in bytes, by tier.", "tier",
                 {n: t.capacity_bytes for n, t in tiers.items()}, GaugeMetricFamily)
        yield by("kvtier_pinned_chunks", "Chunks pinned by loads or disk writes, by tier.", "tier",
                 {n: t.pinned_chunks for n, t in tiers.items()}, GaugeMetricFamily)
        yield by("kvtier_pinned_bytes", "Bytes of pinned chunks, by tier.", "tier",
                 {n: t.pinned_chunks * s.chunk_bytes for n, t in tiers.items()} if s else {}, GaugeMetricFamily)
        yield by("kvtier_ttl_pinned_chunks", "Chunks pinned by requests with a TTL not yet passed, by tier.", "tier",
                 {n: t.ttl_pinned_chunks for n, t in list(tiers.items())[:1]}, GaugeMetricFamily)  # the top tier
        yield counter("kvtier_ttl_pin_refused_chunks", "TTL pins refused: pin_max_share of the cpu tier was pinned.",
                      s.ttl_pin_refused_chunks if s else 0)
        yield by("kvtier_quota_evictions", "Evictions whose victim the tenant quotas chose, by tier.", "tier",
                 {n: t.quota_evictions for n, t in all_tiers.items()})
        tenants = GaugeMetricFamily("kvtier_tenant_usage_bytes", ("Bytes held per tenant (cache_salt digest; the "
                                    "top_tenants largest, then other and unknown), by tier; with tenant_quotas."),
                                    labels=["tier", "tenant"])
        for n, t in tiers.items():
            for label, used in t.tenant_used_bytes.items():
                tenants.add_metric([n, label], used)
        yield tenants
        dirty = GaugeMetricFamily("kvtier_dirty_bytes", "Bytes held in DRAM but not yet on the disk tier.")
        if s is not None:
            dirty.add_metric([], s.dirty_bytes)
        yield dirty
        yield from wire_families({n: t.wire for n, t in tiers.items() if t.wire is not None} if s is not None else None)
        yield from codec_families({n: t.codec for n, t in tiers.items() if t.codec is not None} if s is not None else None)
