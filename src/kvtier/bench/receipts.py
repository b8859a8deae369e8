"""The bench reads receipts (issue 35 item 4): tokens per tier and the miss-reason table of a run,
from the requests' cache receipts, beside the same sums from the server's metric deltas, and the
places where the two disagree.

The bench streams its requests, and a streamed response carries no ``kv_transfer_params``, so the
receipts come from the server's receipt log (``receipt_log_path``, docs/receipts.md): a
:class:`LogCursor` taken before the run reads back what the server appended during it, across
rotations.  Metrics: ``kvtier_served_tokens_total{tier}`` and
``kvtier_missed_tokens_total{reason,tier}``, whose sums equal the receipts' (issue 35 item 2): a
receipt counts its ``tokens[tier]`` as served by each tier, and its ``computed`` tokens as missed
for its ``miss`` reason and tier.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvtier.bench.meters import MetricsSnapshot
from kvtier.core.receipt import NO_TIER, Receipt, miss_tier_label

SERVED = "kvtier_served_tokens"
MISSED = "kvtier_missed_tokens"
NOT_TIERS = ("engine", "computed")
"""Rows of a receipt's ``tokens`` that no kvtier tier served (vLLM's own cache, computed)."""
WAIT_S = 5.0
"""Longest the bench waits after a run for the server's writer thread to log its receipts."""


def miss_key(reason: str, tier: str) -> str:
    """A miss-table row: ``reason`` for a reason about no tier (a receipt's ``""``, the metric's
    label :data:`~kvtier.core.receipt.NO_TIER`), else ``reason/tier``: receipts and metrics alike."""
    label = miss_tier_label(tier)
    return reason if label == NO_TIER else f"{reason}/{label}"


@dataclass(frozen=True)
class ReceiptTally:
    """Sums over a run's requests: ``tokens`` per receipt row (``engine``, each tier, ``computed``)
    and ``missed`` tokens per :func:`miss_key`; ``requests`` the receipts summed (None: from metrics)."""

    tokens: dict[str, float] = field(default_factory=dict)
    missed: dict[str, float] = field(default_factory=dict)
    requests: int | None = None

    @classmethod
    def of(cls, receipts: Iterable[Receipt]) -> ReceiptTally:
        tokens: dict[str, float] = {}
        missed: dict[str, float] = {}
        n = 0
        for r in receipts:
            n += 1
            for row, count in r.tokens.items():
                tokens[row] = tokens.get(row, 0.0) + count
            if r.tokens.get("computed"):  # the metric's rule (Receipt.computed_miss): a null miss is partial_chunk
                key = miss_key(*r.computed_miss())
                missed[key] = missed.get(key, 0.0) + r.tokens["computed"]
        return cls(tokens, missed, n)

    def tiers(self) -> dict[str, float]:
        """Tokens served per kvtier tier (``engine`` and ``computed`` left out)."""
        return {t: n for t, n in self.tokens.items() if t not in NOT_TIERS}

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "tokens": self.tokens, "missed": self.missed}


def metric_tally(before: MetricsSnapshot, after: MetricsSnapshot) -> ReceiptTally | None:
    """The run's served and missed tokens from the metric deltas; None when the server exports no
    ``kvtier_missed_tokens`` (a kvtier without receipts, or another connector)."""
    if MISSED not in after.counters:
        return None

    def grouped(family: str, labels: tuple[str, ...]) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {}
        for snap, sign in ((after, 1.0), (before, -1.0)):
            for label_set, value in snap.counters.get(family, {}).items():
                key = tuple(dict(label_set).get(name, "") for name in labels)
                out[key] = out.get(key, 0.0) + sign * value
        return out

    served = {tier: n for (tier,), n in grouped(SERVED, ("tier",)).items()}
    missed = {miss_key(reason, tier): n for (reason, tier), n in grouped(MISSED, ("reason", "tier")).items() if n}
    return ReceiptTally(served, missed)


