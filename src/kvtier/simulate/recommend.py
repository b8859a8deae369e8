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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.simulate.cost import Throughputs
    from kvtier.simulate.sweep import SweepSpec
    from kvtier.simulate.trace import Trace


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


@dataclass(frozen=True)
class TierSize:
    """A recommended size for one tier, or why there is none.

    Attributes:
        tier: ``cpu``, ``disk`` or ``shared``.
        gib: the size, GiB; ``None`` when no size is enough (``reason`` says why).
        hit_ratio: token hit ratio of the whole stack with this size (and the tiers above it).
        reason: one line.
    """

    tier: str
    gib: float | None
    hit_ratio: float
    reason: str


def size_tiers(trace: Trace, spec: SweepSpec, cpu_curve: Sequence[tuple[float, float]], policy: str,
               rates: Throughputs, lower: Sequence[str], share: float = 0.95) -> tuple[float, list[TierSize]]:
    """A concrete size per tier: cpu from its swept curve (the knee, else the smallest capacity
    reaching ``share`` of the largest), then each lower tier in order, with the tiers above at
    their recommended size: the smallest of ``cpu × 2^k`` (k = 1, 3, 5, ... up to twice the
    trace's footprint) that brings the whole stack to ``share`` of the *ceiling*, the hit ratio of
    a cache that never evicts.

    Args:
        trace, spec: as swept (chunk size, engine tier, admission).
        cpu_curve: ``(cpu GiB, token hit ratio)`` of ``policy`` from the sweep; when the sweep had
            disk or shared tiers, the cpu tier's own curve is replayed here from its capacities.
        policy: eviction policy of every tier.
        rates: bandwidths, to refuse a tier that is slower than recomputing.
        lower: lower tiers to size, in lookup order (``disk``, ``shared``).

    Returns:
        (ceiling token hit ratio, one :class:`TierSize` per tier: cpu first).
    """
    from kvtier.core.policies import make_policy
    from kvtier.simulate.replay import chunk_parents, engine_prefix_hits, replay

    parents = chunk_parents(trace)
    engine = engine_prefix_hits(trace, spec.chunks(spec.engine_gib))
    footprint = trace.num_unique_chunks
    gib_per_chunk = spec.chunk_bytes / (1 << 30)

    def hit(cpu: int, disk: int = 0, shared: int = 0) -> float:
        c = replay(trace, engine, cpu, disk, lambda: make_policy(policy), parents, shared_chunks=shared,
                   admission=spec.admission)
        return (c.engine_hits + c.cpu_hits + c.disk_hits + c.shared_hits) * trace.block_tokens / c.prompt_tokens

    ceiling = hit(footprint)
    if spec.disk_gib > 0 or spec.shared_gib > 0:
        # the swept curve is the whole stack's (with the disk/shared tiers given); the cpu size and
        # each lower tier's "tiers above" must be judged on the cpu tier alone, else a lower tier
        # that does the work is called "not needed"
        cpu_curve = [(gib, hit(spec.chunks(gib))) for gib, _ in cpu_curve]
    rec = recommend([g for g, _ in cpu_curve], [h for _, h in cpu_curve], share)
    cpu_gib = rec.knee_gib if rec.knee_gib is not None else rec.enough_gib
    cpu_hit = dict(cpu_curve)[cpu_gib]
    how = "knee of the curve" if rec.knee_gib is not None else f"{share:.0%} of the largest swept"
    sizes = [TierSize("cpu", cpu_gib, cpu_hit, f"{how}; hits {cpu_hit:.1%}")]
    target = share * ceiling
    chosen = {"cpu": spec.chunks(cpu_gib), "disk": 0, "shared": 0}
    best = cpu_hit
    per_token = spec.chunk_bytes / trace.block_tokens
    for tier in lower:
        bandwidth = rates.disk_gb_per_s if tier == "disk" else rates.shared_gb_per_s
        if per_token / (bandwidth * 1e9) + per_token / (rates.cpu_gb_per_s * 1e9) >= 1 / rates.prefill_tokens_per_s:
            sizes.append(TierSize(tier, None, best, f"slower than prefill ({bandwidth:g} GB/s vs "
                                                    f"{rates.prefill_tokens_per_s:,.0f} tok/s)"))
            continue
        if best >= target:
            sizes.append(TierSize(tier, None, best, f"not needed: the tiers above hit {best:.1%}"))
            continue
        found = None
        trials = [max(chosen["cpu"], 1) * 2]
        while trials[-1] < 2 * footprint:
            trials.append(trials[-1] * 4)
        for chunks in trials:
            trial = dict(chosen, **{tier: chunks})
            ratio = hit(trial["cpu"], trial["disk"], trial["shared"])
            if ratio >= target:
                found = (chunks, ratio)
                break
            best = max(best, ratio)
        if found is None:
            sizes.append(TierSize(tier, None, best, f"none is enough: {trials[-1] * gib_per_chunk:,.0f} GiB "
                                                    f"hits {best:.1%} < {share:.0%} of the ceiling"))
            continue
        chosen[tier], best = found
        sizes.append(TierSize(tier, found[0] * gib_per_chunk, best, f"then hits {best:.1%} "
                                                                     f"(≥ {share:.0%} of the ceiling)"))
    return ceiling, sizes
