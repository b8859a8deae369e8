"""``kvtier bench compare`` reads receipts (issue 35 item 4): per kvtier arm and run, the tokens
per tier and the miss-reason table from the requests' receipts beside the metric deltas, and where
they disagree, as ``kvtier bench run --receipt-log`` does (:mod:`kvtier.bench.receipts`).

**Where the receipts come from.**  The compare bench starts the servers, so it sets each kvtier
server's ``receipt_log_path`` itself: every replica of an arm's run logs to its own file beside
its server log, ``<out>/<stem>[-r<i>].receipts.jsonl`` (one file per server: two writers on one
file would interleave rotations).  An arm whose connector is not kvtier's gets none.  A
``receipt_log_path`` in ``--kvtier-config`` is replaced (one log per server and run, in ``--out``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvtier.bench.meters import MetricsSnapshot
from kvtier.bench.receipts import WAIT_S, LogCursor, ReceiptTally, RunReceipts, metric_tally
from kvtier.core.receipt import Receipt
from kvtier.launch.serve import ServerSpec

KVTIER_CONNECTOR = "KVTierConnector"
LOG_KEY = "receipt_log_path"


def receipt_log_path(server_log: Path) -> Path:
    """The receipt log of the server that logs to ``server_log``: beside it, ``.receipts.jsonl``."""
    return server_log.with_suffix(".receipts.jsonl")


def with_receipt_logs(specs: Sequence[ServerSpec], server_logs: Sequence[Path]) -> tuple[list[ServerSpec],
                                                                                          list[Path | None]]:
    """Each kvtier server's spec with its own ``receipt_log_path`` (:func:`receipt_log_path` of its
    server log; an old file there removed), and the paths (``None`` for a server without kvtier's
    connector, whose spec is left as it is)."""
    out_specs: list[ServerSpec] = []
    paths: list[Path | None] = []
    for spec, log in zip(specs, server_logs, strict=True):
        config = spec.kv_transfer_config or {}
        if config.get("kv_connector") != KVTIER_CONNECTOR:
            out_specs.append(spec)
            paths.append(None)
            continue
        path = receipt_log_path(log)
        path.unlink(missing_ok=True)
        extra = {**(config.get("kv_connector_extra_config") or {}), LOG_KEY: str(path)}
        out_specs.append(dataclasses.replace(spec, kv_transfer_config={**config, "kv_connector_extra_config": extra}))
        paths.append(path)
    return out_specs, paths


def sum_tallies(parts: Sequence[ReceiptTally]) -> ReceiptTally:
    """The sums of several servers' tallies (``requests`` None if any part's is)."""
    tokens: dict[str, float] = {}
    missed: dict[str, float] = {}
    for p in parts:
        for row, n in p.tokens.items():
            tokens[row] = tokens.get(row, 0.0) + n
        for row, n in p.missed.items():
            missed[row] = missed.get(row, 0.0) + n
    counts = [p.requests for p in parts]
    return ReceiptTally(tokens, missed, None if any(c is None for c in counts) else sum(c or 0 for c in counts))


def read_all(cursors: Sequence[LogCursor], expect: int, wait_s: float = WAIT_S) -> list[list[Receipt]]:
    """Per cursor the receipts appended since it was taken; waits at most ``wait_s`` for
    ``expect`` of them in all (the servers' writer threads are a few ms behind).

    Raises:
        msgspec.ValidationError, msgspec.DecodeError: a line is not a receipt.
    """
    deadline = time.monotonic() + wait_s
    while True:
        found = [c.read_new(wait_s=0) for c in cursors]
        if sum(len(f) for f in found) >= expect or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def _spans_tally(spans: Sequence[tuple[MetricsSnapshot, MetricsSnapshot]]) -> ReceiptTally | None:
    tallies = [metric_tally(b, a) for b, a in spans]
    return None if any(t is None for t in tallies) else sum_tallies([t for t in tallies if t is not None])


def replica_receipts(cursors: Sequence[LogCursor | None], before: Sequence[MetricsSnapshot],
                     after: Sequence[MetricsSnapshot], sent: int,
                     restarts: Mapping[int, tuple[MetricsSnapshot, MetricsSnapshot]] | None = None) -> RunReceipts | None:
    """A run's receipts over the servers that log them (``cursors``, one per server, ``None`` for
    one without a log) beside the same servers' metric deltas; ``None`` when none logs them.  A
    server restarted during the run (``restarts[i]``: its scrapes before the stop and after the
    start) appends to the same log; its metric deltas are summed over the two lives.

    Raises:
        msgspec.ValidationError, msgspec.DecodeError: a log holds a line that is not a receipt.
    """
    mine = [i for i, c in enumerate(cursors) if c is not None]
    if not mine:
        return None
    logs = read_all([c for c in cursors if c is not None], sent)
    restarts = restarts or {}
    metrics = [_spans_tally([(before[i], restarts[i][0]), (restarts[i][1], after[i])] if i in restarts
                            else [(before[i], after[i])]) for i in mine]
    summed = None if any(m is None for m in metrics) else sum_tallies([m for m in metrics if m is not None])
    return RunReceipts(sum_tallies([ReceiptTally.of(r) for r in logs]), summed, sent)
