"""Capacity recommendations from a hit-ratio curve.

Two readings of a curve ``hit(capacity)`` measured at a few capacities:

- **enough**: the smallest capacity whose hit ratio reaches ``share`` (95 %) of the hit ratio at
  the largest capacity tried — past it, more RAM buys little;
- **knee**: where the curve bends from "each GiB pays" to "diminishing returns", found with
  Kneedle (Satopää, Albrecht, Irwin, Raghavan, "Finding a 'Kneedle' in a Haystack: Detecting
  Knee Points in System Behavior", ICDCS Workshops 2011): scale both axes to [0, 1] and take the
  point farthest above the chord, i.e. the maximum of ``y_norm - x_norm``.  Capacities are
  usually swept geometrically, so x is taken as log2(capacity) (capacity 0 is left out).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Recommendation:
    """Capacities in GiB; ``knee_gib`` is ``None`` with fewer than 3 positive capacities or a
    flat curve."""

    enough_gib: float
    enough_hit_ratio: float
    largest_hit_ratio: float
    knee_gib: float | None


def recommend(capacities_gib: Sequence[float], hit_ratios: Sequence[float], share: float = 0.95) -> Recommendation:
    """Read a curve (see the module docstring).

    Args:
        capacities_gib: capacities tried, GiB, any order, shape ``[k]`` (k >= 1).
        hit_ratios: hit ratio at each capacity, shape ``[k]``.
        share: fraction of the largest capacity's hit ratio that counts as enough.

    Raises:
        ValueError: empty input or lengths differ.
    """
    if not capacities_gib or len(capacities_gib) != len(hit_ratios):
        raise ValueError("need one hit ratio per capacity, at least one capacity")
    points = sorted(zip(capacities_gib, hit_ratios))
    largest = points[-1][1]
    enough = next((gib, hit) for gib, hit in points if hit >= share * largest)
    return Recommendation(enough[0], enough[1], largest, _knee([p for p in points if p[0] > 0]))


def _knee(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    xs = [math.log2(gib) for gib, _ in points]
    ys = [hit for _, hit in points]
    x_span, y_span = xs[-1] - xs[0], max(ys) - min(ys)
    if x_span <= 0 or y_span <= 0:
        return None
    diffs = [(y - min(ys)) / y_span - (x - xs[0]) / x_span for x, y in zip(xs, ys)]
    best = max(range(len(points)), key=lambda i: diffs[i])
    return points[best][0] if diffs[best] > 0 else None
