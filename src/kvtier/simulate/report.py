"""Sweep results as a rich table, as JSON, and the Belady-gap summary.

JSON (``--json PATH``), exactly::

    {"elapsed_s": float,
     "rows": [{"policy": str, "cpu_gib": float, "token_hit_ratio": float,
               "chunk_hit_ratio": float, "bytes_loaded": int}, ...]}

``token_hit_ratio``: prompt tokens served by any tier (engine, cpu, disk) / prompt tokens;
``chunk_hit_ratio``: chunks served / chunks that could hit; ``bytes_loaded``: bytes loaded into
the engine from cpu and disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.simulate.cost import Throughputs, TimeSaved, time_saved
from kvtier.simulate.sweep import GIB, SweepResult, SweepRow, policy_label

LRU_POLICIES = ("lru", "lru-tail")


def row_time_saved(row: SweepRow, rates: Throughputs) -> TimeSaved:
    """Prefill seconds saved over the trace by this run's hits."""
    c = row.counts
    per_token = row.chunk_bytes / row.block_tokens
    return time_saved(row.tokens(c.engine_hits), row.tokens(c.cpu_hits), row.tokens(c.disk_hits), per_token, rates)


def to_json(result: SweepResult, elapsed_s: float) -> dict[str, Any]:
    """The JSON document of the module docstring."""
    return {"elapsed_s": elapsed_s,
            "rows": [{"policy": r.policy, "cpu_gib": r.cpu_gib, "token_hit_ratio": r.token_hit_ratio,
                      "chunk_hit_ratio": r.chunk_hit_ratio, "bytes_loaded": r.bytes_loaded}
                     for r in result.rows]}


def write_json(path: Path, result: SweepResult, elapsed_s: float) -> None:
    """Write :func:`to_json` to ``path`` (OSError if the directory is missing or read-only)."""
    path.write_text(json.dumps(to_json(result, elapsed_s), indent=2) + "\n", encoding="utf-8")


def table(result: SweepResult, rates: Throughputs) -> Table:
    """One line per (cpu capacity, policy): token hit ratio in all and per serving tier, chunk hit
    ratio, GiB loaded into the engine and stored into the tiers, prefill seconds saved."""
    has_disk = result.disk_chunks > 0
    title = f"engine tier {result.spec.engine_gib:g} GiB ({result.engine_chunks} chunks)"
    if has_disk:
        title += f", disk tier {result.spec.disk_gib:g} GiB ({result.disk_chunks} chunks)"
    t = Table(title=title, caption=f"{policy_label('default')}; hit: prompt tokens not recomputed, and by "
              "serving tier; saved: prefill seconds, total (cpu + disk part)")
    tiers = ("engine", "cpu", "disk") if has_disk else ("engine", "cpu")
    for header in ("cpu GiB", "policy", "hit", *tiers, "chunk hit", "loaded GiB", "stored GiB", "saved s"):
        t.add_column(header, justify="left" if header == "policy" else "right")
    previous = None
    for row in result.rows:
        c = row.counts
        saved = row_time_saved(row, rates)
        t.add_row(f"{row.cpu_gib:g}" if row.cpu_gib != previous else "", row.policy,
                  f"{row.token_hit_ratio:.1%}", *(f"{row.tier_token_hit_ratio(tier):.1%}" for tier in tiers),
                  f"{row.chunk_hit_ratio:.1%}", f"{row.bytes_loaded / GIB:,.0f}",
                  f"{(c.cpu_stores + c.disk_stores) * row.chunk_bytes / GIB:,.0f}",
                  f"{saved.total_s:,.0f} ({saved.offload_s:,.0f})")
        previous = row.cpu_gib
    return t


@dataclass(frozen=True)
class GapRow:
    """At one capacity: the stronger LRU, Belady, a policy, and the share of the gap it closes."""

    cpu_gib: float
    lru: float
    belady: float
    policy: float

    @property
    def gap(self) -> float:
        return self.belady - self.lru

    @property
    def closed(self) -> float | None:
        """(policy - LRU) / (Belady - LRU); ``None`` where there is no gap."""
        return (self.policy - self.lru) / self.gap if self.gap > 1e-12 else None


def belady_gaps(result: SweepResult, policy: str) -> list[GapRow]:
    """Per capacity, the gap between the stronger of ``lru``/``lru-tail`` and Belady (token hit
    ratios) and the share ``policy`` closes.  Empty unless belady, policy and an LRU were swept."""
    names = set(result.spec.policies)
    if "belady" not in names or policy not in names or not names & set(LRU_POLICIES):
        return []
    out = []
    for gib in result.spec.cpu_gibs:
        hits = {r.policy: r.token_hit_ratio for r in result.rows if r.cpu_gib == gib}
        lru = max(hits[name] for name in LRU_POLICIES if name in hits)
        out.append(GapRow(gib, lru, hits["belady"], hits[policy]))
    return out


def gap_table(gaps: list[GapRow], policy: str) -> Table:
    widest = max(gaps, key=lambda g: g.gap)
    t = Table(title=f"share of the LRU–Belady gap closed by {policy_label(policy)} (widest gap: {widest.cpu_gib:g} GiB)")
    for header in ("cpu GiB", "best LRU", policy_label(policy), "Belady", "gap", "closed"):
        t.add_column(header, justify="right")
    for g in gaps:
        closed = "–" if g.closed is None else f"{g.closed:.1%}"
        t.add_row(f"{g.cpu_gib:g}" + (" *" if g is widest else ""), f"{g.lru:.2%}", f"{g.policy:.2%}",
                  f"{g.belady:.2%}", f"{g.gap:.2%}", closed)
    return t


def print_report(console: Console, result: SweepResult, rates: Throughputs) -> None:
    console.print(table(result, rates))
    for policy in ("default",) if "default" in result.spec.policies else ():
        gaps = belady_gaps(result, policy)
        if gaps:
            console.print(gap_table(gaps, policy))
