"""The receipts of a comparison in its reports (:mod:`kvtier.bench.comparereceipts`): per kvtier
arm and run, tokens per tier and the miss-reason table from the receipts beside the metric deltas,
and the notes (disagreements, a sampled log, a server without receipt metrics)."""

from __future__ import annotations

from typing import Any

from kvtier.bench.compare import ArmOutcome, CompareResult
from kvtier.bench.receipts import RunReceipts


def _label(o: ArmOutcome, result: CompareResult) -> str:
    return o.arm.name + (f" (run {o.repeat})" if result.repeats > 1 else "")


def receipt_rows(r: RunReceipts) -> list[tuple[str, str, str]]:
    """``(row, receipts, metrics)`` formatted: ``served: <row>`` per receipt token row (``engine``,
    each tier, ``computed``), then ``missed: <reason[/tier]>`` most tokens first; ``-`` where the
    metrics have no such row."""
    theirs_tokens = r.metrics.tokens if r.metrics is not None else {}
    theirs_missed = r.metrics.missed if r.metrics is not None else {}
    out = [(f"served: {row}", f"{r.receipts.tokens.get(row, 0):,.0f}",
            f"{theirs_tokens[row]:,.0f}" if row in theirs_tokens else "-")
           for row in sorted(set(r.receipts.tokens) | set(theirs_tokens))]
    out += [(f"missed: {row}", f"{r.receipts.missed.get(row, 0):,.0f}",
             f"{theirs_missed[row]:,.0f}" if row in theirs_missed else "-")
            for row in sorted(set(r.receipts.missed) | set(theirs_missed), key=lambda k: -r.receipts.missed.get(k, 0))]
    return out


def receipts_json(result: CompareResult) -> dict[str, list[dict[str, Any]]]:
    """``{ARM: [per run {"repeat", "receipts", "metrics", "sent", "notes"}]}`` for arms whose runs
    logged receipts (:meth:`~kvtier.bench.receipts.RunReceipts.to_dict`)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for o in result.outcomes:
        if o.receipts is not None:
            out.setdefault(o.arm.name, []).append({"repeat": o.repeat, **o.receipts.to_dict()})
    return out


def print_receipts(console: Any, result: CompareResult) -> None:
    """Per run with receipts: its table (receipts vs metrics, tokens) and notes."""
    from rich.table import Table

    for o in result.outcomes:
        if o.receipts is None:
            continue
        r = o.receipts
        console.print(f"{_label(o, result)}: receipts ({r.receipts.requests} of {r.sent} requests) vs metrics, tokens",
                      highlight=False)  # not the table's title: rich wraps a title to the table's width
        table = Table()
        for col in ("row", "receipts", "metrics"):
            table.add_column(col, justify="right" if col != "row" else "left")
        for row in receipt_rows(r):
            table.add_row(*row)
        console.print(table)
        for note in r.notes():
            console.print(f"{_label(o, result)} receipts: {note}", highlight=False)


def receipt_markdown(result: CompareResult) -> list[str]:
    """The Markdown section (empty when no run logged receipts)."""
    lines: list[str] = []
    for o in result.outcomes:
        if o.receipts is None:
            continue
        r = o.receipts
        if not lines:
            lines = ["## Receipts vs metrics", "", ("Tokens per tier and miss reasons from the requests' receipts "
                     "(each kvtier server's receipt log in the output directory) beside the metric deltas."), ""]
        lines += [f"**{_label(o, result)}**: {r.receipts.requests} receipts for {r.sent} requests", "",
                  "| row | receipts | metrics |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in receipt_rows(r)]
        lines += [""] + [f"- {note}" for note in r.notes()] + ([""] if r.notes() else [])
    return lines
