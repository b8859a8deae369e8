"""The bench reads receipts (issue 35 item 4): a cursor on a real receipt log (written by
:class:`ReceiptLog`'s thread, rotated by RotatingFileHandler) reads back exactly what a run appended;
the receipts' sums beside the metrics' (the counters as prometheus_client writes them, parsed by the
bench's own parser) agree or are named where they do not; ``--receipt-log`` errors are one sentence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvtier.bench.meters import parse_metrics
from kvtier.bench.receipts import LogCursor, ReceiptTally, RunReceipts, disagreements, metric_tally
from kvtier.core.receipt import Receipt, ReceiptMiss
from kvtier.core.receiptlog import ReceiptLog


def receipt(i: int) -> Receipt:
    if i % 4 == 0:
        return Receipt(request_id=f"cmpl-{i}-0-0000abcd", prompt_tokens=600, tokens={"engine": 0, "computed": 600},
                       miss=ReceiptMiss(token=0, reason="new"))
    if i % 4 == 1:
        return Receipt(request_id=f"cmpl-{i}-0-0000abcd", prompt_tokens=600,
                       tokens={"engine": 0, "cpu": 256, "computed": 344},
                       miss=ReceiptMiss(token=256, reason="evicted", tier="cpu"))
    return Receipt(request_id=f"cmpl-{i}-0-0000abcd", prompt_tokens=600,
                   tokens={"engine": 128, "cpu": 256, "disk": 128, "computed": 88},
                   miss=ReceiptMiss(token=512, reason="partial_chunk"))


def write(path: Path, receipts: list[Receipt], file_bytes: int = 1 << 20) -> None:
    sink = ReceiptLog(str(path), file_bytes=file_bytes, files=50)
    for r in receipts:
        sink.emit(r)
    sink.close()


def test_the_cursor_reads_what_the_run_appended_across_rotations(tmp_path: Path):
    path = tmp_path / "receipts.jsonl"
    earlier = [receipt(i) for i in range(30)]
    write(path, earlier, file_bytes=3000)  # ~250 bytes a line: several files already
    cursor = LogCursor(path)
    run = [receipt(i) for i in range(100, 300)]
    write(path, run, file_bytes=3000)
    assert cursor.read_new(len(run)) == run
    assert LogCursor(path).read_new(wait_s=0) == []  # a cursor taken now: nothing new


def test_a_log_the_run_creates_is_read_whole(tmp_path: Path):
    path = tmp_path / "receipts.jsonl"
    cursor = LogCursor(path)
    run = [receipt(i) for i in range(20)]
    write(path, run)
    assert cursor.read_new(20) == run


def metrics_text(served: dict[str, float], missed: dict[tuple[str, str], float]) -> str:
    registry = CollectorRegistry()
    s = Counter("kvtier_served_tokens", "served", ["engine", "tier"], registry=registry)
    m = Counter("kvtier_missed_tokens", "missed", ["engine", "reason", "tier"], registry=registry)
    for tier, n in served.items():
        s.labels("0", tier).inc(n)
    for (reason, tier), n in missed.items():
        m.labels("0", reason, tier).inc(n)
    return generate_latest(registry).decode()


def test_receipts_and_metrics_side_by_side():
    run = [receipt(i) for i in range(40)]
    tally = ReceiptTally.of(run)
    assert tally.requests == 40
    assert tally.tiers() == {"cpu": 30 * 256, "disk": 20 * 128}
    assert tally.missed == {"new": 10 * 600, "evicted/cpu": 10 * 344, "partial_chunk": 20 * 88}
    before = parse_metrics(metrics_text({"cpu": 1000, "disk": 0}, {("new", "none"): 50}))
    agree = parse_metrics(metrics_text({"cpu": 1000 + 30 * 256, "disk": 20 * 128},
                                       {("new", "none"): 50 + 6000, ("evicted", "cpu"): 3440, ("partial_chunk", "none"): 1760}))
    metrics = metric_tally(before, agree)
    assert metrics is not None and disagreements(tally, metrics) == []
    assert RunReceipts(tally, metrics, sent=40).notes() == []
    off = parse_metrics(metrics_text({"cpu": 1000 + 30 * 256 - 256, "disk": 20 * 128},
                                     {("new", "none"): 50 + 6000, ("evicted", "cpu"): 3440 + 256, ("partial_chunk", "none"): 1760}))
    notes = RunReceipts(tally, metric_tally(before, off), sent=40).notes()
    assert notes == ["disagree: tokens served by cpu: receipts 7,680, metrics 7,424",
                     "disagree: tokens missed for evicted/cpu: receipts 3,440, metrics 3,696"]
    sampled = RunReceipts(ReceiptTally.of(run[:10]), metrics, sent=40).notes()
    assert len(sampled) == 1 and "10 receipts for 40 requests" in sampled[0]
    older = parse_metrics(metrics_text({"cpu": 5}, {}).replace("kvtier_missed_tokens", "kvtier_other_tokens"))
    assert metric_tally(before, older) is None
    assert "receipts only" in RunReceipts(tally, None, sent=40).notes()[0]


def test_receipt_log_in_a_missing_directory_is_one_sentence():
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "run", "--url", "http://127.0.0.1:9",
                           "--receipt-log", "/nonexistent-dir/receipts.jsonl"], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--receipt-log /nonexistent-dir/receipts.jsonl: its directory does not exist" in proc.stderr


def test_a_receipt_whose_last_token_alone_was_computed_counts_where_the_metric_counts_it():
    """A null ``miss`` (only the prompt's last token computed) counts that token under
    ``partial_chunk``, as ``kvtier_missed_tokens_total`` does; the bench once left it out and
    disagreed with the metrics by one token per such request (fleet day, issue 38)."""
    from kvtier.integrations.vllm.scheduler.requests import receipt_counters

    whole = Receipt(request_id="cmpl-w-0-0000abcd", prompt_tokens=1025,
                    tokens={"engine": 0, "cpu": 1024, "computed": 1}, miss=None)
    every = Receipt(request_id="cmpl-e-0-0000abcd", prompt_tokens=1024,
                    tokens={"engine": 1024, "computed": 0}, miss=None)
    tally = ReceiptTally.of([whole, every, receipt(0)])
    assert tally.missed == {"partial_chunk": 1, "new": 600}
    assert receipt_counters(whole.tokens, *whole.computed_miss()) == {
        "served_tokens_cpu": 1024, "missed_tokens_partial_chunk|none": 1}
    assert receipt_counters(every.tokens, *every.computed_miss()) == {"served_tokens_engine": 1024}
