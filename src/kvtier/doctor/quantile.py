"""Quantiles of Prometheus histograms, as ``histogram_quantile`` computes them."""

from __future__ import annotations

import math


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Quantile ``q`` of a cumulative histogram ``le → count`` (Prometheus semantics), None if empty.

    A rank in the +Inf bucket returns the highest finite bound, like Prometheus.
    """
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return None
    total = buckets[math.inf]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == math.inf:
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound  # pragma: no cover - the +Inf bucket always holds the total


def beyond_finite_buckets(q: float, buckets: dict[float, float]) -> bool:
    """Whether quantile ``q``'s rank falls in the +Inf bucket (then :func:`histogram_quantile`
    gives the highest finite bound, a lower bound of the true quantile)."""
    finite = [b for b in buckets if b != math.inf]
    total = buckets.get(math.inf, 0.0)
    return total > 0 and (not finite or buckets[max(finite)] < q * total)
