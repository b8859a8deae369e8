"""The receipt sinks an engine's configuration asks for (issue 35 item 3), and their drop counts.

The scheduler builds them once (:func:`build_receipt_sinks`), calls ``emit(receipt)`` on each for
every finished request (never blocking: :mod:`kvtier.core.receiptqueue`), ``close()`` on each at
shutdown, and ships :func:`receipt_counters` with its stats, exported as
``kvtier_receipts_dropped_total{sink}`` (:mod:`kvtier.integrations.vllm.stats_table`); outside
vLLM, :class:`ReceiptSinkMetrics` exports the same counter into a Prometheus registry.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.core.receipt import ReceiptSink
from kvtier.core.receiptlog import MiB, ReceiptLog, append_problem
from kvtier.core.receiptqueue import QueuedSink

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

DROPPED_METRIC = "kvtier_receipts_dropped"
"""Receipts a sink lost (queue full, emitted after close, a failed write), by ``sink`` (``log``, ``otlp``)."""
SINK_NAMES = ("log", "otlp")


def build_receipt_sinks(config: KVTierConfig) -> list[ReceiptSink]:
    """The sinks ``config`` turns on, each with its writer thread started: the receipt log
    (``receipt_log_path``; :class:`~kvtier.core.receiptlog.ReceiptLog`) and the OTLP spans
    (``otlp_endpoint``; :class:`~kvtier.core.receipttrace.ReceiptSpans`), in that order; ``[]``
    when neither is set (the default).

    Raises:
        ConfigError: the log file cannot be opened, or ``otlp_endpoint`` is set and the
            OpenTelemetry SDK is not installed (one sentence each).
    """
    sinks: list[ReceiptSink] = []
    if config.receipt_log_path:
        sinks.append(ReceiptLog(config.receipt_log_path, config.receipt_log_sample,
                                config.receipt_log_file_mib * MiB, config.receipt_log_files,
                                config.receipt_queue_depth))
    if config.otlp_endpoint:
        from kvtier.core.receipttrace import ReceiptSpans, otlp_provider

        try:
            sinks.append(ReceiptSpans(otlp_provider(config.otlp_endpoint), config.receipt_queue_depth))
        except BaseException:
            close_receipt_sinks(sinks)
            raise
    return sinks


def receipt_sink_problems(config: KVTierConfig) -> list[tuple[str, str]]:
    """What :func:`build_receipt_sinks` would refuse, checked without starting a sink (the
    preflight's, before the model loads): ``(key, message)`` per problem, one sentence each.  The
    receipt log's path must not be a directory, its directory must exist and be writable,
    and a file already there must be writable; then the file is opened for appending for real
    (:func:`~kvtier.core.receiptlog.append_problem`: nothing is left behind); with ``otlp_endpoint``,
    the OpenTelemetry SDK and its OTLP exporter must be importable."""
    import importlib.util

    out: list[tuple[str, str]] = []
    if config.receipt_log_path:
        path = config.receipt_log_path
        directory = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            out.append(("receipt_log_path", (f"receipt_log_path {path!r} is a directory, not a file; name a file "
                                             f"in it, e.g. {os.path.join(path, 'receipts.jsonl')!r}")))
        elif os.path.exists(path) and not os.access(path, os.W_OK):
            out.append(("receipt_log_path", (f"receipt_log_path {path!r} exists and this user cannot write it; "
                                             "make it writable or fix receipt_log_path")))
        elif not os.path.isdir(directory):
            missing = (f"receipt_log_path {config.receipt_log_path!r} is in a directory that does not exist; "
                       "create it or fix receipt_log_path")
            out.append(("receipt_log_path", missing))
        elif not os.access(directory, os.W_OK):
            unwritable = (f"receipt_log_path {config.receipt_log_path!r} is in a directory this user cannot "
                          "write; make it writable or fix receipt_log_path")
            out.append(("receipt_log_path", unwritable))
        elif (problem := append_problem(path)) is not None:  # the open itself, as ReceiptLog does it
            out.append(("receipt_log_path", problem))
    if config.otlp_endpoint:
        from kvtier.core.receipttrace import MISSING_SDK

        for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp"):
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):  # a parent package missing, or set to None
                found = False
            if not found:
                out.append(("otlp_endpoint", MISSING_SDK))
                break
    return out


def close_receipt_sinks(sinks: Sequence[ReceiptSink]) -> None:
    """Close every sink (each waits at most its own ``close_timeout_s``)."""
    for sink in sinks:
        sink.close()


def receipt_counters(sinks: Sequence[Any]) -> dict[str, float]:
    """Payload counters of the stats the scheduler ships: ``receipts_dropped_<sink>`` → receipts
    that sink dropped since it started (a total: the sender sends the change), for every sink
    that counts drops."""
    return {f"receipts_dropped_{s.name}": float(s.dropped) for s in sinks if isinstance(s, QueuedSink)}


class ReceiptSinkMetrics(Collector):
    """``kvtier_receipts_dropped_total{sink}`` of ``sinks``, read at scrape time (outside vLLM,
    where the scheduler's stats do not carry it).

    Args:
        sinks: the sinks whose drops are exported.
        registry: where to register (a fresh one by default).
    """

    def __init__(self, sinks: Sequence[ReceiptSink], registry: CollectorRegistry | None = None) -> None:
        self.sinks = list(sinks)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(DROPPED_METRIC, "Receipts a sink dropped: its queue full, emitted after "
                                     "close, or a failed write.", labels=["sink"])
        for name, value in receipt_counters(self.sinks).items():
            family.add_metric([name.removeprefix("receipts_dropped_")], value)
        yield family
