"""``kvtier bench run``: one workload against one running server, with its meters and verdict.

Files written with ``out``: ``requests.json`` (per request), ``summary.json`` (summary, meter
deltas and the figures a later run can be judged against with ``--baseline``), and the raw
``metrics-before.txt`` / ``metrics-after.txt``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.client import ClientOptions, run_workload
from kvtier.bench.meters import MeterDeltas, MetricsError, deltas, scrape
from kvtier.bench.receipts import LogCursor, ReceiptTally, RunReceipts, metric_tally
from kvtier.bench.results import RunResult
from kvtier.bench.verdict import ArmFigures, Verdict, judge, no_tokens_verdict
from kvtier.bench.workload import Workload


@dataclass(frozen=True)
class RunOutcome:
    """A finished ``bench run``: ``error`` is set (and the rest may be missing) when the server's
    meters could not be read."""

    workload: Workload
    run: RunResult | None
    meters: MeterDeltas | None
    error: str | None
    out_dir: Path | None
    receipts: RunReceipts | None = None
    """With ``--receipt-log``: the run's receipts beside the metrics' sums (:mod:`kvtier.bench.receipts`)."""

    def figures(self) -> ArmFigures | None:
        """Hit rate and TTFT percentiles, if the run had successful requests and meters."""
        if self.run is None or self.meters is None:
            return None
        ttft = self.run.summary().ttft_s
        if ttft is None or self.meters.prefix_hit_rate is None:  # no prompt token counted: no hit rate
            return None
        return ArmFigures(self.meters.prefix_hit_rate, ttft.p50, ttft.p99)


def run_once(workload: Workload, url: str, model: str, max_concurrency: int | None, stall_timeout_s: float,
             out_dir: Path | None, progress: bool = True, receipt_log: Path | None = None) -> RunOutcome:
    """Scrape, send the workload, scrape again; write the files if ``out_dir`` is given.  With
    ``receipt_log`` (the server's ``receipt_log_path``), read back the receipts it logged during the run.

    Raises:
        msgspec.ValidationError, msgspec.DecodeError: ``receipt_log`` holds a line that is not a receipt.
    """
    save = (lambda name: out_dir / name) if out_dir is not None else (lambda name: None)
    try:
        before = scrape(url, save_to=save("metrics-before.txt"))
    except MetricsError as exc:
        return RunOutcome(workload, None, None, str(exc), out_dir)
    cursor = LogCursor(receipt_log) if receipt_log is not None else None
    options = ClientOptions(base_url=url, model=model, max_concurrency=max_concurrency,
                            stall_timeout_s=stall_timeout_s, progress=progress)
    run = run_workload(workload, options)
    receipts = None
    try:
        after = scrape(url, save_to=save("metrics-after.txt"))
        meters: MeterDeltas | None = deltas(before, after)
        error = None
        if cursor is not None:
            summary = run.summary()
            sent = summary.num_ok + summary.num_failed
            receipts = RunReceipts(ReceiptTally.of(cursor.read_new(sent)), metric_tally(before, after), sent)
    except MetricsError as exc:
        meters, error = None, str(exc)
    outcome = RunOutcome(workload, run, meters, error, out_dir, receipts)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "requests.json").write_text(json.dumps(run.to_dict(), indent=1) + "\n")
        figures = outcome.figures()
        (out_dir / "summary.json").write_text(json.dumps({
            "workload": {"name": workload.name, "params": workload.params, "notes": list(workload.notes)},
            "summary": run.summary().to_dict(), "meters": asdict(meters) if meters else None,
            "receipts": receipts.to_dict() if receipts else None,
            "figures": asdict(figures) if figures else None}, indent=2) + "\n")
    return outcome


def load_baseline(path: Path, workload: str) -> ArmFigures:
    """The figures of an earlier run's ``summary.json``, a run of the same ``workload`` kind
    (``trace``, ``prefix-repetition``, ``multi-round``): TTFTs of different workloads (other prompt
    lengths, reuse patterns) say nothing about the cache, so another kind is refused.

    Raises:
        ValueError: the file is missing, has no figures, or is of another workload (one sentence naming the fix).
    """
    if not path.is_file():
        raise ValueError(f"--baseline {path} {'is a directory' if path.is_dir() else 'does not exist'}; point it at "
                         "the summary.json of an earlier `kvtier bench run --out DIR` (DIR/summary.json)")
    try:
        summary = json.loads(path.read_text())
        figures = summary["figures"]
        reference = ArmFigures(float(figures["prefix_hit_rate"]), float(figures["ttft_p50_s"]),
                               float(figures["ttft_p99_s"]))
        theirs = summary["workload"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"--baseline {path} is not the summary.json of a `kvtier bench run --out` with "
                         "successful requests and a hit rate; point it at one") from None
    if theirs != workload:
        raise ValueError(f"--baseline {path} is a run of the {theirs} workload, this is {workload}: TTFTs of "
                         f"different workloads cannot be compared; give a baseline run with --workload {workload}")
    return reference


def judge_run(outcome: RunOutcome, baseline: ArmFigures | None) -> Verdict | None:
    """The verdict of the run (``None`` without figures; ``inconclusive`` when the server counted no
    prompt tokens, :func:`~kvtier.bench.verdict.no_tokens_verdict`)."""
    if outcome.meters is not None and outcome.meters.prefix_hit_rate is None and outcome.run is not None \
            and outcome.run.summary().num_ok > 0:
        return no_tokens_verdict()
    figures = outcome.figures()
    return judge(figures, baseline) if figures is not None else None


def _ms(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1000:.1f} ms"


TTFT_MEASURED = ("measured here, from sending each request to its first streamed token (HTTP, queueing and "
                 "streaming included); kvtier doctor reads vLLM's server-side histogram, which starts at the engine and "
                 "reads lower")
"""What ``bench run``'s TTFT is, said under its table (and doctor's beside its own,
:data:`kvtier.cli.doctor.TTFT_MEASURED`), so that the two figures for the same requests do not
contradict each other."""


def print_run(outcome: RunOutcome, verdict: Verdict | None) -> None:
    """Print the summary, the meters and the verdict."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    assert outcome.run is not None
    s = outcome.run.summary()
    table = Table(title=f"kvtier bench run: {outcome.workload.name}, {s.num_requests} requests, {s.duration_s:.1f} s")
    for col in ("latency", "p50", "p90", "p99", "mean"):
        table.add_column(col, justify="right")
    for name, p in (("TTFT (client)", s.ttft_s), ("ITL", s.itl_s), ("end-to-end", s.e2e_s)):
        table.add_row(name, *([_ms(p.p50), _ms(p.p90), _ms(p.p99), _ms(p.mean)] if p else ["-"] * 4))
    console.print(table)
    console.print(f"[dim]TTFT (client): {TTFT_MEASURED}[/dim]", highlight=False)
    console.print(f"requests: {s.num_ok} ok, {s.num_failed} failed, {s.num_not_sent} not sent; "
                  f"throughput {s.output_tok_per_s:.1f} output tok/s, {s.prompt_tok_per_s:.0f} prompt tok/s, "
                  f"{s.request_per_s:.2f} req/s")
    failures = outcome.run.failure_text()
    if failures is not None and s.num_ok > 0:
        console.print(f"[bold yellow]warning[/bold yellow]: {escape(failures)}; the figures are over the {s.num_ok} "
                      "that succeeded", highlight=False)
    m = outcome.meters
    if m is not None:
        def pct(x: float | None) -> str:
            return "-" if x is None else f"{100 * x:.1f}%"
        console.print(f"hit rate {pct(m.prefix_hit_rate)} (engine {pct(m.engine_hit_rate)}: "
                      f"{m.prefix_hits:.0f}/{m.prefix_queries:.0f} tokens; external {pct(m.external_hit_rate)}: "
                      f"{m.external_hits:.0f}/{m.external_queries:.0f} tokens)")
        if m.kvtier_bytes:
            console.print("kvtier bytes: " + ", ".join(f"{d} {v / 2**20:.1f} MiB" for d, v in sorted(m.kvtier_bytes.items())))
    if outcome.receipts is not None:
        print_receipts(console, outcome.receipts)
    for note in outcome.workload.notes:
        console.print(f"note: {note}", markup=False)
    if verdict is not None:
        console.print(f"[bold]verdict: {verdict.kind.value}[/bold]: {escape(verdict.reason)}")
    if outcome.out_dir is not None:
        console.print(f"results: {outcome.out_dir}")


def print_receipts(console: Any, r: RunReceipts) -> None:
    """The receipts' tokens per tier and miss table beside the metrics', then the notes."""
    from rich.table import Table

    table = Table(title=f"receipts ({r.receipts.requests} of {r.sent} requests) vs metrics, tokens")
    for col in ("row", "receipts", "metrics"):
        table.add_column(col, justify="right" if col != "row" else "left")
    theirs_tokens = r.metrics.tokens if r.metrics is not None else {}
    theirs_missed = r.metrics.missed if r.metrics is not None else {}
    for row in sorted(set(r.receipts.tokens) | set(theirs_tokens)):
        table.add_row(f"served: {row}", f"{r.receipts.tokens.get(row, 0):,.0f}",
                      f"{theirs_tokens[row]:,.0f}" if row in theirs_tokens else "-")
    for row in sorted(set(r.receipts.missed) | set(theirs_missed), key=lambda k: -r.receipts.missed.get(k, 0)):
        table.add_row(f"missed: {row}", f"{r.receipts.missed.get(row, 0):,.0f}",
                      f"{theirs_missed[row]:,.0f}" if row in theirs_missed else "-")
    console.print(table)
    for note in r.notes():
        console.print(f"receipts: {note}", highlight=False)
