"""One OpenTelemetry span per finished request with its cache receipt as attributes (issue 35
item 3), exported to the operator's OTLP collector (``otlp_endpoint``).

Attribute names: where they fit, those vLLM#53926 proposes for per-request KV cache tier
attribution on vLLM's ``llm_request`` span (https://github.com/vllm-project/vllm/issues/53926):
``kv_cache.request_id``, ``kv_cache.tier_hit`` (the tiers that served, ``none`` when none did) and
``kv_cache.promotion_latency_seconds`` (the loads' time from the lower tiers, here the sum of the
receipt's ``load_ms``).  Its ``kv_cache.blocks_hit``/``blocks_missed`` count vLLM blocks, which a
receipt does not (it counts tokens), so they are not set; ``kv_cache.session_id`` is not known to
kvtier.  The whole receipt is there too, flattened under ``kvtier.`` (``kvtier.tokens.cpu``,
``kvtier.miss.reason``, ``kvtier.saved.chunks.disk``, …: :func:`receipt_attributes`), so
:func:`receipt_from_attributes` gives it back exactly.

Joining vLLM's own trace: the span carries ``gen_ai.request.id``, the request id the client gave,
as vLLM's ``llm_request`` span does (vllm/v1/engine/output_processor.py ``do_tracing``); and when
the emitter passes the request's ``trace_headers`` (vLLM's ``Request.trace_headers``: the incoming
W3C ``traceparent``, forwarded by vLLM when ``--otlp-traces-endpoint`` is set), the span is a
child of that context, in the same trace.

The SDK is an optional extra (``pip install 'kvtier[otlp]'``): imported only here, only when spans
are asked for.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.core.errors import ConfigError
from kvtier.core.receipt import Receipt, decode
from kvtier.core.receiptqueue import CLOSE_TIMEOUT_S, QueuedSink, external_request_id

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

PREFIX = "kvtier."
SPAN_NAME = "kvtier.receipt"
ENGINE_ROWS = ("engine", "computed")
"""Rows of a receipt's ``tokens`` that are not kvtier tiers (vLLM's own prefix cache, and computed)."""
MISSING_SDK = ("otlp_endpoint is set but the OpenTelemetry SDK is not installed; pip install 'kvtier[otlp]' "
               "(opentelemetry-sdk and opentelemetry-exporter-otlp) or unset otlp_endpoint")


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}", item, out)
    elif value is not None:
        out[prefix] = value


def receipt_attributes(receipt: Receipt) -> dict[str, Any]:
    """The span attributes of ``receipt``: vLLM#53926's names where they fit (module docstring),
    ``gen_ai.request.id`` (the client's id, as vLLM's span), and every field of the receipt under
    ``kvtier.`` (nested mappings dotted, ``None`` left out); values are str, bool, int, float or a
    tuple of str, as OpenTelemetry attributes must be."""
    served = tuple(t for t, n in receipt.tokens.items() if t not in ENGINE_ROWS and n > 0)
    out: dict[str, Any] = {
        "kv_cache.request_id": receipt.request_id,
        "kv_cache.tier_hit": served or ("none",),
        "kv_cache.promotion_latency_seconds": sum(receipt.load_ms.values()) / 1000.0,
        "gen_ai.request.id": external_request_id(receipt.request_id),
    }
    _flatten(PREFIX.rstrip("."), receipt.to_builtins(), out)
    return out


def receipt_from_attributes(attributes: Mapping[str, Any]) -> Receipt:
    """The receipt a span's attributes carry (the ``kvtier.`` ones, :func:`receipt_attributes`).

    Raises:
        msgspec.ValidationError: they do not make a receipt.
    """
    tree: dict[str, Any] = {"tokens": {}}
    for key, value in attributes.items():
        if not key.startswith(PREFIX):
            continue
        *path, last = key[len(PREFIX):].split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return decode(tree)


class ReceiptSpans(QueuedSink):
    """A span per receipt, made and ended on the sink's writer thread through ``provider``.

    Args:
        provider: an OpenTelemetry SDK ``TracerProvider`` with its span processors (the OTLP
            exporter's :func:`otlp_provider`; a test's in-memory exporter); shut down by :meth:`close`.
        queue_depth: receipts waiting at most; more are dropped and counted.
        close_timeout_s: longest :meth:`close` waits for the queue to drain (the provider's own
            exporter flushes within its timeout too).
    """

    def __init__(self, provider: TracerProvider, queue_depth: int = 4096,
                 close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        from opentelemetry import propagate, trace

        self.provider = provider
        self._tracer = provider.get_tracer("kvtier")
        self._propagate = propagate
        self._kind = trace.SpanKind.INTERNAL
        super().__init__("otlp", queue_depth, close_timeout_s)

    def _write(self, receipt: Receipt, time_ns: int, trace_headers: Mapping[str, str] | None) -> None:
        context = self._propagate.extract(dict(trace_headers)) if trace_headers else None
        span = self._tracer.start_span(SPAN_NAME, context=context, kind=self._kind,
                                       attributes=receipt_attributes(receipt), start_time=time_ns)
        span.end(end_time=time_ns)

    def _finish(self) -> None:
        self.provider.force_flush(int(self.close_timeout_s * 1000))
        self.provider.shutdown()


def otlp_provider(endpoint: str) -> TracerProvider:
    """A tracer provider that batches spans to the OTLP collector at ``endpoint`` (gRPC, or HTTP
    with ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``: the choice vLLM makes for its
    ``--otlp-traces-endpoint``, vllm/tracing/otel.py ``get_span_exporter``), resource
    ``service.name`` kvtier (or ``OTEL_SERVICE_NAME``).  The global tracer provider is left alone.

    Raises:
        ConfigError: the SDK or its OTLP exporter is not installed, or the protocol is unknown.
    """
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigError(MISSING_SDK) from None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
            exporter: Any = GrpcExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
            exporter = HttpExporter(endpoint=endpoint)
        else:
            raise ConfigError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is {protocol!r}; kvtier's spans go by grpc or "
                              "http/protobuf: set one of those or unset it (grpc)")
    except ImportError:
        raise ConfigError(MISSING_SDK) from None
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "kvtier")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
