"""Capacity recommendations from a hit-ratio curve.

Two readings of a curve ``hit(capacity)`` measured at a few capacities:

- **enough**: the smallest capacity whose hit ratio reaches ``share`` (95 %) of the hit ratio at
  the largest capacity tried — past it, more RAM buys little;
- **knee**: where the curve bends from "each GiB pays" to "diminishing returns", found with
  Kneedle (Satopää, Albrecht, Irwin, Raghavan, "Finding a 'Kneedle' in a Haystack: Detecting
  Knee Points in System Behavior", ICDCS Workshops 2011): scale both axes to [0, 1] and take the
  point farthest above the chord, i.e. the maximum of ``y_norm - x_norm``.  Capacities are
  usually swept geometrically, so x is taken as log2(capacity) (capacity 0 is left out).  A
  point less than :data:`KNEE_MIN` above the chord is no knee: a curve that is a straight line on
  that axis (the same gain for each doubling) does not bend, whatever its rounding says.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.simulate.cost import Throughputs
    from kvtier.simulate.sweep import SweepRow, SweepSpec
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


KNEE_MIN = 0.05
"""Least height above the chord, in the [0, 1]-scaled units, that counts as a bend (Kneedle's
sensitivity threshold plays this part in the paper)."""


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
    return points[best][0] if diffs[best] > KNEE_MIN else None


@dataclass(frozen=True)
class TierSize:
    """A recommended size for one tier, or why there is none.

    Attributes:
        tier: ``cpu``, ``disk`` or ``shared``.
        gib: the size, GiB; ``None`` when no size is enough (``reason`` says why).
        hit_ratio: token hit ratio of the whole stack with this size (and the tiers above it);
            for ``cpu`` and for lower tiers given on the command line, the very figure of the
            table's row.
        reason: one line.
    """

    tier: str
    gib: float | None
    hit_ratio: float
    reason: str


FLAT = 0.001
"""A curve whose hit ratios span less than this (0.1 point) is flat: more cpu buys nothing."""


def _gib(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:g}"


def _option(values: Sequence[float]) -> str:
    """A --cpu-gib value list (no thousands separators: the list is comma-separated)."""
    return ",".join(f"{v:.0f}" if v >= 10 else f"{v:g}" for v in values)


def cpu_size(curve: Sequence[tuple[float, float]], footprint_gib: float, share: float = 0.95,
             ceiling: float | None = None) -> TierSize:
    """The cpu size read from the table's own curve (``(cpu GiB, token hit ratio)`` of one
    policy, every tier as configured): the knee if the curve bends inside the swept range; else
    the smallest capacity reaching ``share`` of the largest's hit ratio when that is not the
    largest itself; else the largest, saying the curve has no knee inside the range and which
    range to sweep next.  Never a size that is not a row of the table.

    Args:
        curve: swept points, any order, shape ``[k]`` (k >= 1).
        footprint_gib: GiB the trace's distinct chunks take (a tier this large never evicts).
        share: see :func:`recommend`.
        ceiling: hit ratio of a cache that never evicts, if known: a curve that reaches it (within
            0.1 point) is read as done there, not as still rising.

    Raises:
        ValueError: empty curve.
    """
    points = sorted(curve)
    rec = recommend([g for g, _ in points], [h for _, h in points], share)
    lo, hi = points[0][0], points[-1][0]
    hit = dict(points)
    span = f"{_gib(lo)}–{_gib(hi)} GiB"
    if len(points) > 1 and max(hit.values()) - min(hit.values()) < FLAT:
        gib = lo
        wider = sorted({v for v in (lo / 16, lo, hi, min(hi * 16, footprint_gib)) if v > 0})
        reason = (f"the curve is flat over {span} (within 0.1 point): the smallest swept does as well as the "
                  f"largest; sweep a wider range (e.g. --cpu-gib {_option(wider)}) to find where it bends")
    elif ceiling is not None and hit[hi] >= ceiling - FLAT:
        gib = next(g for g, h in points if h >= ceiling - FLAT)
        reason = "the smallest swept where the stack reaches the ceiling"
        if gib == lo and lo > 0:
            reason += f" (the smallest swept: try --cpu-gib {_option([lo / 16, lo / 4, lo])} for less)"
    elif rec.knee_gib is not None and rec.knee_gib < hi:
        gib = rec.knee_gib
        reason = "knee of the curve"
    elif rec.enough_gib < hi:
        gib = rec.enough_gib
        reason = f"no knee inside {span}; the smallest swept reaching {share:.0%} of the largest's hit ratio"
    else:
        gib = hi
        if len(points) == 1:
            reason = "the only capacity swept; sweep several (e.g. --cpu-pct 1,2,5,10,20,50,100) to find a knee"
        elif hi >= footprint_gib:
            reason = (f"no knee inside {span}: the hit ratio rises up to the largest, which holds the trace's "
                      f"whole footprint ({_gib(footprint_gib)} GiB); try sizes between {_gib(points[-2][0])} "
                      f"and {_gib(hi)} GiB")
        else:
            nxt = sorted({min(hi * 2**k, footprint_gib) for k in range(4)})
            reason = (f"no knee inside {span}: the hit ratio still rises at the largest swept "
                      f"({hit[points[-2][0]]:.1%} → {hit[hi]:.1%}), so this is a lower bound; sweep "
                      f"--cpu-gib {_option(nxt)} (the footprint is {_gib(footprint_gib)} GiB)")
    return TierSize("cpu", gib, hit[gib], f"{reason}; hits {hit[gib]:.1%}")


def _replay_hits(job: tuple[int, int]) -> float:
    """Token hit ratio of one extra replay ``(cpu chunks, disk chunks)`` (state in ``_EXTRA``)."""
    from kvtier.core.policies import make_policy
    from kvtier.simulate.replay import replay

    cpu, disk = job
    x = _EXTRA
    c = replay(x["trace"], x["engine"], cpu, disk, lambda: make_policy(x["policy"]), x["parents"],
               admission=x["admission"])
    return (c.engine_hits + c.cpu_hits + c.disk_hits + c.shared_hits) * x["trace"].block_tokens / c.prompt_tokens


_EXTRA: dict[str, Any] = {}
"""Shared with forked workers of the extra replays (set before the pool starts, cleared after)."""


def _run_extra(jobs: list[tuple[int, int]], workers: int) -> list[float]:
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    if workers > 1:
        from kvtier.simulate.sweep import replay_map

        return replay_map(_replay_hits, jobs, workers)
    return [_replay_hits(job) for job in jobs]


def advise(trace: Trace, spec: SweepSpec, rows: Sequence[SweepRow], policy: str, rates: Throughputs,
           share: float = 0.95, *, workers: int = 1, say: Callable[[str], None] | None = None,
           disk_elsewhere: str | None = None) -> tuple[float, list[TierSize]]:
    """A size per tier, read from the sweep's own rows of ``policy`` (the replay the table
    shows, every tier as configured).

    cpu: :func:`cpu_size` of the rows' curve, rows with a cpu tier only: kvtier refuses
    ``cpu_gib`` 0 (every chunk passes through the cpu tier), so a swept 0 is left out, and the
    line says so; with only 0 swept there is no cpu size and no lower tier is sized.  A lower
    tier given in ``spec`` (``disk_gib``, ``shared_gib`` > 0) is reported at the size given,
    with its share of the hits in the chosen row: it was part of every row, so the table already
    measured it.  With no lower tier given, a disk tier is sized by extra replays (cpu at its
    recommended size; said so in the line, and announced through ``say`` before they run): the
    smallest of ``2 × cpu``, ``8 × cpu``, ``32 × cpu``, ... (up to twice the trace's footprint,
    so at most :data:`MAX_EXTRA_REPLAYS`, smallest first, ``workers`` at once, stopping at the first
    enough) that brings the
    whole stack to ``share`` of the *ceiling*, the hit ratio of a cache that never evicts (the
    table's row when one holds the whole footprint, else one more replay).  A shared tier is
    never sized by replay: give ``--shared-gib`` to measure one.

    Args:
        trace, spec: as swept.
        rows: the sweep's rows of ``policy`` (:meth:`SweepResult.curve`), shape ``[k]``, k >= 1.
        policy: eviction policy of every tier.
        rates: bandwidths, to refuse a tier that is slower than recomputing.
        share: see :func:`recommend`.
        workers: processes for the extra replays (0: one per CPU core).
        say: called with one line before any extra replay starts (what runs, how many).
        disk_elsewhere: when set, no disk tier is sized by extra replays; the disk line says this
            (the hierarchy model sizes it: ``kvtier simulate --recommend --host-ram-gib/--nvme-gib``).

    Returns:
        (ceiling token hit ratio, one :class:`TierSize` per tier: cpu first).

    Raises:
        ValueError: no rows.
    """
    from kvtier.simulate.replay import chunk_parents, engine_prefix_hits

    if not rows:
        raise ValueError("advise needs the sweep's rows of the policy")
    footprint = trace.num_unique_chunks
    gib_per_chunk = spec.chunk_bytes / (1 << 30)
    _EXTRA.clear()
    _EXTRA.update(trace=trace, engine=engine_prefix_hits(trace, spec.chunks(spec.engine_gib)), policy=policy,
                  parents=chunk_parents(trace), admission=spec.admission)
    try:
        whole = next((r for r in rows if r.cpu_chunks >= footprint), None)  # never evicts: the ceiling itself
        if whole is not None:
            ceiling = whole.token_hit_ratio
        else:
            if say is not None:
                say(f"one extra replay (cpu {_gib(footprint * gib_per_chunk)} GiB, the whole footprint) for the "
                    f"ceiling ...")
            ceiling = _run_extra([(footprint, 0)], 1)[0]
        sizes = _sizes(trace, spec, rows, rates, share, ceiling, workers, None if disk_elsewhere else say,
                       disk_elsewhere)
        return ceiling, sizes
    finally:
        _EXTRA.clear()


def _engine_alone(spec: SweepSpec, rows: Sequence[SweepRow], share: float, ceiling: float) -> list[TierSize] | None:
    """No tier at all when the engine's own prefix cache (its share is the same in every row) already
    reaches ``share`` of the ceiling: what ``kvtier size`` calls 'offload not needed' (the warm set fits in
    the engine's KV cache).  Before, the cpu line named the smallest swept size of a flat curve, with the
    engine's hits as its own and a wider sweep to find a bend that no size has."""
    engine = rows[0].tier_token_hit_ratio("engine")
    if engine < share * ceiling:
        return None
    if ceiling <= 0:
        why = ("no prompt token of this trace can be served from any cache (ceiling 0.0%: no whole chunk is "
               "used twice before a prompt's last token)")
    else:
        why = (f"the engine's own prefix cache ({_gib(spec.engine_gib)} GiB) already hits {engine:.1%}, "
               f"≥ {share:.0%} of the {ceiling:.1%} ceiling: offload not needed, as kvtier size says when the "
               "warm set fits in the engine's KV cache")
    lower = [t for t, g in (("disk", spec.disk_gib), ("shared", spec.shared_gib)) if g > 0] or ["disk"]
    return [TierSize("cpu", None, engine, f"not needed: {why}"),
            *(TierSize(t, None, engine, "not needed either") for t in lower)]


MAX_EXTRA_REPLAYS = 12
"""Extra replays that size a disk tier, at most (2, 8, 32, ... × cpu: 4^12 is far past any trace)."""


def _sizes(trace: Trace, spec: SweepSpec, rows: Sequence[SweepRow], rates: Throughputs, share: float,
           ceiling: float, workers: int, say: Callable[[str], None] | None,
           disk_elsewhere: str | None = None) -> list[TierSize]:
    footprint = trace.num_unique_chunks
    gib_per_chunk = spec.chunk_bytes / (1 << 30)
    if (alone := _engine_alone(spec, rows, share, ceiling)) is not None:
        return alone
    # kvtier refuses cpu_gib 0 and fails at start-up with a cpu tier too small for one chunk (every
    # chunk passes through it): such rows are measured but never recommended
    usable = [r for r in rows if r.cpu_chunks >= 1]
    if not usable and any(r.cpu_gib > 0 for r in rows):
        return [TierSize("cpu", None, rows[0].token_hit_ratio,
                         f"every size swept holds less than one {_gib(gib_per_chunk)} GiB chunk, which kvtier "
                         "refuses (every chunk passes through the cpu tier); sweep larger sizes, e.g. "
                         "--cpu-pct 1,2,5,10,20,50,100")]
    if not usable:
        return [TierSize("cpu", None, rows[0].token_hit_ratio,
                         "only 0 GiB swept, which kvtier refuses (cpu_gib must be above 0: every chunk passes "
                         "through the cpu tier); sweep sizes above 0, e.g. --cpu-pct 1,2,5,10,20,50,100")]
    cpu = cpu_size([(r.cpu_gib, r.token_hit_ratio) for r in usable], footprint * gib_per_chunk, share, ceiling)
    left = sorted({r.cpu_gib for r in rows if r.cpu_chunks < 1})
    if left:
        why = ("the swept 0 GiB is left out: kvtier refuses cpu_gib 0" if left == [0] else
               f"the swept {_option(left)} GiB are left out: kvtier refuses a cpu tier smaller than one "
               f"{_gib(gib_per_chunk)} GiB chunk")
        cpu = TierSize("cpu", cpu.gib, cpu.hit_ratio, f"{cpu.reason} ({why})")
    sizes = [cpu]
    row = next(r for r in usable if r.cpu_gib == cpu.gib)
    given = [(t, g) for t, g in (("disk", spec.disk_gib), ("shared", spec.shared_gib)) if g > 0]
    if given:
        for tier, gib in given:
            sizes.append(TierSize(tier, gib, row.token_hit_ratio,
                                  f"as given (in every row); serves {row.tier_token_hit_ratio(tier):.1%} "
                                  f"of prompt tokens at cpu {_gib(row.cpu_gib)} GiB"))
        return sizes
    best = row.token_hit_ratio
    if disk_elsewhere is not None:
        sizes.append(TierSize("disk", None, best, disk_elsewhere))
        return sizes
    from kvtier.simulate.hierarchy import disk_slower_than_prefill

    slower = disk_slower_than_prefill(spec.chunk_bytes / trace.block_tokens, rates)
    if slower is not None:
        sizes.append(TierSize("disk", None, best, slower))
        return sizes
    target = share * ceiling
    if best >= target:
        sizes.append(TierSize("disk", None, best, f"not needed: the cpu tier already hits {best:.1%}"))
        return sizes
    cpu_chunks = spec.chunks(row.cpu_gib)
    trials = [max(cpu_chunks, 1) * 2]
    while trials[-1] < 2 * footprint and len(trials) < MAX_EXTRA_REPLAYS:
        trials.append(trials[-1] * 4)
    if say is not None:
        say(f"sizing a disk tier: up to {len(trials)} extra replays (cpu {_gib(row.cpu_gib)} GiB, disk "
            f"{_gib(trials[0] * gib_per_chunk)}–{_gib(trials[-1] * gib_per_chunk)} GiB, smallest first, stopping at "
            f"the first enough), each about as long as one row of the table ...")
    batch = max(1, min(workers or os.cpu_count() or 1, len(trials)))
    for start in range(0, len(trials), batch):  # smallest first, `batch` at once; stop at the first enough
        chunk_list = trials[start:start + batch]
        ratios = _run_extra([(cpu_chunks, chunks) for chunks in chunk_list], batch)
        for chunks, ratio in zip(chunk_list, ratios):
            if ratio >= target:
                sizes.append(TierSize("disk", chunks * gib_per_chunk, ratio,
                                      f"extra replay with cpu {_gib(row.cpu_gib)} GiB (not in the table): the "
                                      f"stack then hits {ratio:.1%} (≥ {share:.0%} of the ceiling)"))
                return sizes
        best = max([best, *ratios])
    sizes.append(TierSize("disk", None, best, f"none is enough: {trials[-1] * gib_per_chunk:,.0f} GiB hits "
                                              f"{best:.1%} < {share:.0%} of the ceiling (extra replays)"))
    return sizes
