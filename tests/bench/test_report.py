"""Reports: --json has exactly the issue's keys; failures are reported, not raised; files are written."""

import gzip
import json
from pathlib import Path

import pytest

from kvtier.bench.arms import make_arm
from kvtier.bench.compare import ArmFailure, ArmOutcome, CompareResult
from kvtier.bench.meters import deltas, parse_metrics
from kvtier.bench.prefix_repetition import prefix_repetition_workload
from kvtier.bench.report import compare_json, print_table, rows, write_reports
from kvtier.bench.results import RequestResult, RunResult
from kvtier.bench.verdict import Verdict, VerdictKind
from kvtier.bench.workload import TokenSpace
from kvtier.launch.serve import ServerSpec

DATA = Path(__file__).parent / "data"
KEYS = {"ttft_p50_s", "ttft_p99_s", "prefix_hit_rate", "external_hit_rate", "output_tok_per_s", "request_per_s",
        "num_requests"}


def recorded_meters(arm):
    texts = [(DATA / f"vllm-0.32-cpu-{arm}-{w}.metrics.txt.gz").read_bytes() for w in ("before", "after")]
    return deltas(*(parse_metrics(gzip.decompress(t).decode()) for t in texts))


def run_of(workload, ttfts):
    results = tuple(RequestResult(r.request_id, r.prompt_len, 4, float(i), t, t + 0.03, (0.01, 0.01, 0.01))
                    for i, (r, t) in enumerate(zip(workload.requests, ttfts)))
    return RunResult(results=results, duration_s=6.0)


@pytest.fixture()
def result(tmp_path):
    w = prefix_repetition_workload(TokenSpace(seed=0, low=100, high=1900), num_requests=12, prefix_len=1536,
                                   suffix_len=64, num_prefixes=3, output_len=4)
    engine = ServerSpec(model="models/tiny", max_model_len=2048, cache_tokens=2048)
    base = ArmOutcome(make_arm("baseline", tmp_path), tmp_path / "baseline.log", 40.0, run_of(w, [0.09] * 12),
                      recorded_meters("baseline"), None, Verdict(VerdictKind.NO_REUSE, "hit rate 0.0%"))
    kv = ArmOutcome(make_arm("kvtier", tmp_path), tmp_path / "kvtier.log", 45.0,
                    run_of(w, [0.09] * 3 + [0.018] * 9), recorded_meters("kvtier"), None,
                    Verdict(VerdictKind.HELPING, "hit rate 72.0% vs 0.0%"))
    failed_run = RunResult(results=tuple(RequestResult(r.request_id, r.prompt_len, 0, 0.0, None, None, (), "boom")
                                         for r in w.requests), duration_s=1.0, aborted="engine exited with code 1",
                           failed_at=("prefix-4",))
    ex = ArmOutcome(make_arm("example", tmp_path), tmp_path / "example.log", 50.0, failed_run, None,
                    ArmFailure("engine exited with code 1", ("prefix-4",), tmp_path / "example.log"))
    return CompareResult(workload=w, engine=engine, outcomes=(base, kv, ex))


def test_json_has_exactly_the_issue_keys_and_lists_failures_apart(result):
    data = compare_json(result)
    assert set(data["arms"]) == {"baseline", "kvtier"}
    for figures in data["arms"].values():
        assert set(figures) == KEYS
        assert isinstance(figures["num_requests"], int)
    assert data["arms"]["kvtier"]["prefix_hit_rate"] == pytest.approx(0.72)
    assert data["arms"]["kvtier"]["external_hit_rate"] == pytest.approx(0.72)
    assert data["arms"]["baseline"]["external_hit_rate"] == 0.0
    assert data["arms"]["kvtier"]["ttft_p50_s"] == pytest.approx(0.018)
    assert data["arms"]["baseline"]["output_tok_per_s"] == pytest.approx(48 / 6.0)
    assert data["failed"]["example"] == {"reason": "engine exited with code 1", "requests": ["prefix-4"],
                                         "log": str(result.outcomes[2].log_path)}


def test_table_rows_carry_ratios_to_baseline(result):
    cells = {r.cells[0]: r.cells for r in rows(result)}
    assert cells["baseline"][4] == "90 ms"
    assert cells["kvtier"][1] == "72.0%"
    assert cells["kvtier"][4] == "18 ms (0.20x)"
    assert cells["kvtier"][5] == "18 ms-18 ms (n=1)" and cells["kvtier"][6] == "72.0%-72.0% (n=1)"
    assert cells["example"][-1] == "FAILED"


def test_files_are_written_and_failures_named(result, tmp_path, capsys):
    paths = write_reports(result, tmp_path / "out", tmp_path / "out" / "c.json", command="kvtier bench compare ...")
    assert paths.plot is not None and paths.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths.markdown.read_text()
    assert "| kvtier | 72.0% |" in md
    assert "FAILED: engine exited with code 1 during request(s) prefix-4" in md
    assert "kvtier bytes moved: load 0.013 GiB, save 0.004 GiB" in md
    assert json.loads(paths.json.read_text()) == json.loads(json.dumps(compare_json(result)))
    print_table(result)
    out = capsys.readouterr().out
    assert "example: engine exited with code 1 during prefix-4; log:" in out


def test_cdf_title_and_legend_agree_with_the_table(tmp_path):
    """Two runs of 12 requests: the title says so (12 requests × 2 runs, pooled), the legend's n
    is the pooled 24 and its p50 is the table's (median of the runs' p50s: 40 ms from runs at
    20 and 60 ms; the pooled values' own p50 would be 40 ms only by chance, here it is 20 ms)."""
    from kvtier.bench.report import cdf_figures

    w = prefix_repetition_workload(TokenSpace(seed=0, low=100, high=1900), num_requests=12, prefix_len=1536,
                                   suffix_len=64, num_prefixes=3, output_len=4)
    arm = make_arm("kvtier", tmp_path)
    runs = [run_of(w, [0.02] * 12), run_of(w, [0.02] * 5 + [0.06] * 7)]
    outcomes = tuple(ArmOutcome(arm, tmp_path / f"kvtier-run{k}.log", 45.0, run, recorded_meters("kvtier"), None,
                                Verdict(VerdictKind.HELPING, "ok")) for k, run in enumerate(runs))
    result = CompareResult(workload=w, engine=ServerSpec(model="m"), outcomes=outcomes, repeats=2)
    title, ttfts, labels = cdf_figures(result)
    assert title.endswith("12 requests × 2 runs, pooled")
    assert len(ttfts["kvtier"]) == 24
    table_p50 = result.arms[0].spreads()["ttft_p50_s"].median
    assert table_p50 == pytest.approx(0.04)
    assert labels["kvtier"] == "kvtier (TTFT p50 40 ms, median of 2 runs; n=24)"


def test_the_table_is_never_cut_when_stdout_is_not_a_terminal(result, capsys, monkeypatch):
    """Piped (not a tty, no COLUMNS): rich's 80 columns cut cells ('baseli…', '120 ms (0.59…'); every
    cell is printed whole."""
    for name in ("COLUMNS", "LINES", "TERM"):
        monkeypatch.delenv(name, raising=False)
    print_table(result)
    table = capsys.readouterr().out
    assert "…" not in table
    for row in rows(result):
        for cell in row.cells:
            assert cell in table, cell
