"""Reports of a comparison: the terminal table, ``--json``, the TTFT CDF plot and a Markdown page.

Ratios are arm / baseline of the same run (TTFT: below 1 is better; throughput: above 1 is better).
With several runs per arm (``--repeats``) every figure is the median over the arm's runs and the
TTFT p50 range (lowest-highest run) is shown beside it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.arms import BASELINE
from kvtier.bench.compare import ArmOutcome, ArmResult, CompareResult
from kvtier.bench.plot import plot_ttft_cdf
from kvtier.bench.receiptreport import print_receipts, receipt_markdown, receipts_json

GiB = float(1 << 30)


def compare_json(result: CompareResult) -> dict[str, Any]:
    """``{"arms": {NAME: {ttft_p50_s, ttft_p99_s, prefix_hit_rate, external_hit_rate,
    output_tok_per_s, request_per_s, num_requests}}, "repeats": N, "runs": {NAME: [per-run figures]}}`` for
    arms whose runs all completed (figures: medians over runs); arms with a failed run are listed
    under ``"failed"`` with the reason, the requests in flight and the log path.  With several
    replicas: ``"replicas": N``, ``"per_replica": {NAME: [per replica {hit rates, external_hit_tokens,
    ttft_p50_s, ttft_p99_s, num_requests}]}`` (medians over runs) and each run's ``"replicas"`` list.
    With a planned restart: ``"restart": {"replica", "at_request", "fraction", "arms": {NAME:
    {restart_* figures, medians}}}`` and the ``restart_*`` figures in each run."""
    arms = {a.arm.name: a.json_figures() for a in result.arms if a.ok}
    runs = {a.arm.name: [{**o.run_figures(), "load_avg_1m": o.load_avg_1m,
                          **({"replicas": o.replica_figures()} if result.replicas > 1 else {})} for o in a.runs if o.ok]
            for a in result.arms if a.ok}
    out: dict[str, Any] = {"arms": arms, "repeats": result.repeats, "runs": runs}
    if result.replicas > 1:
        out["replicas"] = result.replicas
        out["per_replica"] = {a.arm.name: [{k: v.median for k, v in r.items()} for r in a.replica_spreads()]
                              for a in result.arms if a.ok}
    failed = {a.arm.name: {"reason": f.reason, "requests": list(f.request_ids), "log": str(f.log_path)}
              for a in result.arms if (f := a.failure) is not None}
    if result.restart is not None:
        plan = result.restart
        out["restart"] = {"replica": plan.replica, "at_request": plan.at_request, "fraction": plan.fraction,
                          "arms": {a.arm.name: {k: v.median for k, v in a.spreads().items() if k.startswith("restart_")}
                                   for a in result.arms if a.ok}}
    if failed:
        out["failed"] = failed
    if receipts := receipts_json(result):  # kvtier arms: the receipts beside the metrics, per run
        out["receipts"] = receipts
    return out


def write_json(result: CompareResult, path: Path) -> Path:
    """Write :func:`compare_json` to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(compare_json(result), indent=2) + "\n")
    return path


