"""``kvtier bench compare`` reads receipts (issue 35 item 4): every kvtier server the bench starts
logs its receipts to its own file beside its server log; a run's receipts from real receipt logs
(written by :class:`ReceiptLog`'s thread) beside the replicas' summed metric deltas (counters as
prometheus_client writes them, parsed by the bench's parser), disagreements named; the report
(terminal, JSON, Markdown) shows them per arm and run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvtier.bench.arms import make_arm
from kvtier.bench.comparereceipts import replica_receipts, with_receipt_logs
from kvtier.bench.meters import parse_metrics
from kvtier.bench.receipts import LogCursor
from kvtier.bench.replicas import replica_log_paths, replica_specs
from kvtier.bench.report import compare_json, print_table, write_reports
from kvtier.launch.serve import ServerSpec
from tests.bench.test_bench_receipts import metrics_text, receipt, write
from tests.bench.test_report import result  # noqa: F401 - the recorded comparison fixture


def test_every_kvtier_server_gets_its_own_receipt_log_and_other_arms_none(tmp_path: Path):
    engine = ServerSpec(model="models/tiny", max_model_len=2048, cache_tokens=2048)
    logs = replica_log_paths(tmp_path / "kvtier.log", 2)
    (tmp_path / "kvtier-r0.receipts.jsonl").write_text("a previous run's\n")
    kv = dataclasses.replace(engine, kv_transfer_config=make_arm("kvtier", tmp_path).kv_transfer_config)
    specs, paths = with_receipt_logs(replica_specs(kv, 2), logs)
    assert paths == [tmp_path / "kvtier-r0.receipts.jsonl", tmp_path / "kvtier-r1.receipts.jsonl"]
    assert [s.kv_transfer_config["kv_connector_extra_config"]["receipt_log_path"] for s in specs] == [
        str(p) for p in paths]
    assert not paths[0].exists()  # a stale log is not read as this run's
    base = dataclasses.replace(engine, kv_transfer_config=make_arm("baseline", tmp_path).kv_transfer_config)
    assert with_receipt_logs([base], [tmp_path / "baseline.log"]) == ([base], [None])


def test_a_runs_receipts_over_its_replicas_beside_their_summed_metrics(tmp_path: Path):
    paths = [tmp_path / "kvtier-r0.receipts.jsonl", tmp_path / "kvtier-r1.receipts.jsonl"]
    write(paths[0], [receipt(i) for i in range(3)])  # the warm-up's: before the cursors
    cursors = [LogCursor(paths[0]), LogCursor(paths[1]), None]  # the third server logs none
    write(paths[0], [receipt(i) for i in range(0, 40, 2)])  # even requests: 10 new, 10 partial_chunk
    write(paths[1], [receipt(i) for i in range(1, 40, 2)])  # odd: 10 evicted/cpu, 10 partial_chunk
    empty = parse_metrics(metrics_text({}, {}))
    after = [parse_metrics(metrics_text({"cpu": 20 * 256, "disk": 10 * 128}, {("new", ""): 6000, ("partial_chunk", ""): 880})),
             parse_metrics(metrics_text({"cpu": 20 * 256, "disk": 10 * 128},
                                        {("evicted", "cpu"): 3440, ("partial_chunk", ""): 880})),
             empty]
    run = replica_receipts(cursors, [empty] * 3, after, sent=40)
    assert run is not None and run.receipts.requests == 40
    assert run.receipts.tiers() == {"cpu": 30 * 256, "disk": 20 * 128}
    assert run.receipts.missed == {"new": 6000, "evicted/cpu": 3440, "partial_chunk": 1760}
    assert run.notes() == ["disagree: tokens served by cpu: receipts 7,680, metrics 10,240"]
    assert replica_receipts([None, None], [empty] * 2, [empty] * 2, sent=4) is None


def test_the_report_shows_each_kvtier_runs_receipts_and_disagreements(result, tmp_path, capsys):  # noqa: F811
    path = tmp_path / "kvtier.receipts.jsonl"
    cursor = LogCursor(path)
    write(path, [receipt(i) for i in range(12)])
    served = parse_metrics(metrics_text({"cpu": 9 * 256, "disk": 6 * 128}, {("new", ""): 1800,
                                                                        ("evicted", "cpu"): 1032}))
    receipts = replica_receipts([cursor], [parse_metrics(metrics_text({}, {}))], [served], sent=12)
    kv = dataclasses.replace(result.outcomes[1], receipts=receipts)
    compared = dataclasses.replace(result, outcomes=(result.outcomes[0], kv, result.outcomes[2]), arms=())
    data = compare_json(compared)
    assert set(data["receipts"]) == {"kvtier"}
    (run,) = data["receipts"]["kvtier"]
    assert run["receipts"]["tokens"] == {"engine": 6 * 128, "computed": 3 * 600 + 3 * 344 + 6 * 88,
                                         "cpu": 9 * 256, "disk": 6 * 128}
    assert run["notes"] == ["disagree: tokens missed for partial_chunk: receipts 528, metrics 0"]
    md = write_reports(compared, tmp_path / "out", tmp_path / "out" / "c.json").markdown.read_text()
    assert "**kvtier**: 12 receipts for 12 requests" in md
    assert "| served: cpu | 2,304 | 2,304 |" in md and "| missed: evicted/cpu | 1,032 | 1,032 |" in md
    assert "| missed: partial_chunk | 528 | - |" in md
    assert "- disagree: tokens missed for partial_chunk: receipts 528, metrics 0" in md
    assert json.loads((tmp_path / "out" / "c.json").read_text())["receipts"] == data["receipts"]
    print_table(compared)
    out = capsys.readouterr().out
    assert "kvtier: receipts (12 of 12 requests) vs metrics" in out
    assert "kvtier receipts: disagree: tokens missed for partial_chunk" in out
    assert "baseline: receipts" not in out
