"""Is the cache helping?  The three operator meters, in order (after the how-to "How to Actually
Configure vLLM's KV-Cache Offloading", dreaming.press 2026, and vLLM's own validation advice):

1. prefix hit rate: is anything reused?  Near zero means offload cannot help: **no reuse**.
2. TTFT p50 against the baseline: does the reuse save prefill?  Hit rate up and p50 down is
   **helping**; hit rate up but p50 not down means the copy cost eats the savings: **hurting**.
3. TTFT p99 against the baseline: is the miss tail bounded?  A p99 blow-up is **hurting**, whatever
   the median says.

A hurting verdict says so when the baseline's TTFT p50 is under ``Thresholds.small_prefill_s``:
there is then little prefill for any cache to save (a test model of a few layers, or short
prompts), so the fixed cost of a lookup and copy per request decides, which says little about a
real model; the reason points to a model whose prefill costs more (the test model's
``--geometry mid``).

Without a baseline only meter 1 can be read, so an arm that reuses is ``unjudged``.  The baseline
arm itself is the ``reference``.  When the server's prefix-cache counters did not move over the
run (0 prompt tokens counted), meter 1 cannot be read at all: ``inconclusive`` (as ``kvtier doctor``
says of the same scrapes), never ``no reuse``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class VerdictKind(str, enum.Enum):
    """The verdict of one arm."""

    HELPING = "helping"
    HURTING = "hurting"
    NO_REUSE = "no reuse"
    REFERENCE = "reference"
    UNJUDGED = "unjudged"
    INCONCLUSIVE = "inconclusive"




@dataclass(frozen=True)
class Verdict:
    """A verdict and its one-sentence reason."""

    kind: VerdictKind
    reason: str


@dataclass(frozen=True)
class ArmFigures:
    """The figures a verdict reads: hit rate (share of prompt tokens not recomputed, 0..1) and TTFT
    percentiles in seconds."""

    prefix_hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float


@dataclass(frozen=True)
class Thresholds:
    """Where the meters switch.

    Attributes:
        min_hit_rate: below this share of prompt tokens reused, there is no reuse.
        min_hit_gain: the arm's hit rate must beat the baseline's by this much (absolute) to count as up.
        p50_gain: p50 must be at most ``(1 - p50_gain)`` x the baseline's to count as down.
        p99_blowup: p99 above this multiple of the baseline's is a blow-up ...
        p99_slack_s: ... unless it is within this many seconds (noise on tiny latencies).
        small_prefill_s: a baseline TTFT p50 under this is too little prefill for a cache to save
            (kvtier's heuristic: the quick start's tiny model answers a 512-token prompt in ~50 ms on
            2 CPU cores, the 24-layer mid geometry in seconds; docs/quickstart.md).
    """

    min_hit_rate: float = 0.02
    min_hit_gain: float = 0.01
    p50_gain: float = 0.05
    p99_blowup: float = 1.5
    p99_slack_s: float = 0.010
    small_prefill_s: float = 0.100


def no_tokens_verdict() -> Verdict:
    """The verdict of a run whose server counted no prompt tokens between its two scrapes (the hit
    rate is 0/0: unreadable, not zero)."""
    return Verdict(VerdictKind.INCONCLUSIVE, "the server's vllm:prefix_cache_queries did not move between the "
                   "scrapes (0 prompt tokens counted), so the hit rate cannot be read; check that --url is the "
                   "server the requests went to and that it exports vLLM's prefix-cache counters")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def judge(arm: ArmFigures, baseline: ArmFigures | None, thresholds: Thresholds = Thresholds()) -> Verdict:
    """The verdict of ``arm`` against ``baseline`` (``None``: no baseline measured)."""
    verdict = _judge(arm, baseline, thresholds)
    if verdict.kind is VerdictKind.HURTING and baseline is not None and baseline.ttft_p50_s < thresholds.small_prefill_s:
        return Verdict(verdict.kind, f"{verdict.reason}; but the baseline's TTFT p50 is only "
                       f"{baseline.ttft_p50_s * 1000:.0f} ms, too little prefill for a cache to save (a small model "
                       "or short prompts), so the fixed cost of each lookup and copy decides: measure a model whose "
                       "prefill costs more (the test model's --geometry mid) or longer prompts")
    return verdict


def _judge(arm: ArmFigures, baseline: ArmFigures | None, t: Thresholds) -> Verdict:
    if arm.prefix_hit_rate < t.min_hit_rate:
        return Verdict(VerdictKind.NO_REUSE, f"hit rate {_pct(arm.prefix_hit_rate)}: nothing is reused, so a cache "
                       "cannot help; check that prompts share prefixes and prefix caching is on")
    if baseline is None:
        return Verdict(VerdictKind.UNJUDGED, f"hit rate {_pct(arm.prefix_hit_rate)}; without a baseline the TTFT "
                       "meters cannot be read (measure one: `kvtier bench compare` with baseline in --arms)")
    p99_limit = max(baseline.ttft_p99_s * t.p99_blowup, baseline.ttft_p99_s + t.p99_slack_s)
    if arm.ttft_p99_s > p99_limit:
        return Verdict(VerdictKind.HURTING, f"TTFT p99 {arm.ttft_p99_s:.3f} s vs baseline "
                       f"{baseline.ttft_p99_s:.3f} s: the miss tail blew up")
    hit_up = arm.prefix_hit_rate >= baseline.prefix_hit_rate + t.min_hit_gain
    p50_ratio = arm.ttft_p50_s / baseline.ttft_p50_s if baseline.ttft_p50_s > 0 else 1.0
    p50_down = p50_ratio <= 1.0 - t.p50_gain
    hits = f"hit rate {_pct(arm.prefix_hit_rate)} vs {_pct(baseline.prefix_hit_rate)}"
    if hit_up and p50_down:
        return Verdict(VerdictKind.HELPING, f"{hits}, TTFT p50 {p50_ratio:.2f}x baseline, p99 bounded")
    if hit_up:
        return Verdict(VerdictKind.HURTING, f"{hits} but TTFT p50 {p50_ratio:.2f}x baseline: loading costs "
                       "as much as the prefill it saves")
    if p50_ratio > 1.0 + t.p50_gain:
        return Verdict(VerdictKind.HURTING, f"{hits} (no extra reuse) and TTFT p50 {p50_ratio:.2f}x baseline: "
                       "pure overhead")
    return Verdict(VerdictKind.NO_REUSE, f"{hits}: nothing reused beyond the engine's own cache "
                   f"(TTFT p50 {p50_ratio:.2f}x baseline)")


def baseline_verdict(baseline: ArmFigures, others: dict[str, ArmFigures],
                     thresholds: Thresholds = Thresholds()) -> Verdict:
    """The baseline arm's own verdict: the ``reference``, except when it reuses nothing.

    A baseline (the engine alone) that reuses nothing while another arm of the same workload does
    (``others``: arm name -> figures) is no sign of a workload without reuse: the prompts share
    prefixes, the engine's own cache is too small to keep them until they come back, and that is
    what an offload tier is for.  Only when no arm reuses anything is the workload itself said to
    have no reuse (check that prompts share prefixes and prefix caching is on)."""
    if baseline.prefix_hit_rate >= thresholds.min_hit_rate:
        return Verdict(VerdictKind.REFERENCE, "the baseline every other arm is compared with")
    reusing = {name: f for name, f in others.items() if f.prefix_hit_rate >= thresholds.min_hit_rate}
    if not reusing:
        return judge(baseline, None, thresholds)
    best, figures = max(reusing.items(), key=lambda item: item[1].prefix_hit_rate)
    return Verdict(VerdictKind.REFERENCE, f"hit rate {_pct(baseline.prefix_hit_rate)}: the prompts do share prefixes "
                   f"({best} reuses {_pct(figures.prefix_hit_rate)}), but the engine's own cache is too small to keep "
                   "them until they come back; the baseline every other arm is compared with")
