"""Prometheus view of a remote tier (``kvtier_tier_*``, label ``tier``).

The store's own metrics (:mod:`kvtier.core.metrics`) count what the store asked for and got;
these show what the tier did on the wire: lookups and hits, bytes and seconds per direction
(``read``/``write``), errors and calls skipped (breaker open or the tier's queue full) by
operation, chunks whose write was skipped or failed, corrupt values, and the breaker state (0
closed, 1 half-open, 2 open).  The counters live in the tier's
:class:`~kvtier.core.stats.WireCounters` and reach Prometheus through the store's snapshot
(:func:`wire_families`, called by :class:`~kvtier.core.metrics.StoreMetrics`); only the call
latency histogram is kept here.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.core.stats import OPS, WireStats

__all__ = ["OPS", "TierMetrics", "wire_families"]


_HISTOGRAMS: weakref.WeakKeyDictionary[CollectorRegistry, Histogram] = weakref.WeakKeyDictionary()
_HISTOGRAMS_LOCK = threading.Lock()


def _latency_histogram(registry: CollectorRegistry) -> Histogram:
    """The one ``kvtier_tier_call_seconds`` histogram of ``registry``: every remote tier of a store
    (redis and s3 side by side) observes into it under its own ``tier`` label; registering the
    family twice in one registry is an error (prometheus_client: "Duplicated timeseries")."""
    with _HISTOGRAMS_LOCK:
        histogram = _HISTOGRAMS.get(registry)
        if histogram is None:
            histogram = Histogram("kvtier_tier_call_seconds", "Latency of one call or pipelined batch.",
                                  ["tier", "op"], registry=registry,
                                  buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0))
            _HISTOGRAMS[registry] = histogram
        return histogram


class TierMetrics:
    """The call latency histogram of one tier (``kvtier_tier_call_seconds{tier, op}``), registered in
    ``registry`` (a fresh one by default) and shared with the registry's other remote tiers."""

    def __init__(self, tier: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.tier = tier
        self._latency = _latency_histogram(self.registry)

    def observe(self, op: str, seconds: float) -> None:
        """One call of ``op`` took ``seconds``."""
        self._latency.labels(self.tier, op).observe(seconds)


def wire_families(wires: Mapping[str, WireStats] | None) -> Iterator[Metric]:
    """The ``kvtier_tier_*`` families of the remote tiers in ``wires`` (tier name -> its numbers);
    ``None``: the families without samples (Prometheus ``describe``)."""
    tiers = wires or {}

    def family(name: str, doc: str, read: str, labels: tuple[str, ...] = (),
               cls: type[CounterMetricFamily | GaugeMetricFamily] = CounterMetricFamily) -> Metric:
        fam = cls(name, doc, labels=["tier", *labels])
        for tier, w in tiers.items():
            value = getattr(w, read)
            if labels:
                for label, v in value.items():
                    fam.add_metric([tier, label], v)
            else:
                fam.add_metric([tier], value)
        return fam

    yield family("kvtier_tier_lookup_keys", "Keys asked about.", "lookup_keys")
    yield family("kvtier_tier_lookup_hit_keys", "Keys found.", "lookup_hit_keys")
    yield family("kvtier_tier_bytes", "Payload bytes moved, by direction.", "bytes", ("direction",))
    yield family("kvtier_tier_seconds", "Seconds spent moving payload bytes, by direction.", "seconds", ("direction",))
    yield family("kvtier_tier_errors", "Calls that failed (timeout, connection, server error).", "errors", ("op",))
    yield family("kvtier_tier_skipped_calls", "Calls not made: breaker open or queue full.", "skipped_calls", ("op",))
    yield family("kvtier_tier_skipped_writes", "Chunks not written: breaker open, queue full or the write failed.",
                 "skipped_writes")
    yield family("kvtier_tier_corrupt_values", "Values that failed verification.", "corrupt_values")
    yield family("kvtier_tier_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.", "breaker_state",
                 cls=GaugeMetricFamily)

