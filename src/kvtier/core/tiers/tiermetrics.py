"""Prometheus metrics of one remote tier (``kvtier_tier_*``, label ``tier``).

The store's own metrics (:mod:`kvtier.core.metrics`) count what the store asked for and got;
these count what the tier did on the wire: lookups and hits, bytes and seconds per direction
(``read``/``write``), call latency by operation, errors, calls skipped (breaker open or the
tier's queue full), chunks whose write was skipped or failed, corrupt values, and the breaker
state (0 closed, 1 half-open, 2 open).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

OPS = ("lookup", "get", "put", "delete")


class TierMetrics:
    """Collectors of one tier, registered in ``registry`` (a fresh one by default)."""

    def __init__(self, tier: str, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.tier = tier
        self.lookups = Counter("kvtier_tier_lookup_keys", "Keys asked about.", ["tier"], registry=r).labels(tier)
        self.hits = Counter("kvtier_tier_lookup_hit_keys", "Keys found.", ["tier"], registry=r).labels(tier)
        self._bytes = Counter("kvtier_tier_bytes", "Payload bytes moved, by direction.", ["tier", "direction"],
                              registry=r)
        self._seconds = Counter("kvtier_tier_seconds", "Seconds spent moving payload bytes, by direction.",
                                ["tier", "direction"], registry=r)
        self._latency = Histogram("kvtier_tier_call_seconds", "Latency of one call or pipelined batch.",
                                 ["tier", "op"], registry=r,
                                 buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0))
        self._errors = Counter("kvtier_tier_errors", "Calls that failed (timeout, connection, server error).",
                              ["tier", "op"], registry=r)
        self._skipped = Counter("kvtier_tier_skipped_calls", "Calls not made: breaker open or queue full.",
                               ["tier", "op"], registry=r)
        self.skipped_writes = Counter("kvtier_tier_skipped_writes", "Chunks not written: breaker open, queue full "
                                      "or the write failed.", ["tier"], registry=r).labels(tier)
        self.corrupt = Counter("kvtier_tier_corrupt_values", "Values that failed verification.", ["tier"],
                               registry=r).labels(tier)
        self.breaker_state = Gauge("kvtier_tier_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.",
                                   ["tier"], registry=r).labels(tier)
        for direction in ("read", "write"):
            self._bytes.labels(tier, direction)
            self._seconds.labels(tier, direction)
        for op in OPS:
            self._errors.labels(tier, op)
            self._skipped.labels(tier, op)

    def observe(self, op: str, seconds: float) -> None:
        """One call of ``op`` took ``seconds``."""
        self._latency.labels(self.tier, op).observe(seconds)

    def error(self, op: str) -> None:
        """One call of ``op`` failed."""
        self._errors.labels(self.tier, op).inc()

    def skip(self, op: str) -> None:
        """One call of ``op`` was not made (breaker open or queue full)."""
        self._skipped.labels(self.tier, op).inc()

    def count(self, name: str, op: str) -> float:
        """Current value of ``errors`` or ``skipped`` for ``op`` (for tests and ``stats``)."""
        collector = self._errors if name == "errors" else self._skipped
        return float(collector.labels(self.tier, op)._value.get())

    def moved(self, direction: str, num_bytes: int, seconds: float) -> None:
        """Account ``num_bytes`` payload bytes moved in ``direction`` taking ``seconds``."""
        self._bytes.labels(self.tier, direction).inc(num_bytes)
        self._seconds.labels(self.tier, direction).inc(max(seconds, 0.0))

    def set_breaker(self, state: int) -> None:
        """Publish the breaker state."""
        self.breaker_state.set(int(state))
