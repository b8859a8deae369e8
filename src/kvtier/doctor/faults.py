"""The local tiers' faults between two scrapes: failed writes, dropped saves, corrupt chunks.

Read from kvtier's counters (src/kvtier/integrations/vllm/stats_table.py; a standalone store's
own registry, :mod:`kvtier.core.metrics`, names them the same way):

- ``kvtier_<tier>_write_errors`` (vLLM's payload, one per local lower tier) or
  ``kvtier_write_errors{tier}`` (a store's registry): chunk writes the tier's storage refused (a
  full or read-only directory, an I/O error); those chunks were not stored;
- ``kvtier_dropped_saves``: saves given up by any tier (no room, a full write queue, a failed write);
- ``kvtier_corrupt_chunks``: chunks that failed verification (recomputed).

Every counter is summed over engines and ranks; a counter lower in the second scrape (a restart)
counts from zero.  No I/O: :func:`fault_series` reads one parsed scrape, :func:`faults_between`
the deltas, :func:`fault_checks` the sentences.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

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


def fault_checks(f: LocalFaults) -> list[tuple[FaultLevel, str]]:
    """``(level, sentence)`` per fault that rose between the scrapes (nothing when none did)."""
    out: list[tuple[FaultLevel, str]] = []
    for tier, errors in f.write_errors.items():
        out.append(("problem", (f"Local tier ({tier}): {errors:,.0f} chunk writes failed between the scrapes "
                    f"({f.dropped_saves:,.0f} saves dropped): the {tier} tier's directory is most likely full or "
                    "unwritable (disk full, read-only mount, permissions, I/O error); those chunks are not stored "
                    f"and are lost at a restart; free space or fix the directory (the engine log names the error), "
                    f"or lower the {tier} tier's size below the free space.")))
    if not f.write_errors and f.dropped_saves > 0:
        out.append(("warning", (f"Saves: {f.dropped_saves:,.0f} chunk saves dropped between the scrapes with no "
                    "failed write: no room in the top tier or a full write queue; raise cpu_gib, or "
                    "save_queue_depth and io_threads (the miss reasons name the tier).")))
    if f.corrupt_chunks > 0:
        out.append(("warning", (f"Corrupt chunks: {f.corrupt_chunks:,.0f} chunks failed verification between the "
                    "scrapes and were recomputed: check the disk or the bucket (kernel log, SMART) and purge what "
                    "is damaged (kvtier purge).")))
    return out
