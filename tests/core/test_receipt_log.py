"""The receipt log (issue 35 item 3) on real files: every receipt emitted comes back in order,
rotation keeps the newest lines in at most ``files`` files of at most ``file_bytes``, sampling keeps
the same requests in every run, a stalled writer (its file handler's real lock held by the test)
makes ``emit`` drop and count instead of wait, and ``close`` is bounded.  Also the configuration
keys that turn it on (:func:`build_receipt_sinks`)."""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.receipt import Receipt, ReceiptMiss, ReceiptPin, ReceiptSaved
from kvtier.core.receiptlog import ReceiptLog, read_receipt_log, sampled
from kvtier.core.receiptqueue import external_request_id
from kvtier.core.receiptsinks import (
    ReceiptSinkMetrics,
    build_receipt_sinks,
    close_receipt_sinks,
    receipt_counters,
)


def engine_id(client_id: str) -> str:
    """vLLM's engine request id for ``client_id``: a random 8-hex suffix (input_processor.assign_request_id)."""
    return f"{client_id}-{secrets.token_hex(4)}"


def receipt(i: int, client_id: str | None = None) -> Receipt:
    miss = ReceiptMiss(token=256, reason="evicted", tier="cpu") if i % 3 == 0 else None
    return Receipt(request_id=engine_id(client_id or f"cmpl-{i}"), prompt_tokens=300 + i,
                   tokens={"engine": 0, "cpu": 256, "computed": 44 + i}, load_ms={"cpu": 0.5 + i},
                   waited_steps=i % 2, miss=miss, saved=ReceiptSaved(chunks={"cpu": i % 4}),
                   pin=ReceiptPin(granted=True, ttl_s=60.0) if i % 5 == 0 else None)


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.005)


def test_every_receipt_comes_back_in_order(tmp_path: Path):
    sink = ReceiptLog(str(tmp_path / "r.jsonl"))
    sent = [receipt(i) for i in range(50)]
    for r in sent:
        sink.emit(r)
    sink.close()
    assert read_receipt_log(tmp_path / "r.jsonl") == sent
    assert sink.dropped == 0
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert len(lines) == 50 and lines[0].startswith("{") and '"request_id"' in lines[0]


def test_rotation_keeps_the_newest_receipts_in_bounded_files(tmp_path: Path):
    path = tmp_path / "r.jsonl"
    file_bytes, files = 4000, 3
    sink = ReceiptLog(str(path), file_bytes=file_bytes, files=files)
    sent = [receipt(i) for i in range(400)]  # ~250 bytes a line: ~25 files' worth
    for r in sent:
        sink.emit(r)
    sink.close()
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    assert on_disk == ["r.jsonl", "r.jsonl.1", "r.jsonl.2"]
    assert all((tmp_path / name).stat().st_size <= file_bytes for name in on_disk)
    kept = read_receipt_log(path)
    assert kept == sent[-len(kept):]  # the newest, contiguous, oldest first
    assert 2 * file_bytes // 300 < len(kept) < len(sent)
    assert read_receipt_log(path, rotated=False) == sent[-len(read_receipt_log(path, rotated=False)):]


def test_sampling_keeps_the_same_requests_in_every_run(tmp_path: Path):
    clients = [f"chatcmpl-{i:05d}" for i in range(3000)]
    runs = []
    for run in range(2):  # each run's engine ids differ (a fresh random suffix), the clients' ids do not
        path = tmp_path / f"run{run}.jsonl"
        sink = ReceiptLog(str(path), sample=0.2, queue_depth=4096)
        for i, client in enumerate(clients):
            sink.emit(receipt(i, client))
        sink.close()
        runs.append([external_request_id(r.request_id) for r in read_receipt_log(path)])
    assert runs[0] == runs[1]
    assert 0.17 * len(clients) < len(runs[0]) < 0.23 * len(clients)
    assert all(sampled(engine_id(c), 0.2) for c in runs[0])
    assert not any(sampled(engine_id(c), 0.0) for c in clients[:100])
    assert all(sampled(engine_id(c), 1.0) for c in clients[:100])


def test_a_stalled_writer_makes_emit_drop_and_count_never_wait(tmp_path: Path, caplog):
    sink = ReceiptLog(str(tmp_path / "r.jsonl"), queue_depth=8)
    metrics = ReceiptSinkMetrics([sink], CollectorRegistry())
    caplog.set_level(logging.WARNING, logger="kvtier.core.receiptqueue")
    with sink.handler.lock:  # the writer's file lock: its next line waits here, as on a stalled disk
        sink.emit(receipt(0))
        wait_until(lambda: sink.pending == 0)  # the writer took it and waits for the lock
        for i in range(1, 51):  # returns at once while the writer cannot write
            sink.emit(receipt(i))
        assert sink.pending == 8 and sink.dropped == 42
        assert metrics.registry.get_sample_value("kvtier_receipts_dropped_total", {"sink": "log"}) == 42
        assert receipt_counters([sink]) == {"receipts_dropped_log": 42.0}
    drops = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 1 and "queue was full" in drops[0].getMessage()  # once per interval, not 42 times
    sink.close()
    written = read_receipt_log(tmp_path / "r.jsonl")
    assert [r.prompt_tokens for r in written] == [300 + i for i in range(9)]


