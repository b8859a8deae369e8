"""``kvtier bench-store``: tier throughput as a ratio to the machine's plain copy and file I/O."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from kvtier.cli.errors import fail


def register(app: typer.Typer) -> None:
    app.command("bench-store")(bench_store)


def bench_store(
    sizes: str = typer.Option("0.5,4,32", help="Chunk sizes in MiB, comma-separated."),
    total_mib: float = typer.Option(256, help="MiB moved per measurement round."),
    repeats: int = typer.Option(5, min=1, help="Rounds per figure; the median is reported."),
    directory: Optional[Path] = typer.Option(None, "--dir", help="Where the disk tier writes (default: a temp dir)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write results as JSON here."),
) -> None:
    """Measure cpu and disk tier put/get throughput against numpy copy and raw file I/O.

    Example: kvtier bench-store --sizes 4,32 --json out/bench-store.json
    """
    from rich.console import Console
    from rich.table import Table

    from kvtier.bench.storebench import run_store_bench

    try:
        chunk_mibs = [float(s) for s in sizes.split(",") if s.strip()]
    except ValueError:
        fail(f"--sizes {sizes!r} is not a comma-separated list of MiB numbers; e.g. --sizes 0.5,4,32")
    if directory is not None and not directory.is_dir():
        fail(f"--dir {str(directory)!r} is not a directory; create it or omit --dir")
    try:
        rows = run_store_bench(chunk_mibs, total_mib, repeats, directory)
    except ValueError as exc:
        fail(str(exc))
    table = Table(title="kvtier bench-store (tier vs same-run reference)")
    for col in ("tier", "op", "chunk MiB", "GiB/s", "reference GiB/s", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.tier, r.op, f"{r.chunk_mib:g}", f"{r.gib_per_s:.2f}", f"{r.reference_gib_per_s:.2f}",
                      f"{r.ratio:.2f}")
    Console().print(table)
    print("reference: cpu = numpy.copyto of the same bytes; disk = unbuffered file write/readinto")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"results": [r.as_dict() for r in rows]}, indent=2))
        print(f"wrote {json_path}")
