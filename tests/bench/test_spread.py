"""Figures over several runs: median and range, and verdicts that say when a difference is noise;
the arms ``--arm`` and ``native`` build."""

import pytest

from kvtier.bench.arms import make_arm, parse_custom_arm
from kvtier.bench.spread import Spread, figures_of, judge_spread, spreads, unread_hit_rate
from kvtier.bench.verdict import VerdictKind


def runs(hit, p50s, p99_factor=1.2):
    return spreads([{"prefix_hit_rate": hit, "ttft_p50_s": p, "ttft_p99_s": p * p99_factor} for p in p50s])


def test_spread_is_median_and_range():
    s = Spread.of([0.3, 0.1, 0.2, 0.9])
    assert (s.median, s.low, s.high, s.n) == (pytest.approx(0.25), 0.1, 0.9, 4)
    assert Spread.of([]) is None
    assert s.overlaps(Spread.of([0.85, 2.0])) and not s.overlaps(Spread.of([0.95, 2.0]))
    assert s.range_text(lambda x: f"{x * 1000:.0f}") == "100-900 (n=4)"


def test_faster_only_beyond_noise():
    base = runs(0.0, [1.00, 1.10, 0.95])
    clear = judge_spread(runs(0.6, [0.40, 0.45, 0.42]), base)
    assert clear.kind is VerdictKind.HELPING
    assert "beyond noise" in clear.reason and "400-450 (n=3)" in clear.reason and "950-1100 (n=3)" in clear.reason
    # a median 0.78x the baseline's, but one run of the arm is as slow as the fastest baseline run
    noisy = judge_spread(runs(0.6, [0.70, 0.78, 0.96]), base)
    assert noisy.kind is VerdictKind.UNJUDGED and "within noise" in noisy.reason and "overlap" in noisy.reason
    single = judge_spread(runs(0.6, [0.4]), runs(0.0, [1.0]))
    assert single.kind is VerdictKind.HELPING and "noise is not measured" in single.reason


def test_an_arm_whose_hit_rate_no_run_could_read_is_inconclusive_not_no_reuse():
    """A server whose prefix-cache counters did not move (0/0 prompt tokens: the run's hit rate is
    ``None``) answered its requests: its verdict is ``inconclusive``, never "no reuse" at 0 %, and
    it is no baseline to judge others by."""
    unread = runs(None, [0.40, 0.42, 0.45])
    assert unread_hit_rate(unread) and figures_of(unread) is None
    verdict = judge_spread(unread, runs(0.0, [1.00, 1.10, 0.95]))
    assert verdict.kind is VerdictKind.INCONCLUSIVE and "did not move" in verdict.reason
    # as the baseline of another arm it gives no figures: the arm is judged without one
    judged = judge_spread(runs(0.6, [0.40, 0.45, 0.42]), unread)
    assert judged.kind is VerdictKind.UNJUDGED and "without a baseline" in judged.reason
    # one run that did read it (0 % is a reading) is enough for a figure
    mixed = spreads([{"prefix_hit_rate": None, "ttft_p50_s": 0.4, "ttft_p99_s": 0.5},
                     {"prefix_hit_rate": 0.0, "ttft_p50_s": 0.4, "ttft_p99_s": 0.5}])
    assert not unread_hit_rate(mixed) and figures_of(mixed).prefix_hit_rate == 0.0


def test_a_tail_blowup_stands_even_when_medians_overlap():
    base = runs(0.0, [1.0, 1.1], p99_factor=1.1)
    verdict = judge_spread(runs(0.5, [1.0, 1.05], p99_factor=4.0), base)
    assert verdict.kind is VerdictKind.HURTING and "tail" in verdict.reason
    assert "p99 per run 4000-4200 (n=2)" in verdict.reason and "do not overlap" in verdict.reason


def test_a_tail_blowup_within_noise_is_unjudged():
    # medians say the p99 doubled, but one baseline run's p99 is as high as the arm's lowest
    base = spreads([{"prefix_hit_rate": 0.0, "ttft_p50_s": p, "ttft_p99_s": q}
                    for p, q in ((1.0, 1.1), (1.1, 1.2), (1.05, 9.0))])
    arm = spreads([{"prefix_hit_rate": 0.5, "ttft_p50_s": p, "ttft_p99_s": q}
                   for p, q in ((0.9, 2.5), (1.0, 2.6), (0.95, 2.7))])
    verdict = judge_spread(arm, base)
    assert verdict.kind is VerdictKind.UNJUDGED and "tail" in verdict.reason
    assert "p99 per run 2500-2700 (n=3)" in verdict.reason and "overlap" in verdict.reason


def test_custom_arm_from_json_and_its_errors():
    arm = parse_custom_arm('lm={"kv_connector":"LMCacheConnectorV1","kv_connector_extra_config":{"x":1}}')
    assert arm.name == "lm" and arm.kv_transfer_config == {
        "kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {"x": 1}, "kv_role": "kv_both"}
    for bad, words in (("lm", "NAME=KV_TRANSFER_CONFIG_JSON"), ("lm={nope", "not valid JSON"),
                       ('lm={"kv_role":"kv_both"}', '"kv_connector"'), ('baseline={"kv_connector":"X"}', "baseline"),
                       ('a b={"kv_connector":"X"}', "letters")):
        with pytest.raises(ValueError, match=words):
            parse_custom_arm(bad)


def test_native_arm_has_kvtiers_cpu_tier_and_says_it_is_shimmed(tmp_path):
    import torch

    arm = make_arm("native", tmp_path, {"cpu_gib": 0.5})
    cfg = arm.kv_transfer_config
    assert cfg["kv_connector"] == "OffloadingConnector"
    assert cfg["kv_connector_extra_config"] == {"cpu_bytes_to_use": 1 << 29}
    if not torch.cuda.is_available():
        assert cfg["kv_connector_module_path"] == "kvtier.bench.native_cpu"
        assert "shim" in arm.description
    assert make_arm("kvtier", tmp_path).kv_transfer_config["kv_load_failure_policy"] == "recompute"
