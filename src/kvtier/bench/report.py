"""Reports of a comparison: the terminal table, ``--json``, the TTFT CDF plot and a Markdown page.

Ratios are arm / baseline of the same run (TTFT: below 1 is better; throughput: above 1 is better).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.arms import BASELINE
from kvtier.bench.compare import ArmOutcome, CompareResult
from kvtier.bench.plot import plot_ttft_cdf

GiB = float(1 << 30)


def compare_json(result: CompareResult) -> dict[str, Any]:
    """``{"arms": {NAME: {ttft_p50_s, ttft_p99_s, prefix_hit_rate, external_hit_rate,
    output_tok_per_s, num_requests}}}`` for completed arms; arms that failed are listed under
    ``"failed"`` with the reason, the requests in flight and the log path."""
    arms = {o.arm.name: o.json_figures() for o in result.outcomes if o.ok}
    out: dict[str, Any] = {"arms": arms}
    failed = {o.arm.name: {"reason": o.failure.reason, "requests": list(o.failure.request_ids),
                           "log": str(o.failure.log_path)}
              for o in result.outcomes if o.failure is not None}
    if failed:
        out["failed"] = failed
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


COLUMNS = ("arm", "hit rate", "engine hit", "external hit", "TTFT p50", "TTFT p99", "output tok/s", "verdict")


def _with_ratio(text: str, x: float | None, ref: float | None, is_ref: bool) -> str:
    return text if is_ref or text == "-" else f"{text} ({_ratio(x, ref)})"


def rows(result: CompareResult) -> list[Row]:
    """The table rows, one per arm, in run order; TTFT and throughput carry their ratio to the
    baseline in parentheses."""
    base = result.outcome(BASELINE)
    base_sum = base.summary() if base is not None and base.ok else None
    bt = base_sum.ttft_s if base_sum is not None else None
    out = []
    for o in result.outcomes:
        if o.failure is not None:
            out.append(Row((o.arm.name, "-", "-", "-", "-", "-", "-", "FAILED")))
            continue
        s, m = o.summary(), o.meters
        ttft = s.ttft_s if s is not None else None
        is_ref = o is base
        p50 = ttft.p50 if ttft else None
        p99 = ttft.p99 if ttft else None
        tput = s.output_tok_per_s if s else None
        out.append(Row((
            o.arm.name, _fmt_rate(m.prefix_hit_rate if m else None), _fmt_rate(m.engine_hit_rate if m else None),
            _fmt_rate(m.external_hit_rate if m else None),
            _with_ratio(_fmt_s(p50), p50, bt.p50 if bt else None, is_ref),
            _with_ratio(_fmt_s(p99), p99, bt.p99 if bt else None, is_ref),
            _with_ratio("-" if tput is None else f"{tput:.1f}", tput,
                        base_sum.output_tok_per_s if base_sum else None, is_ref),
            o.verdict.kind.value if o.verdict else "-")))
    return out


def print_table(result: CompareResult) -> None:
    """Print the comparison table, each arm's verdict reason and each failure to the terminal."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console = Console(width=max(console.width, 112))  # the table needs ~110 columns; narrower would cut cells
    table = Table(title=f"kvtier bench compare: {result.workload.name}, {len(result.workload.requests)} requests "
                  "(ratio to baseline in parentheses)", box=box.SIMPLE_HEAVY)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("arm", "verdict") else "right", no_wrap=True)
    for row in rows(result):
        table.add_row(*row.cells)
    console.print(table)
    for o in result.outcomes:
        if o.verdict is not None:
            console.print(f"[bold]{o.arm.name}[/bold]: {o.verdict.kind.value}: {o.verdict.reason}", highlight=False)
        if o.failure is not None:
            where = f" during {', '.join(o.failure.request_ids)}" if o.failure.request_ids else ""
            console.print(f"[bold red]{o.arm.name}[/bold red]: {o.failure.reason}{where}; log: {o.failure.log_path}",
                          highlight=False)


def _reuse_ttfts(o: ArmOutcome, shared: dict[str, float]) -> list[float]:
    """TTFTs of the requests at least half of whose prompt repeats an earlier request's."""
    if o.run is None:
        return []
    return [r.ttft_s for r in o.run.results
            if r.ok and r.ttft_s is not None and shared.get(r.request_id, 0.0) >= 0.5]


def write_plot(result: CompareResult, path: Path) -> Path:
    """The TTFT CDF of every arm with results."""
    ttfts = {o.arm.name: [r.ttft_s for r in o.run.results if r.ok and r.ttft_s is not None]
             for o in result.outcomes if o.run is not None}
    return plot_ttft_cdf(ttfts, path, f"TTFT CDF: {result.workload.name}, {len(result.workload.requests)} requests")


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
    lines += [workload_line, engine_line]
    lines += [f"- note: {n}" for n in w.notes]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r.cells) + " |" for r in rows(result)]
    lines += ["", HIT_RATE_NOTE, ""]
    lines += ["## Arms", ""]
    shared = {r.request_id: r.shared_prefix_tokens / max(r.prompt_len, 1) for r in w.requests}
    for o in result.outcomes:
        lines.append(f"- **{o.arm.name}**: {o.arm.description}; server log `{o.log_path}`"
                     + (f", healthy after {o.startup_s:.0f} s" if o.startup_s else ""))
        if o.verdict is not None:
            lines.append(f"  - verdict: **{o.verdict.kind.value}**: {o.verdict.reason}")
        if o.failure is not None:
            where = f" during request(s) {', '.join(o.failure.request_ids)}" if o.failure.request_ids else ""
            lines.append(f"  - FAILED: {o.failure.reason}{where}; log `{o.failure.log_path}`")
        reuse = _reuse_ttfts(o, shared)
        if reuse:
            import numpy as np
            lines.append(f"  - TTFT p50 of the {len(reuse)} requests that repeat at least half of their prompt "
                         f"from an earlier request: {_fmt_s(float(np.percentile(reuse, 50)))}")
        if o.meters is not None and o.meters.kvtier_bytes:
            moved = ", ".join(f"{d} {v / GiB:.3f} GiB" for d, v in sorted(o.meters.kvtier_bytes.items()))
            lines.append(f"  - kvtier bytes moved: {moved}")
        s = o.summary()
        if s is not None and (s.num_failed or s.num_not_sent):
            lines.append(f"  - requests: {s.num_ok} ok, {s.num_failed} failed, {s.num_not_sent} not sent")
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