def test_close_is_bounded_while_the_writer_is_stalled(tmp_path: Path, caplog):
    sink = ReceiptLog(str(tmp_path / "r.jsonl"), queue_depth=16, close_timeout_s=0.3)
    caplog.set_level(logging.WARNING, logger="kvtier.core.receiptqueue")
    sink.handler.acquire()
    try:
        for i in range(5):
            sink.emit(receipt(i))
        wait_until(lambda: sink.pending == 4)
        sink.close()  # returns after close_timeout_s with the writer still stuck
        assert any("did not finish writing within 0.3 s; 4 receipt(s) not written" in r.getMessage()
                   for r in caplog.records)
        sink.emit(receipt(9))  # after close: dropped, counted
        assert sink.dropped == 1
    finally:
        sink.handler.release()
    wait_until(lambda: not sink._thread.is_alive())  # unstalled, it drains what was queued and stops
    assert len(read_receipt_log(tmp_path / "r.jsonl")) == 5


def test_a_failed_write_is_counted_and_the_writer_goes_on(caplog):
    if not os.path.exists("/dev/full"):
        pytest.fail("/dev/full (every write fails with ENOSPC) is missing on this Linux host")
    sink = ReceiptLog("/dev/full")
    caplog.set_level(logging.WARNING, logger="kvtier.core.receiptqueue")
    for i in range(3):
        sink.emit(receipt(i))
    wait_until(lambda: sink.dropped == 3)
    assert sink._thread.is_alive()
    sink.close()
    assert any("writing failed" in r.getMessage() and "No space left" in r.getMessage() for r in caplog.records)


def test_the_configuration_turns_the_log_on(tmp_path: Path):
    assert build_receipt_sinks(KVTierConfig.from_dict({})) == []
    config = KVTierConfig.from_dict({"receipt_log_path": str(tmp_path / "r.jsonl"), "receipt_log_sample": 0.5,
                                     "receipt_log_file_mib": 2, "receipt_log_files": 4, "receipt_queue_depth": 32})
    (sink,) = build_receipt_sinks(config)
    try:
        assert isinstance(sink, ReceiptLog) and sink.sample == 0.5 and sink.handler.maxBytes == 2 << 20
        assert sink.handler.backupCount == 3 and sink._queue.maxsize == 32
    finally:
        close_receipt_sinks([sink])


def test_a_log_in_a_missing_directory_is_one_sentence(tmp_path: Path):
    config = KVTierConfig.from_dict({"receipt_log_path": str(tmp_path / "nope" / "r.jsonl")})
    with pytest.raises(ConfigError, match=r"^cannot open receipt_log_path '.*/nope/r.jsonl' for appending "
                       r"\(No such file or directory\); create its directory"):
        build_receipt_sinks(config)


@pytest.mark.parametrize("values, words", [
    ({"receipt_log_sample": 1.5}, "receipt_log_sample"),
    ({"receipt_log_sample": -0.1}, "receipt_log_sample"),
    ({"receipt_log_files": 1}, "receipt_log_files"),
    ({"receipt_log_file_mib": 0}, "receipt_log_file_mib"),
    ({"receipt_queue_depth": 0}, "receipt_queue_depth"),
    ({"receipt_log_path": " "}, "must be a file path"),
    ({"otlp_endpoint": "collector:4317"}, "must be the http:// or https:// URL of an OTLP collector"),
])
def test_bad_receipt_settings_are_one_sentence(values, words):
    with pytest.raises(ConfigError, match=words) as caught:
        KVTierConfig.from_dict(values)
    assert "\n" not in str(caught.value)


def test_receipt_settings_from_the_environment(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("KVTIER_RECEIPT_LOG_PATH", "~/receipts.jsonl")
    monkeypatch.setenv("KVTIER_RECEIPT_LOG_SAMPLE", "0.25")
    config = KVTierConfig.from_dict({})
    assert config.receipt_log_path == os.path.expanduser("~/receipts.jsonl") and config.receipt_log_sample == 0.25


def test_the_preflight_names_a_missing_log_directory(tmp_path: Path):
    from kvtier.core.receiptsinks import receipt_sink_problems

    assert receipt_sink_problems(KVTierConfig.from_dict({"receipt_log_path": str(tmp_path / "r.jsonl")})) == []
    ((key, message),) = receipt_sink_problems(KVTierConfig.from_dict({"receipt_log_path": str(tmp_path / "no" / "r")}))
    assert key == "receipt_log_path" and "directory that does not exist" in message
