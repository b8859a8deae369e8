"""The configuration keys of where requests' cache receipts go besides the response (issue 35
item 3): the receipt log and the OTLP trace spans (:mod:`kvtier.core.receiptsinks`).

They are fields of :class:`~kvtier.core.config.KVTierConfig` (its base class), given and checked like
every other key (``kv_connector_extra_config``, YAML, ``KVTIER_*``); docs/vllm.md's table and
docs/receipts.md document them.  Validating is pure: whether the log's directory exists and the
OpenTelemetry SDK is installed is checked when the sinks are built
(:func:`kvtier.core.receiptsinks.build_receipt_sinks`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

MAX_RECEIPT_LOG_FILE_MIB = 1 << 20
"""Largest ``receipt_log_file_mib`` (1 TiB): a bound that catches a size given in bytes by mistake."""


def receipt_keys_last(keys: Iterable[str]) -> list[str]:
    """``keys`` with :class:`ReceiptSettings`' own after the rest, each group in its order (pydantic
    lists a base class's fields first; the key lists users read start with the main keys)."""
    keys = list(keys)
    return sorted(keys, key=lambda k: k in ReceiptSettings.model_fields)


class ReceiptSettings(BaseSettings):
    """The receipt log's and the trace spans' keys (a base of ``KVTierConfig``, which sets the
    ``KVTIER_`` environment prefix and the other model options)."""

    receipt_log_path: str | None = Field(None, description=(
        "File of the receipt log: one JSON line per finished request (its cache receipt, docs/receipts.md), "
        "written by a background thread; unset = no receipt log. One path per engine process."))
    receipt_log_sample: float = Field(1.0, ge=0, le=1, allow_inf_nan=False, description=(
        "Share of requests whose receipt the log keeps, 0 to 1; chosen by a hash of vLLM's request id "
        "(the id the client gave), so a rerun of the same requests logs the same ones."))
    receipt_log_file_mib: int = Field(64, gt=0, le=MAX_RECEIPT_LOG_FILE_MIB, description=(
        "Size at which the receipt log is rotated, MiB (receipt_log_path.1 is the newest rotated file)."))
    receipt_log_files: int = Field(5, ge=2, le=1000, description=(
        "Receipt log files kept, the current one included (at least 2): the log takes at most "
        "receipt_log_files x receipt_log_file_mib on disk."))
    receipt_queue_depth: int = Field(4096, gt=0, le=1 << 20, description=(
        "Receipts waiting for the receipt log's (and the span exporter's) thread at most; more are dropped "
        "and counted (kvtier_receipts_dropped_total{sink}), never waited for."))
    otlp_endpoint: str | None = Field(None, description=(
        "OTLP collector that gets one span per finished request with its receipt as attributes, e.g. "
        "http://localhost:4317 (gRPC; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf as for vLLM's "
        "--otlp-traces-endpoint); needs the OpenTelemetry SDK (pip install 'kvtier[otlp]'); unset = no spans."))

    @field_validator("receipt_log_path")
    @classmethod
    def _receipt_log_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip() or "\0" in value:
            raise ValueError("must be a file path, e.g. /var/log/kvtier/receipts.jsonl (unset it for no receipt log)")
        return os.path.expanduser(os.path.expandvars(value))

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be the http:// or https:// URL of an OTLP collector, e.g. http://localhost:4317")
        return value.strip()
