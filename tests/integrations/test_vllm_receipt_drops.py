"""``kvtier_receipts_dropped_total{sink}`` on vLLM's /metrics: the scheduler ships its receipt sinks'
drops (:func:`receipt_counters`, a stalled real receipt log) in its stats payload, and the connector's
:class:`KVTierPromMetrics` (vLLM's metric classes, a private registry) exports them by sink."""

from __future__ import annotations

import functools
import time
import types
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.core.receipt import Receipt
from kvtier.core.receiptlog import ReceiptLog
from kvtier.core.receiptsinks import receipt_counters
from kvtier.integrations.vllm.stats import KVTierPromMetrics


def test_dropped_receipts_reach_the_metric_by_sink(tmp_path: Path):
    registry = CollectorRegistry()
    kinds = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = KVTierPromMetrics(types.SimpleNamespace(kv_transfer_config=None), kinds,  # type: ignore[arg-type]
                             ["model_name", "engine"], {0: ["tiny", "0"]})
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("kvtier_receipts_dropped_total", {**labels, "sink": "log"}) == 0
    sink = ReceiptLog(str(tmp_path / "r.jsonl"), queue_depth=1)
    with sink.handler.lock:  # the writer stalls on its first line; the queue holds one more
        sink.emit(Receipt(request_id="r0", prompt_tokens=1, tokens={"computed": 1}))
        deadline = time.monotonic() + 10
        while sink.pending and time.monotonic() < deadline:  # the writer took it and waits for the lock
            time.sleep(0.005)
        for i in range(1, 5):
            sink.emit(Receipt(request_id=f"r{i}", prompt_tokens=1, tokens={"computed": 1}))
        prom.observe({"counters": receipt_counters([sink]), "gauges": {}}, 0)
    sink.close()
    assert registry.get_sample_value("kvtier_receipts_dropped_total", {**labels, "sink": "log"}) == 3
    assert registry.get_sample_value("kvtier_receipts_dropped_total", {**labels, "sink": "otlp"}) == 0


def test_the_preflight_refuses_a_receipt_log_in_a_missing_directory(tmp_path: Path):
    """`kvtier check` and the vLLM plugin's pre-flight (check_transfer_config) say it before the model loads."""
    from kvtier.integrations.vllm.preflight import check_transfer_config

    cfg = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"cpu_gib": 0.5, "receipt_log_path": str(tmp_path / "gone" / "r.jsonl")}}
    (problem,) = [p for p in check_transfer_config(cfg) if p.severity == "error"]
    assert problem.key == "kv_connector_extra_config.receipt_log_path"
    assert "directory that does not exist" in problem.message
    cfg["kv_connector_extra_config"]["receipt_log_path"] = str(tmp_path / "r.jsonl")  # type: ignore[index]
    assert [p for p in check_transfer_config(cfg) if p.severity == "error"] == []
