"""The part every receipt sink shares (issue 35 item 3): ``emit`` on the scheduler's thread only
puts the receipt in a bounded queue, never waits; one writer thread per sink takes it from there.

A full queue (a writer stalled on a slow disk or collector) drops the receipt and counts it
(:attr:`QueuedSink.dropped`, exported as ``kvtier_receipts_dropped_total{sink}``), as does a write
that fails; each is logged at most once per :data:`DROP_LOG_INTERVAL_S`.  :meth:`QueuedSink.close`
lets the writer drain what is queued, waiting at most ``close_timeout_s``.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from kvtier.core.receipt import Receipt

log = logging.getLogger(__name__)

DROP_LOG_INTERVAL_S = 60.0
"""Seconds between two warnings about dropped receipts of one sink (each says how many since the last)."""
CLOSE_TIMEOUT_S = 5.0
"""Longest :meth:`QueuedSink.close` waits for the writer to drain the queue, seconds."""
_POLL_S = 0.05
"""How often an idle writer looks whether the sink is closing, seconds (bounds ``close`` on an idle sink)."""

_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}\Z")


def external_request_id(request_id: str) -> str:
    """The request id the client gave (``X-Request-Id``, or vLLM's ``cmpl-…``/``chatcmpl-…``) from
    the engine's: vLLM appends ``-`` and 8 random hex digits to make it unique
    (vllm/v1/engine/input_processor.py ``assign_request_id``; not with
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``).  vLLM's ``llm_request`` span carries the former as
    ``gen_ai.request.id`` (vllm/v1/engine/output_processor.py ``do_tracing``)."""
    return _INTERNAL_SUFFIX.sub("", request_id)


class QueuedSink:
    """A :class:`~kvtier.core.receipt.ReceiptSink` whose writes happen on its own thread.

    Subclasses write one receipt in :meth:`_write` (on the writer thread) and release what they
    hold in :meth:`_finish` (on the writer thread, after the last write), and may refuse a receipt
    up front in :meth:`_wanted` (on the scheduler's thread: cheap).

    Args:
        name: the sink's label in ``kvtier_receipts_dropped_total{sink}`` (``log``, ``otlp``).
        queue_depth: receipts waiting at most; more are dropped and counted.
        close_timeout_s: longest :meth:`close` waits for the queue to drain.
    """

    def __init__(self, name: str, queue_depth: int, close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        if queue_depth <= 0:
            raise ValueError(f"queue_depth must be at least 1, got {queue_depth}")
        self.name = name
        self.close_timeout_s = close_timeout_s
        self._queue: queue.Queue[tuple[Receipt, int, Mapping[str, str] | None]] = queue.Queue(maxsize=queue_depth)
        self._closing = threading.Event()
        self._full_drops = 0  # written by the emitting thread only
        self._failed_writes = 0  # written by the writer thread only
        self._logged = {"full": (0, 0.0), "failed": (0, 0.0)}  # drops counted and time, at the last warning
        self._thread = threading.Thread(target=self._run, name=f"kvtier-receipts-{name}", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Receipts this sink lost since it started: queue full, emitted after close, or a failed write."""
        return self._full_drops + self._failed_writes

    @property
    def pending(self) -> int:
        """Receipts queued, not written yet."""
        return self._queue.qsize()

    def emit(self, receipt: Receipt, trace_headers: Mapping[str, str] | None = None) -> None:
        """Queue ``receipt`` for the writer (never blocks).  ``trace_headers``: the request's W3C
        trace context (vLLM's ``Request.trace_headers``), used by the span sink only."""
        if not self._wanted(receipt):
            return
        if self._closing.is_set():
            self._full_drops += 1
            return
        try:
            self._queue.put_nowait((receipt, time.time_ns(), trace_headers))
        except queue.Full:
            self._full_drops += 1
            self._warn("full", self._full_drops, "its queue was full (the writer is behind)")

    def close(self) -> None:
        """Write what is queued and release the sink, waiting at most ``close_timeout_s``; what is
        left then is logged and counted as dropped.  Idempotent; later receipts are dropped."""
        self._closing.set()
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            left = self._queue.qsize()
            log.warning("kvtier: receipt %s sink did not finish writing within %.1f s; %d receipt(s) not written",
                        self.name, self.close_timeout_s, left)

    # ---- for subclasses ----------------------------------------------------------------------
    def _wanted(self, receipt: Receipt) -> bool:
        return True

    def _write(self, receipt: Receipt, time_ns: int, trace_headers: Mapping[str, str] | None) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        pass

    # ---- the writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._closing.is_set():
                    break
                continue
            try:
                self._write(*item)
            except Exception as exc:  # noqa: BLE001 - a failed write is a dropped receipt, never a dead writer
                self._write_failed(exc)
        try:
            self._finish()
        except Exception as exc:  # noqa: BLE001
            log.warning("kvtier: receipt %s sink failed to close: %s", self.name, exc)

    def _write_failed(self, exc: BaseException | Any) -> None:
        self._failed_writes += 1
        self._warn("failed", self._failed_writes, f"writing failed ({exc})")

    def _warn(self, kind: str, count: int, why: str) -> None:
        """Log dropped receipts at most once per :data:`DROP_LOG_INTERVAL_S` (the first at once)."""
        seen, when = self._logged[kind]
        now = time.monotonic()
        if seen and now - when < DROP_LOG_INTERVAL_S:
            return
        self._logged[kind] = (count, now)
        log.warning("kvtier: receipt %s sink dropped %d receipt(s) since %s: %s "
                    "(kvtier_receipts_dropped_total{sink=%r})", self.name, count - seen,
                    "its start" if not seen else "the last warning", why, self.name)
