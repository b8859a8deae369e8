"""``kvtier size``'s report as text: the sizing table, its notes and the configs to paste."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from kvtier.size.plan import SizeReport
    from kvtier.size.recipe import Recipe


def _fmt_bytes(n: int | None) -> str:
    """``n`` bytes in the largest binary unit it reaches (``1.50 GiB``); ``-`` for None."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def print_presets() -> None:
    """Print the built-in model presets as a table (name, kind, KV bytes per token at bf16 and TP 1, weights)."""
    from rich.console import Console
    from rich.table import Table

    from kvtier.size.presets import PRESETS

    table = Table(title="Built-in model presets (config source: https://huggingface.co/<model>/blob/main/config.json)")
    table.add_column("model", no_wrap=True)
    for col in ("kind", "KV/token (bf16, TP 1)", "weights GiB"):
        table.add_column(col)
    for p in PRESETS:
        g = p.geometry()
        table.add_row(p.name, g.kind, _fmt_bytes(g.kv_bytes_per_token(1, 2)), f"{p.weights_gib:.1f}")
    Console().print(table)


def print_report(report: SizeReport, recipe: Recipe | None, weights_note: str, weights_gib: float | None = None,
                 chosen: bool = False) -> None:
    """Print ``report`` as one table, its notes, and ``recipe``'s configs (kvtier, vLLM native, LMCache,
    the shared tiers' servers) where it has them; ``chosen``: the tiers are the operator's --offload-gib."""
    from rich.console import Console
    from rich.table import Table

    from kvtier.size.plan import HEADROOM

    console = Console()
    table = Table(title=f"KV sizing: {report.model}", show_header=False)
    table.add_column("what")
    table.add_column("value", overflow="fold")
    rows = [
        ("geometry", report.kind),
        ("config source", report.source),
        ("TP / KV dtype", f"{report.tp} / {report.kv_dtype}"),
        ("KV heads per rank", str(report.kv_heads_per_rank)),
        ("KV bytes per token (all ranks)", f"{report.kv_bytes_per_token:,} B ({_fmt_bytes(report.kv_bytes_per_token)})"),
        ("KV bytes per token per rank", f"{report.kv_bytes_per_token_per_rank:,} B"),
    ]
    if report.sliding_window:
        rows.append(("sliding window", f"{report.sliding_window:,} tokens held by sliding layers"))
    for group in report.groups:
        if group["kind"] == "state":
            held = f"{_fmt_bytes(cast('int', group['state_bytes_per_sequence']))} per sequence, whatever its length"
        elif group["kind"] == "sliding":
            held = f"{group['bytes_per_token']:,} B per token, only the last {group['held_tokens']:,} tokens"
        else:
            held = f"{group['bytes_per_token']:,} B per token, every token"
        label = {"full": "full attention", "sliding": "sliding window", "state": "state"}[str(group["kind"])]
        rows.append((f"{label} ({group['num_layers']} layers)", held))
    if report.state_bytes_per_sequence:
        rows.append(("constant state per sequence", _fmt_bytes(report.state_bytes_per_sequence)))
    if report.context_tokens:
        rows.append((f"one session ({report.context_tokens:,} tokens)", _fmt_bytes(report.bytes_per_session)))
    if report.hbm_kv_budget_bytes is not None:
        rows.append(("HBM KV budget (all ranks)", _fmt_bytes(report.hbm_kv_budget_bytes)))
        rows.append(("HBM KV tokens", f"{report.hbm_kv_tokens:,}" if report.hbm_kv_tokens is not None else "-"))
        if weights_gib is not None:  # the figure the budget subtracts, then where it came from
            rows.append(("weights", f"{weights_gib:,.2f} GiB" + (f" ({weights_note})" if weights_note else "")))
    if report.hbm_sessions is not None:
        rows.append(("sessions that fit in HBM", f"{report.hbm_sessions:,}"))
    if report.warm_set_bytes is not None:
        if report.trace:
            rows.append((f"warm set (trace {report.trace}, 95% of its ceiling)", _fmt_bytes(report.warm_set_bytes)))
        else:  # the figure the notes and the tiers use: sessions × context × the headroom, said so
            sized = int(report.warm_set_bytes * HEADROOM)
            rows.append((f"warm set ({report.sessions:,} sessions, with ×{HEADROOM:g} headroom)",
                         f"{_fmt_bytes(sized)} ({_fmt_bytes(report.warm_set_bytes)} × {HEADROOM:g})"))
    if report.host_reserve_gib is not None:
        rows.append(("host RAM reserved (node + workers)", f"{report.host_reserve_gib:,.0f} GiB"))
    if report.recommended_offload_gib is not None:
        value = ("offload not needed" if not report.offload_needed else f"{report.recommended_offload_gib:,.2f} GiB")
        if report.offload_no_room:
            value = f"needed, no room: {report.offload_no_room}"
        rows.append(("offload tiers (total, --offload-gib)" if chosen else "recommended offload tiers (total)", value))
        if report.offload_needed and report.offload_no_room is None:
            staging = " (staging only)" if report.cpu_staging else ""
            rows.append(("  cpu tier / disk tier", f"{report.cpu_gib or 0:,.2f}{staging} / {report.disk_gib or 0:,.2f} GiB"))
    if report.predicted_hits:
        engine, cpu, disk, total = report.predicted_hits.values()  # PredictedHits' fields, in order
        split = f"{total:.1%} = {engine:.1%} + {cpu:.1%} + {disk:.1%} of prompt tokens"
        rows.append(("predicted hit (engine + cpu + disk)", split))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for note in report.notes:
        console.print(f"- {note}", highlight=False, markup=False)  # notes hold [...] (codec lists, paths)
    if recipe is not None:
        for title, text in (("kvtier connector", recipe.kvtier), ("vLLM native", recipe.vllm_native),
                            ("LMCache", recipe.lmcache), ("shared tier: Redis server", recipe.redis),
                            ("object-store tier: the bucket", recipe.object_store)):
            if text is None:
                continue
            console.print(f"\n[bold]{title}[/bold]")
            console.print(text, highlight=False, markup=False, soft_wrap=True)
