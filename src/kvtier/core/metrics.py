"""Prometheus metrics of one kvtier store (prometheus_client).

All names start with ``kvtier_``.  Units follow Prometheus conventions: ``_bytes``, ``_seconds``,
``_total`` for counters.  Label ``tier`` is a tier name (``cpu``, ``disk``, ``redis``); label ``direction`` is one of
:data:`DIRECTIONS`.  Each store registers into its own :class:`CollectorRegistry` unless one is
passed, so several stores (tests, several TP ranks) never collide.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

DIRECTIONS = ("engine_to_cpu", "cpu_to_engine", "cpu_to_disk", "disk_to_cpu", "cpu_to_redis", "redis_to_cpu")
TIERS = ("cpu", "disk", "redis")


class StoreMetrics:
    """The collectors of one store.

    Attributes (all prometheus_client collectors):
        lookups_chunks / lookups_tokens: chunks/tokens asked for by ``lookup``.
        lookup_hit_chunks / lookup_hit_tokens{tier}: of those, found (by the tier holding them).
        load_hit_chunks / load_hit_tokens{tier}: chunks/tokens really delivered by a successful load.
        bytes_moved{direction}, seconds_moved{direction}: transfer volume and time.
        lookup_seconds: histogram of ``lookup`` latency.
        evictions{tier}, dropped_saves, corrupt_chunks{tier}, failed_loads.
        usage_bytes{tier}, capacity_bytes{tier}; config (info).
        pinned_chunks{tier} / pinned_bytes{tier}: chunks held by loads or disk writes in flight
            (``cpu``: cpu pages; ``disk``: chunk files being read or written); zero when idle, so
            a leak shows.
        dirty_bytes: bytes in DRAM not yet on the disk tier (what a crash would lose).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.lookups_chunks = Counter("kvtier_lookup_chunks", "Chunks asked for by lookups.", registry=r)
        self.lookups_tokens = Counter("kvtier_lookup_tokens", "Tokens asked for by lookups.", registry=r)
        self.lookup_hit_chunks = Counter("kvtier_lookup_hit_chunks", "Chunks found by lookups, by tier.",
                                         ["tier"], registry=r)
        self.lookup_hit_tokens = Counter("kvtier_lookup_hit_tokens", "Tokens found by lookups, by tier.",
                                         ["tier"], registry=r)
        self.load_hit_chunks = Counter("kvtier_load_hit_chunks", "Chunks delivered by successful loads, by tier.",
                                       ["tier"], registry=r)
        self.load_hit_tokens = Counter("kvtier_load_hit_tokens", "Tokens delivered by successful loads, by tier.",
                                       ["tier"], registry=r)
        self.failed_loads = Counter("kvtier_failed_loads", "Loads completed with success=False.", registry=r)
        self.bytes_moved = Counter("kvtier_transfer_bytes", "Bytes moved, by direction.", ["direction"], registry=r)
        self.seconds_moved = Counter("kvtier_transfer_seconds", "Seconds spent moving bytes, by direction.",
                                     ["direction"], registry=r)
        self.lookup_seconds = Histogram("kvtier_lookup_seconds", "Latency of store lookups.", registry=r,
                                        buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0))
        self.evictions = Counter("kvtier_evictions", "Chunks evicted, by tier.", ["tier"], registry=r)
        self.dropped_saves = Counter("kvtier_dropped_saves", "Saves dropped: no room or the save queue was full.",
                                     registry=r)
        self.corrupt_chunks = Counter("kvtier_corrupt_chunks", "Chunks that failed verification (served as misses).",
                                      ["tier"], registry=r)
        self.usage_bytes = Gauge("kvtier_usage_bytes", "Bytes held, by tier.", ["tier"], registry=r)
        self.capacity_bytes = Gauge("kvtier_capacity_bytes", "Capacity in bytes, by tier.", ["tier"], registry=r)
        self.pinned_chunks = Gauge("kvtier_pinned_chunks", "Chunks pinned by loads or disk writes, by tier.",
                                   ["tier"], registry=r)
        self.pinned_bytes = Gauge("kvtier_pinned_bytes", "Bytes of pinned chunks, by tier.", ["tier"], registry=r)
        self.dirty_bytes = Gauge("kvtier_dirty_bytes", "Bytes held in DRAM but not yet on the disk tier.",
                                 registry=r)
        self.config = Info("kvtier_config", "Effective kvtier configuration.", registry=r)
        for direction in DIRECTIONS:
            self.bytes_moved.labels(direction)
            self.seconds_moved.labels(direction)
        for tier in TIERS:
            for labelled in (self.lookup_hit_chunks, self.lookup_hit_tokens, self.load_hit_chunks,
                             self.load_hit_tokens, self.evictions, self.corrupt_chunks):
                labelled.labels(tier)

    def set_config(self, values: Mapping[str, Any]) -> None:
        """Publish the effective configuration as the ``kvtier_config_info`` labels."""
        self.config.info({k: str(v) for k, v in values.items()})

    def moved(self, direction: str, num_bytes: int, seconds: float) -> None:
        """Account one transfer of ``num_bytes`` bytes taking ``seconds`` seconds."""
        self.bytes_moved.labels(direction).inc(num_bytes)
        self.seconds_moved.labels(direction).inc(max(seconds, 0.0))
