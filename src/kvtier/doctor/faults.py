"""The local tiers' faults between two scrapes: failed writes, dropped saves, corrupt chunks.

Read from kvtier's counters (src/kvtier/integrations/vllm/stats_table.py; a standalone store's
own registry, :mod:`kvtier.core.metrics`, names them the same way):

- ``kvtier_<tier>_write_errors`` (vLLM's payload, one per local lower tier) or
  ``kvtier_write_errors{tier}`` (a store's registry): chunk writes the tier's storage refused (a
  full or read-only directory, an I/O error); those chunks were not stored;
- ``kvtier_dropped_saves``: saves given up by any tier (no room, a full write queue, a failed write);
- ``kvtier_corrupt_chunks``: chunks that failed verification (recomputed).

A write-through shared tier's write that fails or is skipped (breaker open) is a dropped save too,
also counted in its ``kvtier_<tier>_skipped_writes``: :func:`fault_checks` reads the two side by
side (docs/vllm.md), so a shared tier that is down is not mistaken for a top tier too small.

Every counter is summed over engines and ranks; a counter lower in the second scrape (a restart)
counts from zero.  No I/O: :func:`fault_series` reads one parsed scrape, :func:`faults_between`
the deltas, :func:`fault_checks` the sentences.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvtier.doctor.causes import counter_delta

WRITE_ERRORS = re.compile(r"kvtier_([a-z0-9_]+)_write_errors")
"""vLLM's per-tier write-error counter, ``kvtier_<tier>_write_errors`` (``_total``)."""
STORE_WRITE_ERRORS = "kvtier_write_errors"
"""A store's own registry: ``kvtier_write_errors{tier}``."""
DROPPED = "kvtier_dropped_saves"
CORRUPT = "kvtier_corrupt_chunks"
FaultLevel = Literal["warning", "problem"]


@dataclass
class FaultSeries:
    """One scrape's fault counters; ``present`` False when the scrape has none (not kvtier)."""

    write_errors: dict[str, float] = field(default_factory=dict)
    """``tier → failed chunk writes``."""
    dropped_saves: float = 0.0
    corrupt_chunks: float = 0.0
    present: bool = False


def fault_series(families: Iterable[Any]) -> FaultSeries:
    """The fault counters of one parsed scrape (prometheus_client families; ``_created``, negative
    and non-finite samples left out)."""
    out = FaultSeries()
    for family in families:
        found = WRITE_ERRORS.fullmatch(family.name)
        if found is None and family.name not in (STORE_WRITE_ERRORS, DROPPED, CORRUPT):
            continue
        out.present = True
        for s in family.samples:
            if not s.name.endswith("_total") or not math.isfinite(s.value) or s.value < 0:
                continue
            if found is not None or family.name == STORE_WRITE_ERRORS:
                tier = found.group(1) if found is not None else s.labels.get("tier", "?")
                out.write_errors[tier] = out.write_errors.get(tier, 0.0) + s.value
            elif family.name == DROPPED:
                out.dropped_saves += s.value
            else:
                out.corrupt_chunks += s.value
    return out


@dataclass(frozen=True)
class LocalFaults:
    """What went wrong in the local tiers between the scrapes."""

    write_errors: dict[str, float]
    """``tier → chunk writes that failed`` (only tiers whose count rose)."""
    dropped_saves: float
    corrupt_chunks: float


def faults_between(before: FaultSeries, after: FaultSeries) -> LocalFaults | None:
    """The deltas of ``after`` over ``before``; None when ``after`` has no fault counter."""
    if not after.present:
        return None
    errors = {tier: counter_delta(n, before.write_errors.get(tier, 0.0))
              for tier, n in sorted(after.write_errors.items())}
    return LocalFaults({tier: n for tier, n in errors.items() if n > 0},
                       counter_delta(after.dropped_saves, before.dropped_saves),
                       counter_delta(after.corrupt_chunks, before.corrupt_chunks))


class SharedWrites(Protocol):
    """A shared tier's writes between the same scrapes (:class:`kvtier.doctor.meters.SharedTier`)."""

    @property
    def tier(self) -> str:
        """Its name (``redis``, ``s3``, ``node``)."""

    @property
    def skipped_writes(self) -> float:
        """Chunks not written to it (the write failed, or its breaker was open)."""

    @property
    def errors(self) -> float:
        """Calls that failed."""

    @property
    def breaker(self) -> str:
        """``closed``, ``half-open (probing)`` or ``open`` at the second scrape."""


def _shared_drops(dropped: float, shared: Sequence[SharedWrites]) -> tuple[FaultLevel, str] | None:
    """The dropped saves the shared tiers' skipped writes account for, in words (None when they skipped none)."""
    down = [t for t in shared if t.skipped_writes > 0]
    if not down:
        return None
    skipped = sum(t.skipped_writes for t in down)
    tiers = ", ".join(f"{t.tier or 'shared'}: {t.skipped_writes:,.0f} writes skipped, {t.errors:,.0f} failed calls, "
                      f"breaker {t.breaker}" for t in down)
    rest = dropped - skipped
    more = (f"; the other {rest:,.0f} found no room in the top tier or a full write queue: raise cpu_gib, or "
            "save_queue_depth and io_threads (the miss reasons name the tier)" if rest > 0 else "")
    return ("warning", (f"Saves: {dropped:,.0f} chunk saves dropped between the scrapes with no failed local "
            f"write, while the shared tier could not take them ({tiers}): it was down or refused kvtier, so "
            "those chunks are not shared with other replicas; fix the shared tier (its line says what to check), "
            f"a larger cpu_gib would not help{more}."))


def fault_checks(f: LocalFaults, shared: Sequence[SharedWrites] = ()) -> list[tuple[FaultLevel, str]]:
    """``(level, sentence)`` per fault that rose between the scrapes (nothing when none did).

    ``shared``: the shared tiers between the same scrapes; dropped saves with no failed local write
    are put down to them as far as their skipped writes go, the rest to the top tier's room and the
    write queues."""
    out: list[tuple[FaultLevel, str]] = []
    for tier, errors in f.write_errors.items():
        out.append(("problem", (f"Local tier ({tier}): {errors:,.0f} chunk writes failed between the scrapes "
                    f"({f.dropped_saves:,.0f} saves dropped): the {tier} tier's directory is most likely full or "
                    "unwritable (disk full, read-only mount, permissions, I/O error); those chunks are not stored "
                    f"and are lost at a restart; free space or fix the directory (the engine log names the error), "
                    f"or lower the {tier} tier's size below the free space.")))
    blamed = _shared_drops(f.dropped_saves, shared) if not f.write_errors and f.dropped_saves > 0 else None
    if blamed is not None:
        out.append(blamed)
    elif not f.write_errors and f.dropped_saves > 0:
        out.append(("warning", (f"Saves: {f.dropped_saves:,.0f} chunk saves dropped between the scrapes with no "
                    "failed write: no room in the top tier or a full write queue; raise cpu_gib, or "
                    "save_queue_depth and io_threads (the miss reasons name the tier).")))
    if f.corrupt_chunks > 0:
        out.append(("warning", (f"Corrupt chunks: {f.corrupt_chunks:,.0f} chunks failed verification between the "
                    "scrapes and were recomputed: check the disk or the bucket (kernel log, SMART) and purge what "
                    "is damaged (kvtier purge).")))
    return out
