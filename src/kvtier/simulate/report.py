"""Sweep results as a rich table, as JSON, and the Belady-gap summary.

JSON (``--json PATH``), exactly::

    {"elapsed_s": float,
     "rows": [{"policy": str, "cpu_gib": float, "token_hit_ratio": float,
               "chunk_hit_ratio": float, "bytes_loaded": int,
               "tier_hit_ratio": {"engine": float, "cpu": float, "disk": float, "shared": float},
               "saved_s": float}, ...]}

``token_hit_ratio``: prompt tokens served by any tier (engine, cpu, disk, shared) / prompt
tokens; ``tier_hit_ratio``: the same per serving tier; ``chunk_hit_ratio``: chunks served /
chunks that could hit; ``bytes_loaded``: bytes loaded into the engine from cpu, disk and shared;
``saved_s``: estimated prefill seconds saved (:mod:`kvtier.simulate.cost`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from kvtier.core.policies.registry import DEFAULT_POLICY
from kvtier.simulate.cost import Throughputs, TimeSaved, time_saved
from kvtier.simulate.sweep import SweepResult, SweepRow

LRU_POLICIES = ("lru", "lru-tail")


def gib_text(gib: float) -> str:
    """A capacity in GiB as the tools print numbers: thousands separators, no exponent, no trailing
    zeros (``1,048,576``, ``2,048``, ``0.5``); ``:g`` printed ``2048`` and ``1.04858e+06``."""
    return f"{gib:,.6f}".rstrip("0").rstrip(".")


def row_time_saved(row: SweepRow, rates: Throughputs) -> TimeSaved:
    """Prefill seconds saved over the trace by this run's hits."""
    c = row.counts
    per_token = row.chunk_bytes / row.block_tokens
    return time_saved(row.tokens(c.engine_hits), row.tokens(c.cpu_hits), row.tokens(c.disk_hits), per_token, rates,
                      row.tokens(c.shared_hits), (c.cpu_loads, c.disk_loads, c.shared_loads))


def to_json(result: SweepResult, elapsed_s: float, rates: Throughputs | None = None) -> dict[str, Any]:
    """The JSON document of the module docstring."""
    rates = rates or Throughputs()
    return {"elapsed_s": elapsed_s,
            "rows": [{"policy": r.policy, "cpu_gib": r.cpu_gib, "token_hit_ratio": r.token_hit_ratio,
                      "chunk_hit_ratio": r.chunk_hit_ratio, "bytes_loaded": r.bytes_loaded,
                      "tier_hit_ratio": {t: r.tier_token_hit_ratio(t) for t in ("engine", "cpu", "disk", "shared")},
                      "saved_s": row_time_saved(r, rates).total_s}
                     for r in result.rows]}


def write_json(path: Path, result: SweepResult, elapsed_s: float, rates: Throughputs | None = None) -> None:
    """Write :func:`to_json` to ``path`` (OSError if the directory is missing or read-only)."""
    path.write_text(json.dumps(to_json(result, elapsed_s, rates), indent=2) + "\n", encoding="utf-8")


def table(result: SweepResult, rates: Throughputs) -> Table:
    """One line per (cpu capacity, policy): token hit ratio in all and per serving tier, and
    prefill seconds saved.  Fits 80 columns (per-tier GiB moved and chunk ratios are in --json)."""
    tiers = ["cpu"] + [t for t, n in (("disk", result.disk_chunks), ("shared", result.shared_chunks)) if n > 0]
    spec = result.spec
    title = f"engine {gib_text(spec.engine_gib)} GiB"
    if result.disk_chunks:
        title += f", disk {gib_text(spec.disk_gib)} GiB" + (f" ({spec.admission[0]})" if spec.admission[0] != "all" else "")
    if result.shared_chunks:
        title += f", shared {gib_text(spec.shared_gib)} GiB" + (
            f" ({spec.admission[1]})" if spec.admission[1] != "all" else "")
    t = Table(title=title, caption=f"saved: prefill s; engine: {_engine_share(result):.1%}", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("cpu GiB", "policy", "hit", *tiers, "saved s"):
        t.add_column(header, justify="left" if header == "policy" else "right", no_wrap=True)
    previous = None
    for row in result.rows:
        saved = row_time_saved(row, rates)
        t.add_row(gib_text(row.cpu_gib) if row.cpu_gib != previous else "", _short(row.policy),
                  f"{row.token_hit_ratio:.1%}", *(f"{row.tier_token_hit_ratio(tier):.1%}" for tier in tiers),
                  f"{saved.total_s:,.0f}")
        previous = row.cpu_gib
    return t


def _engine_share(result: SweepResult) -> float:
    return result.rows[0].tier_token_hit_ratio("engine") if result.rows else 0.0


def _short(policy: str) -> str:
    return f"default={DEFAULT_POLICY}" if policy == "default" else policy


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
        """(policy - LRU) / (Belady - LRU); ``None`` where it means nothing: no gap, or the policy
        below LRU (at a tier of a handful of chunks a few hits of difference gave "-375 %")."""
        if self.gap <= 1e-12 or self.policy < self.lru - 1e-12:
            return None
        return (self.policy - self.lru) / self.gap


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
    t = Table(title=f"LRU–Belady gap closed by {_short(policy)} (* widest)", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("cpu GiB", "best LRU", _short(policy), "Belady", "gap", "closed"):
        t.add_column(header, justify="right", no_wrap=True)
    for g in gaps:
        closed = "–" if g.closed is None else f"{g.closed:.1%}"
        t.add_row(gib_text(g.cpu_gib) + (" *" if g is widest else ""), f"{g.lru:.2%}", f"{g.policy:.2%}",
                  f"{g.belady:.2%}", f"{g.gap:.2%}", closed)
    if any(g.closed is None for g in gaps):
        t.caption = f"–: no gap, or {_short(policy)} below the best LRU"
    return t


def print_report(console: Console, result: SweepResult, rates: Throughputs) -> None:
    console.print(table(result, rates))
    for policy in ("default",) if "default" in result.spec.policies else ():
        gaps = belady_gaps(result, policy)
        if gaps:
            console.print(gap_table(gaps, policy))
