"""A graceful stop's flush of the dirty chunks to the local lower tiers, and its log line.

A chunk still dirty after :meth:`kvtier.core.store.TieredStore.flush_dirty` either failed to
write (the tier's storage refused it: a full or read-only disk, counted in the tiers'
``write_errors``) or was not reached before ``shutdown_flush_s``: the line says which, with the
tier's last error, so that a full disk is not blamed on the time limit.  No vLLM import.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from kvtier.core.store import TieredStore


class FlushReport(NamedTuple):
    written: int
    failed: int
    """Chunks whose write the tier refused (they stay lost)."""
    missed: int
    """Chunks not written before the time limit."""
    error: str
    """The local tiers' last write error (``"No space left on device"``), "" when none failed."""
    seconds: float


def flush_on_stop(store: TieredStore, timeout_s: float) -> FlushReport:
    """Flush ``store``'s dirty chunks within ``timeout_s`` and tell failed writes from missed ones."""
    errors_before = store.stats().write_errors
    t0 = time.monotonic()
    written, lost = store.flush_dirty(timeout_s)
    seconds = time.monotonic() - t0
    failed = min(max(store.stats().write_errors - errors_before, 0), lost)
    error = next((why for lt in store.index.local if (why := str(getattr(lt.tier, "last_write_error", "") or ""))),
                 "") if failed else ""
    return FlushReport(written, failed, lost - failed, error, seconds)


def flush_line(report: FlushReport, rank: str, chunk_bytes: int, timeout_s: float) -> tuple[int, str]:
    """``(logging level, message)`` of ``report`` for the worker named ``rank`` (``rank 0``;
    :func:`~kvtier.integrations.vllm.worker.registration.rank_name`)."""
    head = f"kvtier: {rank} shutdown flush wrote {report.written} dirty chunks to disk in {report.seconds:.1f} s"
    if not report.failed and not report.missed:
        return logging.INFO, head

    def mib(n: int) -> str:
        return f"{n * chunk_bytes / (1 << 20):.1f} MiB"

    parts = []
    if report.failed:
        parts.append(f"{report.failed} ({mib(report.failed)}) failed to write ({report.error or 'see the disk tier warning'}: "
                     "the disk is full or unwritable; free space or fix the directory) and are lost")
    if report.missed:
        parts.append(f"{report.missed} ({mib(report.missed)}) missed shutdown_flush_s={timeout_s} and are lost "
                     "(raise shutdown_flush_s, and VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS above it)")
    return logging.WARNING, f"{head}; {'; '.join(parts)}"
