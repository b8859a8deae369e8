"""An arm over several runs: median and range of each figure, and a verdict that says when a
difference is within noise.

``kvtier bench compare --repeats N`` runs every arm N times, interleaved (A B C A B C ...), because
on a shared machine the arm that runs last gets the quietest machine (measured: two connectors
swapped places when their order was swapped, kvtier issue 9).  Each figure of an arm is then the
median of its N per-run values, reported with its range (lowest and highest run).  A TTFT
difference counts as beyond noise only when the two arms' per-run p50 ranges do not overlap.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.bench.verdict import ArmFigures, Thresholds, Verdict, VerdictKind, judge, no_tokens_verdict

FIGURE_KEYS = ("prefix_hit_rate", "engine_hit_rate", "external_hit_rate", "ttft_p50_s", "ttft_p99_s",
               "output_tok_per_s", "request_per_s", "restart_hit_rate", "restart_ttft_p50_s", "restart_ttft_p99_s",
               "restart_requests", "restart_down_s", "restart_rerouted")
"""Every per-run figure aggregated (the ``restart_*`` ones: :func:`kvtier.bench.restart.restart_figures`)."""


@dataclass(frozen=True)
class Spread:
    """Median, lowest and highest of one figure over ``n`` runs."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        """The spread of ``values`` (``None`` when empty)."""
        if not values:
            return None
        return cls(float(statistics.median(values)), float(min(values)), float(max(values)), len(values))

    def overlaps(self, other: Spread) -> bool:
        """The two ranges share at least one value."""
        return self.low <= other.high and other.low <= self.high

    def range_text(self, fmt: Callable[[float], str]) -> str:
        """``"LOW-HIGH (n=N)"`` with ``fmt`` applied to each end."""
        return f"{fmt(self.low)}-{fmt(self.high)} (n={self.n})"


def spreads(per_run: Sequence[dict[str, float | None]]) -> dict[str, Spread]:
    """Per figure key, the spread of the runs that have it."""
    out: dict[str, Spread] = {}
    for key in FIGURE_KEYS:
        spread = Spread.of([float(v) for run in per_run if (v := run.get(key)) is not None])
        if spread is not None:
            out[key] = spread
    return out


def figures_of(s: dict[str, Spread]) -> ArmFigures | None:
    """The verdict's inputs (medians), if the arm has TTFT figures and a hit rate (a hit rate no run
    could read, 0/0 prompt tokens, is no figure: not 0 %)."""
    if "ttft_p50_s" not in s or "ttft_p99_s" not in s or "prefix_hit_rate" not in s:
        return None
    return ArmFigures(s["prefix_hit_rate"].median, s["ttft_p50_s"].median, s["ttft_p99_s"].median)


def unread_hit_rate(s: dict[str, Spread]) -> bool:
    """Whether the arm's requests were answered (TTFT figures) but no run could read its hit rate
    (the server's prefix-cache counters did not move: ``inconclusive``, not "no reuse")."""
    return "ttft_p50_s" in s and "prefix_hit_rate" not in s


def _ms(x: float) -> str:
    return f"{x * 1000:.0f}"


def judge_spread(arm: dict[str, Spread], baseline: dict[str, Spread] | None,
                 thresholds: Thresholds = Thresholds()) -> Verdict | None:
    """:func:`~kvtier.bench.verdict.judge` on the medians, then the noise check: with several runs a
    "helping" or "hurting" TTFT verdict stands only if the two TTFT p50 ranges do not overlap (for a p99 tail
    blow-up: the two p99 ranges), else it becomes ``unjudged`` ("within noise"); the reason names
    the number of runs and the ranges compared."""
    if unread_hit_rate(arm):
        return no_tokens_verdict()
    figures = figures_of(arm)
    if figures is None:
        return None
    base_figures = figures_of(baseline) if baseline is not None else None
    verdict = judge(figures, base_figures, thresholds)
    p50 = arm["ttft_p50_s"]
    if baseline is None or base_figures is None or verdict.kind not in (VerdictKind.HELPING, VerdictKind.HURTING):
        return verdict
    base_p50 = baseline["ttft_p50_s"]
    ranges = (f"TTFT p50 per run {p50.range_text(_ms)} ms vs baseline {base_p50.range_text(_ms)} ms")
    if p50.n < 2 or base_p50.n < 2:
        return dataclasses.replace(verdict, reason=f"{verdict.reason}; one run per arm, so the noise is not "
                                   "measured (use --repeats 3)")
    if verdict.kind is VerdictKind.HURTING and "tail" in verdict.reason:
        # a tail blow-up is a p99 verdict: it stands only if the p99 ranges do not overlap
        p99, base_p99 = arm["ttft_p99_s"], baseline["ttft_p99_s"]
        tails = f"TTFT p99 per run {p99.range_text(_ms)} ms vs baseline {base_p99.range_text(_ms)} ms"
        if p99.overlaps(base_p99):
            return Verdict(VerdictKind.UNJUDGED, f"{verdict.reason}, but within noise: {tails} overlap")
        return dataclasses.replace(verdict, reason=f"{verdict.reason}; beyond noise: {tails} do not overlap")
    if p50.overlaps(base_p50):
        return Verdict(VerdictKind.UNJUDGED, f"{verdict.reason}, but within noise: {ranges} overlap")
    return dataclasses.replace(verdict, reason=f"{verdict.reason}; beyond noise: {ranges} do not overlap")