def disagreements(receipts: ReceiptTally, metrics: ReceiptTally) -> list[str]:
    """Sentences naming each tier and miss row where the receipts' sum is not the metrics' (a
    receipt lost by the log, or a metric counted apart from the receipts)."""
    out = []
    for name, mine, theirs in (("served by", receipts.tiers(), metrics.tiers()),
                               ("missed for", receipts.missed, metrics.missed)):
        for key in sorted(set(mine) | set(theirs)):
            a, b = mine.get(key, 0.0), theirs.get(key, 0.0)
            if a != b:
                out.append(f"tokens {name} {key}: receipts {a:,.0f}, metrics {b:,.0f}")
    return out


class LogCursor:
    """Where a receipt log stood before a run; :meth:`read_new` reads back the receipts appended
    since, across rotations (``path`` → ``path.1`` → …, as :class:`logging.handlers.RotatingFileHandler`
    renames them).

    Args:
        path: the server's ``receipt_log_path`` (readable from the bench's host).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            st = os.stat(self.path)
            self._inode: int | None = st.st_ino
            self._offset = st.st_size
        except FileNotFoundError:
            self._inode, self._offset = None, 0

    def _files(self) -> list[str]:
        """The log's files, oldest first, from the one that was current at the start."""
        names = [self.path]
        n = 1
        while os.path.exists(f"{self.path}.{n}"):
            names.append(f"{self.path}.{n}")
            n += 1
        names.reverse()
        start = next((i for i, name in enumerate(names) if os.stat(name).st_ino == self._inode), None)
        if start is None:  # the start's file rotated out of reach (or there was none): all of them
            return names
        return names[start:]

    def read_new(self, expect: int = 0, wait_s: float = WAIT_S) -> list[Receipt]:
        """The receipts appended since the cursor was taken, oldest first; waits at most ``wait_s``
        for at least ``expect`` of them (the server's writer thread is behind by a few ms).

        Raises:
            msgspec.ValidationError, msgspec.DecodeError: a line is not a receipt.
        """
        deadline = time.monotonic() + wait_s
        while True:
            found = self._read()
            if len(found) >= expect or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def _read(self) -> list[Receipt]:
        decoder = msgspec.json.Decoder(Receipt)
        out: list[Receipt] = []
        for i, name in enumerate(self._files()):
            try:
                with open(name, "rb") as handle:
                    if i == 0 and os.fstat(handle.fileno()).st_ino == self._inode:
                        handle.seek(self._offset)
                    data = handle.read()
            except FileNotFoundError:  # rotated away while reading: read again
                return self._read()
            out.extend(decoder.decode(line) for line in data.splitlines() if line.strip())
        return out


@dataclass(frozen=True)
class RunReceipts:
    """A run's receipts and what the metrics say of the same requests."""

    receipts: ReceiptTally
    metrics: ReceiptTally | None
    sent: int
    """Requests the bench sent (each finished request has a receipt, aborted ones included)."""

    @property
    def sampled(self) -> bool:
        """Fewer receipts than requests: a sampled log (``receipt_log_sample`` < 1) or lost lines."""
        return (self.receipts.requests or 0) < self.sent

    def notes(self) -> list[str]:
        """What to say besides the table: a sampled log, no metrics, and every disagreement."""
        if self.metrics is None:
            return ["the server exports no kvtier_missed_tokens_total: receipts only, nothing to compare"]
        out = []
        if self.sampled:
            out.append(f"{self.receipts.requests} receipts for {self.sent} requests (a sampled receipt log, or "
                       f"kvtier_receipts_dropped_total rose): the sums are not compared")
        else:
            out.extend(f"disagree: {d}" for d in disagreements(self.receipts, self.metrics))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"receipts": self.receipts.to_dict(), "metrics": None if self.metrics is None else self.metrics.to_dict(),
                "sent": self.sent, "notes": self.notes()}