def _fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _fmt_s(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else (f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s")


def _ratio(x: float | None, ref: float | None) -> str:
    if x is None or ref is None or ref == 0 or math.isnan(x) or math.isnan(ref):
        return "-"
    return f"{x / ref:.2f}x"


@dataclass(frozen=True)
class Row:
    """One table row, already formatted."""

    cells: tuple[str, ...]


COLUMNS = ("arm", "hit rate", "engine hit", "external hit", "TTFT p50", "p50 range", "hit range", "TTFT p99",
           "req/s", "output tok/s", "verdict")


def _with_ratio(text: str, x: float | None, ref: float | None, is_ref: bool) -> str:
    return text if is_ref or text == "-" else f"{text} ({_ratio(x, ref)})"


def _median(a: ArmResult | None, key: str) -> float | None:
    if a is None:
        return None
    s = a.spreads().get(key)
    return s.median if s is not None else None


def rows(result: CompareResult) -> list[Row]:
    """The table rows, one per arm in the order given: medians over the arm's runs; TTFT and
    throughput carry their ratio to the baseline in parentheses; "p50 range" and "hit range" are
    the lowest and highest per-run TTFT p50 and hit rate, and the number of runs."""
    base = result.arm_result(BASELINE)
    base = base if base is not None and base.ok else None
    out = []
    for a in result.arms:
        if a.failure is not None:
            out.append(Row((a.arm.name, *["-"] * (len(COLUMNS) - 2), "FAILED")))
            continue
        s = a.spreads()
        is_ref = a is base

        def med(key: str, arm: ArmResult = a) -> float | None:
            return _median(arm, key)

        p50, p99, tput, rps = med("ttft_p50_s"), med("ttft_p99_s"), med("output_tok_per_s"), med("request_per_s")
        p50_spread, hit_spread = s.get("ttft_p50_s"), s.get("prefix_hit_rate")
        out.append(Row((
            a.arm.name, _fmt_rate(med("prefix_hit_rate")), _fmt_rate(med("engine_hit_rate")),
            _fmt_rate(med("external_hit_rate")),
            _with_ratio(_fmt_s(p50), p50, _median(base, "ttft_p50_s"), is_ref),
            "-" if p50_spread is None else p50_spread.range_text(_fmt_s),
            "-" if hit_spread is None else hit_spread.range_text(_fmt_rate),
            _with_ratio(_fmt_s(p99), p99, _median(base, "ttft_p99_s"), is_ref),
            _with_ratio("-" if rps is None else f"{rps:.2f}", rps, _median(base, "request_per_s"), is_ref),
            _with_ratio("-" if tput is None else f"{tput:.1f}", tput, _median(base, "output_tok_per_s"), is_ref),
            a.verdict.kind.value if a.verdict else "-")))
    return out


REPLICA_COLUMNS = ("arm", "replica", "requests", "hit rate", "engine hit", "external hit", "external hit tokens",
                   "TTFT p50", "TTFT p99")


def replica_rows(result: CompareResult) -> list[Row]:
    """Per arm and replica (medians over the arm's runs): what each server of the arm served.
    Empty with one replica per arm."""
    if result.replicas < 2:
        return []
    out = []
    for a in result.arms:
        for i, s in enumerate(a.replica_spreads()):
            def med(key: str, s: dict[str, Any] = s) -> float | None:
                return s[key].median if key in s else None

            tokens, n = med("external_hit_tokens"), med("num_requests")
            out.append(Row((a.arm.name, str(i), "-" if n is None else f"{n:.0f}", _fmt_rate(med("prefix_hit_rate")),
                            _fmt_rate(med("engine_hit_rate")), _fmt_rate(med("external_hit_rate")),
                            "-" if tokens is None else f"{tokens:,.0f}", _fmt_s(med("ttft_p50_s")),
                            _fmt_s(med("ttft_p99_s")))))
    return out


RESTART_COLUMNS = ("arm", "down", "rerouted", "requests after", "hit rate after", "hit range", "TTFT p50 after",
                   "p50 range", "TTFT p99 after")


def restart_title(result: CompareResult) -> str:
    """What the restart table is about (empty without a planned restart)."""
    plan = result.restart
    if plan is None:
        return ""
    return (f"replica {plan.replica} restarted once {plan.at_request} of {len(result.workload.requests)} requests "
            f"were sent (--restart-replica-at {plan.fraction:g}): its requests after the restart")


def restart_rows(result: CompareResult) -> list[Row]:
    """Per arm (medians over its runs, ranges lowest-highest run): seconds the restarted replica took
    no requests, requests sent to the others meanwhile, and its successful requests, hit rate and
    TTFT p50/p99 once back (:func:`kvtier.bench.restart.restart_figures`).  Empty without a restart."""
    if result.restart is None:
        return []
    out = []
    for a in result.arms:
        s = a.spreads()

        def med(key: str, s: dict[str, Any] = s) -> float | None:
            return s[key].median if key in s else None

        def rng(key: str, fmt: Any, s: dict[str, Any] = s) -> str:
            return s[key].range_text(fmt) if key in s else "-"

        down, rerouted, n = med("restart_down_s"), med("restart_rerouted"), med("restart_requests")
        out.append(Row((a.arm.name, "-" if down is None else f"{down:.1f} s",
                        "-" if rerouted is None else f"{rerouted:.0f}", "-" if n is None else f"{n:.0f}",
                        _fmt_rate(med("restart_hit_rate")), rng("restart_hit_rate", _fmt_rate),
                        _fmt_s(med("restart_ttft_p50_s")), rng("restart_ttft_p50_s", _fmt_s),
                        _fmt_s(med("restart_ttft_p99_s")))))
    return out


NOT_A_TERMINAL_WIDTH = 1000
"""Columns ``bench compare`` prints its tables in when stdout is not a terminal (a pipe, a file): wider than
any of them, so no cell is cut; each table is as wide as its cells, not this."""


def print_table(result: CompareResult) -> None:
    """Print the comparison table, each arm's verdict reason and each failure to the terminal."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    # the table needs ~170 columns; narrower would cut cells ('baseli…'). A terminal gets at least 160; a pipe
    # or file (rich's 80 columns when not a terminal) gets room for any table, so nothing is ever cut there
    console = Console(width=max(console.width, 160) if console.is_terminal else NOT_A_TERMINAL_WIDTH)
    runs = f", {result.repeats} runs per arm interleaved, medians" if result.repeats > 1 else ""
    table = Table(title=f"kvtier bench compare: {result.workload.name}, {len(result.workload.requests)} requests"
                  f"{runs} (ratio to baseline in parentheses)", box=box.SIMPLE_HEAVY)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("arm", "verdict") else "right", no_wrap=True)
    for row in rows(result):
        table.add_row(*row.cells)
    console.print(table)
    per_replica = replica_rows(result)
    if per_replica:
        table = Table(title=f"per replica ({result.replicas} servers per arm, requests round robin)",
                      box=box.SIMPLE_HEAVY)
        for col in REPLICA_COLUMNS:
            table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
        for row in per_replica:
            table.add_row(*row.cells)
        console.print(table)
    if restarted := restart_rows(result):
        table = Table(title=restart_title(result), box=box.SIMPLE_HEAVY)
        for col in RESTART_COLUMNS:
            table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
        for row in restarted:
            table.add_row(*row.cells)
        console.print(table)
    for a in result.arms:
        if a.verdict is not None:
            console.print(f"[bold]{a.arm.name}[/bold]: {a.verdict.kind.value}: {escape(a.verdict.reason)}", highlight=False)
        if (f := a.failure) is not None:
            where = f" during {', '.join(f.request_ids)}" if f.request_ids else ""
            console.print(f"[bold red]{a.arm.name}[/bold red]: {escape(f.reason)}{where}; log: {f.log_path}",
                          highlight=False)
        for o in a.runs:
            if o.failure is None and o.run is not None and (why := o.run.failure_text()) is not None:
                run = f" (run {o.repeat + 1})" if result.repeats > 1 else ""
                console.print(f"[bold yellow]{a.arm.name}[/bold yellow]{run}: {escape(why)}; its figures are over "
                              "the requests that succeeded", highlight=False)
    for line in reuse_lines(result):
        console.print(line, highlight=False)
    loads = [o.load_avg_1m for o in result.outcomes if o.load_avg_1m is not None]
    if loads:
        console.print(f"load average (1 min) at the start of each run: {min(loads):.2f}-{max(loads):.2f}",
                      highlight=False)
    print_receipts(console, result)


def _reuse_ttfts(o: ArmOutcome, shared: dict[str, float], repeated: bool = True) -> list[float]:
    """TTFTs of the requests at least half of whose prompt repeats an earlier request's
    (``repeated=False``: of the requests that repeat nothing)."""
    if o.run is None:
        return []
    return [r.ttft_s for r in o.run.results if r.ok and r.ttft_s is not None
            and ((shared.get(r.request_id, 0.0) >= 0.5) if repeated else shared.get(r.request_id, 0.0) == 0.0)]


def reuse_lines(result: CompareResult) -> list[str]:
    """Per arm with both kinds of request: TTFT p50 of repeated prompts vs first-time prompts
    (all runs pooled), their ratio and the sample counts — the "full hit / cold" figure."""
    import numpy as np

    shared = {r.request_id: r.shared_prefix_tokens / max(r.prompt_len, 1) for r in result.workload.requests}
    out = []
    for a in result.arms:
        hit = [t for o in a.runs for t in _reuse_ttfts(o, shared)]
        cold = [t for o in a.runs for t in _reuse_ttfts(o, shared, repeated=False)]
        if hit and cold:
            h, c = float(np.percentile(hit, 50)), float(np.percentile(cold, 50))
            out.append(f"{a.arm.name}: TTFT p50 of repeated prompts {_fmt_s(h)} (n={len(hit)}, "
                       f"{_fmt_s(min(hit))}-{_fmt_s(max(hit))}) vs first-time prompts {_fmt_s(c)} (n={len(cold)}, "
                       f"{_fmt_s(min(cold))}-{_fmt_s(max(cold))}): {h / c:.3f}x")
    return out


def cdf_figures(result: CompareResult) -> tuple[str, dict[str, list[float]], dict[str, str]]:
    """What the TTFT CDF draws and says, from the figures the table prints: (title, TTFTs per arm
    with all its completed runs pooled, legend label per arm).  The title counts requests per run
    and runs, so it agrees with the legend's pooled n; the legend's p50 is the table's (median over
    runs of each run's p50), not the p50 of the pooled values."""
    ttfts = {a.arm.name: [r.ttft_s for o in a.ok_runs if o.run is not None for r in o.run.results
                          if r.ok and r.ttft_s is not None] for a in result.arms}
    labels = {}
    for a in result.arms:
        p50 = a.spreads().get("ttft_p50_s")
        if p50 is not None and ttfts[a.arm.name]:
            runs = len(a.ok_runs)
            labels[a.arm.name] = (f"{a.arm.name} (TTFT p50 {p50.median * 1000:.0f} ms"
                                  + (f", median of {runs} runs" if runs > 1 else "") + f"; n={len(ttfts[a.arm.name])})")
    pooled = f" × {result.repeats} runs, pooled" if result.repeats > 1 else ""
    title = f"TTFT CDF: {result.workload.name}, {len(result.workload.requests)} requests{pooled}"
    return title, ttfts, labels


def write_plot(result: CompareResult, path: Path) -> Path:
    """The TTFT CDF of every arm with results (all its completed runs pooled; see :func:`cdf_figures`)."""
    title, ttfts, labels = cdf_figures(result)
    return plot_ttft_cdf(ttfts, path, title, labels)


HIT_RATE_NOTE = ("Hit rate: share of prompt tokens not recomputed ((engine hits + connector hits) / prompt "
                 "tokens queried, from the deltas of `vllm:prefix_cache_*` and `vllm:external_prefix_cache_*`); "
                 "engine hit: the engine's own cache; external hit: share of the tokens the connector was asked "
                 "for that it supplied.")


def markdown(result: CompareResult, plot_name: str | None, command: str | None) -> str:
    """A short Markdown report: setup, table, verdicts, failures, reuse-only TTFT, kvtier bytes."""
    w, e = result.workload, result.engine
    lines = [f"# kvtier bench compare: {w.name}", ""]
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    workload_line = (f"- workload: `{w.name}` {json.dumps(w.params)}; {len(w.requests)} requests, "
                     f"{w.num_prompt_tokens} prompt tokens, {w.num_output_tokens} output tokens")
    cache_tokens = (e.num_blocks - 1) * e.block_size
    engine_line = (f"- engine: `{e.model}` (load format {e.load_format or 'weights'}), max model len "
                   f"{e.max_model_len}, engine cache {e.num_blocks - 1} blocks x {e.block_size} tokens = "
                   f"{cache_tokens} tokens, the same for every arm")
    pinning = ", ".join(f"{k}={v}" for k, v in e.environment().items()) or "vLLM's default"
    loads = [o.load_avg_1m for o in result.outcomes if o.load_avg_1m is not None]
    runs_line = (f"- runs: {result.repeats} per arm, interleaved (A B C A B C ...); figures are medians over an "
                 f"arm's runs; core pinning for every run: {pinning}"
                 + (f"; load average (1 min) at run starts {min(loads):.2f}-{max(loads):.2f}" if loads else ""))
    lines += [workload_line, engine_line, runs_line]
    if result.replicas > 1:
        lines.append(f"- replicas: {result.replicas} servers per arm and run, same configuration; request k of the "
                     f"workload goes to replica k mod {result.replicas} (round robin, no affinity); hit rates sum "
                     "the replicas' counters, TTFTs are over every request")
    lines += [f"- note: {n}" for n in w.notes]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r.cells) + " |" for r in rows(result)]
    lines += ["", HIT_RATE_NOTE, ""]
    per_replica = replica_rows(result)
    if per_replica:
        lines += ["Per replica (medians over runs):", "", "| " + " | ".join(REPLICA_COLUMNS) + " |",
                  "|" + "---|" * len(REPLICA_COLUMNS)]
        lines += ["| " + " | ".join(r.cells) + " |" for r in per_replica] + [""]
    if restarted := restart_rows(result):
        head = (f"Restart: {restart_title(result)} (medians over runs; down: seconds it took no requests, "
                "rerouted: requests sent to the other replicas meanwhile; hit rate from its counters since it "
                "answered again):")
        lines += [head, "", "| " + " | ".join(RESTART_COLUMNS) + " |", "|" + "---|" * len(RESTART_COLUMNS)]
        lines += ["| " + " | ".join(r.cells) + " |" for r in restarted] + [""]
    reuse = reuse_lines(result)
    if reuse:
        head = "Repeated vs first-time prompts (all runs pooled; first-time = nothing shared with an earlier request):"
        lines += [head, ""] + [f"- {line}" for line in reuse] + [""]
    lines += ["## Arms", ""]
    for a in result.arms:
        logs = ", ".join(f"`{p}`" for o in a.runs for p in (o.replica_logs or (o.log_path,)))
        lines.append(f"- **{a.arm.name}**: {a.arm.description}; server log(s) {logs}")
        if a.verdict is not None:
            lines.append(f"  - verdict: **{a.verdict.kind.value}**: {a.verdict.reason}")
        if (f := a.failure) is not None:
            where = f" during request(s) {', '.join(f.request_ids)}" if f.request_ids else ""
            lines.append(f"  - FAILED: {f.reason}{where}; log `{f.log_path}`")
        hit = a.spreads().get("prefix_hit_rate")
        if hit is not None and hit.n > 1:
            lines.append(f"  - hit rate per run: {hit.range_text(_fmt_rate)}")
        for o in a.runs:
            if o.meters is not None and o.meters.kvtier_bytes:
                moved = ", ".join(f"{d} {v / GiB:.3f} GiB" for d, v in sorted(o.meters.kvtier_bytes.items()))
                lines.append(f"  - kvtier bytes moved{f' (run {o.repeat})' if result.repeats > 1 else ''}: {moved}")
            s = o.summary()
            if s is not None and (s.num_failed or s.num_not_sent):
                lines.append(f"  - requests: {s.num_ok} ok, {s.num_failed} failed, {s.num_not_sent} not sent")
            if o.failure is None and o.run is not None and (why := o.run.failure_text()) is not None:
                lines.append(f"  - partial failure{f' (run {o.repeat})' if result.repeats > 1 else ''}: {why}")
    if receipts := receipt_markdown(result):
        lines += [""] + receipts
    if plot_name:
        lines += ["", f"![TTFT CDF]({plot_name})"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ReportPaths:
    """Where the files of a comparison went."""

    markdown: Path
    plot: Path | None
    json: Path | None


def write_reports(result: CompareResult, out_dir: Path, json_path: Path | None = None,
                  command: str | None = None) -> ReportPaths:
    """Write ``ttft_cdf.png``, ``report.md`` and (if asked) the JSON; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = write_plot(result, out_dir / "ttft_cdf.png") if any(o.run for o in result.outcomes) else None
    md = out_dir / "report.md"
    md.write_text(markdown(result, plot.name if plot else None, command))
    js = write_json(result, json_path) if json_path is not None else None
    return ReportPaths(markdown=md, plot=plot, json=js)
