"""The verdict follows the three meters in order: hit rate, TTFT p50, TTFT p99."""

import gzip
from pathlib import Path

import pytest

from kvtier.bench.meters import deltas, parse_metrics
from kvtier.bench.verdict import ArmFigures, VerdictKind, judge

BASE = ArmFigures(prefix_hit_rate=0.05, ttft_p50_s=0.400, ttft_p99_s=0.900)
DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("arm,kind,words", [
    # meter 1: nothing reused
    (ArmFigures(0.005, 0.100, 0.200), VerdictKind.NO_REUSE, "nothing is reused"),
    # meters 1 and 2: more reuse, faster median, bounded tail
    (ArmFigures(0.40, 0.160, 0.950), VerdictKind.HELPING, "TTFT p50 0.40x baseline"),
    # meter 3 overrides a good median: the tail blew up
    (ArmFigures(0.40, 0.150, 1.500), VerdictKind.HURTING, "blew up"),
    # reuse up but no gain: loading costs what it saves
    (ArmFigures(0.40, 0.395, 0.900), VerdictKind.HURTING, "loading costs"),
    # no reuse beyond baseline and slower: pure overhead
    (ArmFigures(0.05, 0.500, 0.950), VerdictKind.HURTING, "pure overhead"),
    # no reuse beyond baseline, same speed
    (ArmFigures(0.052, 0.400, 0.900), VerdictKind.NO_REUSE, "beyond the engine's own cache"),
])
def test_against_a_baseline(arm, kind, words):
    verdict = judge(arm, BASE)
    assert verdict.kind is kind
    assert words in verdict.reason


def test_p99_slack_keeps_millisecond_noise_from_counting_as_a_blowup():
    tiny = ArmFigures(0.05, 0.004, 0.006)
    assert judge(ArmFigures(0.5, 0.002, 0.014), tiny).kind is VerdictKind.HELPING  # +8 ms: noise
    assert judge(ArmFigures(0.5, 0.002, 0.030), tiny).kind is VerdictKind.HURTING


def test_without_baseline_only_the_hit_rate_is_read():
    assert judge(ArmFigures(0.5, 0.1, 0.2), None).kind is VerdictKind.UNJUDGED
    assert "baseline in --arms" in judge(ArmFigures(0.5, 0.1, 0.2), None).reason  # bench compare without one
    assert judge(ArmFigures(0.0, 0.1, 0.2), None).kind is VerdictKind.NO_REUSE


def test_recorded_runs_give_helping_for_kvtier_and_no_reuse_for_baseline():
    def meters(arm):
        texts = [(DATA / f"vllm-0.32-cpu-{arm}-{w}.metrics.txt.gz").read_bytes() for w in ("before", "after")]
        return deltas(*(parse_metrics(gzip.decompress(t).decode()) for t in texts))

    # TTFT figures measured in the same recorded run (client side)
    base = ArmFigures(meters("baseline").prefix_hit_rate, 0.0883, 0.1274)
    kvtier = ArmFigures(meters("kvtier").prefix_hit_rate, 0.0175, 0.0417)
    assert judge(base, None).kind is VerdictKind.NO_REUSE
    assert judge(kvtier, base).kind is VerdictKind.HELPING


def test_hurting_on_a_model_too_small_for_prefill_to_cost_anything_says_so():
    # the quick start's last step on the tiny model: hit rate up, p50 0.97x (baseline ~50 ms)
    small = ArmFigures(0.05, 0.050, 0.080)
    verdict = judge(ArmFigures(0.40, 0.0485, 0.081), small)
    assert verdict.kind is VerdictKind.HURTING and "loading costs" in verdict.reason
    assert "only 50 ms, too little prefill" in verdict.reason and "--geometry mid" in verdict.reason
    # a baseline whose prefill costs something: the same verdict without the note
    assert "too little prefill" not in judge(ArmFigures(0.40, 0.395, 0.900), BASE).reason
    # and no note on a verdict that is not hurting
    assert "too little prefill" not in judge(ArmFigures(0.40, 0.030, 0.081), small).reason


def test_a_baseline_without_reuse_on_a_workload_that_reuses_says_the_engine_cache_is_small():
    """The recorded run: the baseline reuses nothing, kvtier 60%; the baseline's verdict said
    "nothing is reused … check that prompts share prefixes" on a workload built on reuse."""
    from kvtier.bench.verdict import baseline_verdict

    def meters(arm):
        texts = [(DATA / f"vllm-0.32-cpu-{arm}-{w}.metrics.txt.gz").read_bytes() for w in ("before", "after")]
        return deltas(*(parse_metrics(gzip.decompress(t).decode()) for t in texts))

    base = ArmFigures(meters("baseline").prefix_hit_rate, 0.0883, 0.1274)
    kvtier = ArmFigures(meters("kvtier").prefix_hit_rate, 0.0175, 0.0417)
    verdict = baseline_verdict(base, {"kvtier": kvtier})
    assert verdict.kind is VerdictKind.REFERENCE
    assert "check that prompts share prefixes" not in verdict.reason
    assert "the prompts do share prefixes (kvtier reuses" in verdict.reason and "engine's own cache is too small" \
        in verdict.reason
    # no arm reuses anything: the workload itself has no reuse, said as before
    alone = baseline_verdict(base, {"kvtier": ArmFigures(0.0, 0.09, 0.13)})
    assert alone.kind is VerdictKind.NO_REUSE and "check that prompts share prefixes" in alone.reason
    assert baseline_verdict(ArmFigures(0.3, 0.1, 0.2), {}).kind is VerdictKind.REFERENCE
