"""One OpenTelemetry span per receipt (issue 35 item 3): a real SDK ``TracerProvider`` with its
in-memory exporter (one span per receipt, attributes equal the receipt, vLLM#53926's names, the
request's trace context joined); the OTLP path end to end over HTTP to a local collector that
decodes the protobuf the exporter sends; and the one sentence when the SDK is missing."""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.receipt import Receipt, ReceiptMiss, ReceiptPin, ReceiptSaved
from kvtier.core.receiptsinks import build_receipt_sinks, close_receipt_sinks
from kvtier.core.receipttrace import MISSING_SDK, ReceiptSpans, receipt_attributes, receipt_from_attributes

RECEIPTS = [
    Receipt(request_id="cmpl-a1-0-1f2e3d4c", prompt_tokens=1000, tokens={"engine": 128, "cpu": 512, "disk": 256,
            "computed": 104}, load_ms={"cpu": 1.5, "disk": 7.25}, waited_steps=2,
            miss=ReceiptMiss(token=896, reason="partial_chunk"), saved=ReceiptSaved(chunks={"disk": 1},
            dropped={"save_dropped": 2}), pin=ReceiptPin(granted=False, reason="pin_max_share reached")),
    Receipt(request_id="chatcmpl-b2-9a8b7c6d", prompt_tokens=300, tokens={"engine": 0, "computed": 300},
            miss=ReceiptMiss(token=0, reason="evicted", tier="cpu")),
    Receipt(request_id="batch-7", prompt_tokens=256, tokens={"cpu": 256, "computed": 0}, load_ms={"cpu": 0.75},
            pin=ReceiptPin(granted=True, ttl_s=600.0)),
]
TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7


def in_memory_sink(queue_depth: int = 64) -> tuple[ReceiptSpans, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return ReceiptSpans(provider, queue_depth), exporter


def test_one_span_per_receipt_whose_attributes_are_the_receipt():
    sink, exporter = in_memory_sink()
    for r in RECEIPTS:
        sink.emit(r)
    sink.close()
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["kvtier.receipt"] * 3
    assert [receipt_from_attributes(s.attributes) for s in spans] == RECEIPTS
    first, second, third = (dict(s.attributes) for s in spans)
    assert first["kv_cache.request_id"] == "cmpl-a1-0-1f2e3d4c"
    assert first["gen_ai.request.id"] == "cmpl-a1-0"  # what vLLM's llm_request span carries
    assert first["kv_cache.tier_hit"] == ("cpu", "disk")
    assert first["kv_cache.promotion_latency_seconds"] == pytest.approx(0.00875)
    assert first["kvtier.tokens.disk"] == 256 and first["kvtier.miss.reason"] == "partial_chunk"
    assert first["kvtier.saved.dropped.save_dropped"] == 2 and first["kvtier.pin.granted"] is False
    assert second["kv_cache.tier_hit"] == ("none",) and second["kvtier.miss.tier"] == "cpu"
    assert "kvtier.pin.granted" not in second  # no pin asked: nothing set
    assert third["gen_ai.request.id"] == "batch-7" and third["kvtier.pin.ttl_s"] == 600.0
    assert all(s.parent is None for s in spans)


def test_the_span_joins_the_requests_trace_context():
    sink, exporter = in_memory_sink()
    sink.emit(RECEIPTS[0], trace_headers={"traceparent": f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"})
    sink.close()
    (span,) = exporter.get_finished_spans()
    assert span.context.trace_id == TRACE_ID and span.parent is not None and span.parent.span_id == PARENT_ID


def test_attributes_are_plain_otel_values():
    for r in RECEIPTS:
        for key, value in receipt_attributes(r).items():
            assert isinstance(value, str | bool | int | float | tuple), (key, value)


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps every decoded ExportTraceServiceRequest."""

    received: ClassVar[list[ExportTraceServiceRequest]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.received.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_otlp_endpoint_gets_one_span_per_receipt_over_http(monkeypatch):
    _Collector.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    try:
        config = KVTierConfig.from_dict({"otlp_endpoint": f"http://127.0.0.1:{server.server_address[1]}/v1/traces"})
        sinks = build_receipt_sinks(config)
        assert [type(s) for s in sinks] == [ReceiptSpans]
        for r in RECEIPTS:
            sinks[0].emit(r)
        close_receipt_sinks(sinks)  # flushes the batch processor
    finally:
        server.shutdown()
    spans = [span for req in _Collector.received for rs in req.resource_spans for ss in rs.scope_spans
             for span in ss.spans]
    assert len(spans) == 3
    services = {a.value.string_value for req in _Collector.received for rs in req.resource_spans
                for a in rs.resource.attributes if a.key == "service.name"}
    assert services == {"kvtier"}
    got = []
    for span in spans:
        attrs = {}
        for a in span.attributes:
            kind = a.value.WhichOneof("value")
            value = getattr(a.value, kind)
            attrs[a.key] = tuple(v.string_value for v in value.values) if kind == "array_value" else value
        got.append(receipt_from_attributes(attrs))
    assert got == RECEIPTS


def test_an_endpoint_without_the_sdk_is_one_sentence(monkeypatch):
    for name in ("opentelemetry.sdk.resources", "opentelemetry.sdk.trace", "opentelemetry.sdk.trace.export"):
        monkeypatch.setitem(sys.modules, name, None)  # what an install without the extra gives: ImportError
    with pytest.raises(ConfigError) as caught:
        build_receipt_sinks(KVTierConfig.from_dict({"otlp_endpoint": "http://localhost:4317"}))
    assert str(caught.value) == MISSING_SDK and "pip install 'kvtier[otlp]'" in MISSING_SDK


def test_an_unknown_otlp_protocol_is_one_sentence(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is 'carrier-pigeon'"):
        build_receipt_sinks(KVTierConfig.from_dict({"otlp_endpoint": "http://localhost:4317"}))


def test_the_preflight_names_a_missing_sdk(monkeypatch):
    from kvtier.core.receiptsinks import receipt_sink_problems

    config = KVTierConfig.from_dict({"otlp_endpoint": "http://localhost:4317"})
    assert receipt_sink_problems(config) == []  # installed here
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    assert receipt_sink_problems(config) == [("otlp_endpoint", MISSING_SDK)]
