"""``kvtier bench-store``: tier throughput as a ratio to the machine's plain copy and file I/O."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from kvtier.cli.errors import fail, flag_names, refuse_kernel_filesystem
from kvtier.cli.outputs import FORCE_HELP, check_new_files
from kvtier.cli.tierflags import build, given, option, refuse_stray, targets
from kvtier.core.errors import UserError
from kvtier.core.toolflags import ToolFlag, tool_flags

MIN_CHUNK_MIB = 0.004  # 4 KiB: one OS page
MAX_CHUNK_MIB = 1024.0
MAX_TOTAL_MIB = 16384.0
MAX_THREADS = 64


def register(app: typer.Typer) -> None:
    """Add ``kvtier bench-store`` to the CLI: the options of the tiers beyond cpu and disk come from
    their settings models (the fields marked for ``bench-store``, :mod:`kvtier.core.toolflags`) and
    their benchmarks' own knobs (:mod:`kvtier.bench.tierbenches`), so a new tier needs no edit here."""
    app.command("bench-store")(bench_store_command(tool_flags("bench-store")))


def tier_flags(flags: list[ToolFlag]) -> list[ToolFlag]:
    """``flags`` with each tier's benchmark knobs after its settings flags, and ``--<tier>-only``
    for each tier with a target (``--redis-only``)."""
    from kvtier.bench.tierbenches import tier_bench

    out: list[ToolFlag] = []
    for tier, target in targets(flags).items():
        out += [f for f in flags if f.tier == tier]
        out += tier_bench(tier).extras
        out.append(ToolFlag(tier, f"{tier}_only", bool, f"Measure only the {tier} tier (needs {target.flag}).",
                            default=False))
    return out


def _extras(flags: list[ToolFlag]) -> list[ToolFlag]:
    from kvtier.bench.tierbenches import tier_bench

    return [e for tier in dict.fromkeys(f.tier for f in flags) for e in tier_bench(tier).extras]


FIXED = {
    "sizes": (str, typer.Option("0.5,4,32", help="Chunk sizes in MiB, comma-separated.")),
    "total_mib": (float, typer.Option(256, help="MiB moved per measurement round.")),
    "repeats": (int, typer.Option(5, min=1, help="Rounds per figure; the median is reported.")),
    "threads": (str, typer.Option("1", help="Disk thread counts, comma-separated: chunks moved at once by the "
                                            "tier (io_threads) and by the reference, e.g. 1,2,4.")),
    "disk_io": (str, typer.Option("buffered,direct", help="Disk I/O modes to measure: buffered and/or direct "
                                                          "(O_DIRECT); the reference uses the same mode.")),
    "buffered_reads": (str, typer.Option("auto", help="Buffered reads to measure: auto (serial or split over two "
                                                      "threads, as measured), serial and/or split (forced).")),
    "directory": (Path | None, typer.Option(None, "--dir", help="Where the disk tier writes (default: a temp dir).")),
    "json_path": (Path | None, typer.Option(None, "--json", help="Also write results as JSON here (an existing "
                                                                "file is refused without --force).")),
    "force": (bool, typer.Option(False, "--force", help=FORCE_HELP)),
    "codecs": (str | None, typer.Option(None, "--codecs", help=(
        "Codec chains to measure against identity on the same tier: ';' between chains, ',' between the codecs "
        "of one, e.g. 'aes-256-gcm;blosc2-zstd-shuffle2,aes-256-gcm' (the disk tier in --dir, buffered, one "
        "thread, and each shared tier given)."))),
}
"""The options of every run (cpu and disk tiers, output)."""


def bench_store_command(settings_flags: list[ToolFlag]) -> Callable[..., None]:
    """The ``kvtier bench-store`` command with the options of :data:`FIXED` and one per tier flag."""
    flags = tier_flags(settings_flags)

    def body(**values: Any) -> None:
        """Measure cpu and disk tier put/get throughput against numpy copy and raw file I/O.

        Example: kvtier bench-store --sizes 4,32 --threads 1,2,4 --json out/bench-store.json
        """
        tiers = {f.key: values.pop(f.key) for f in flags}
        bench_store(flags=flags, tiers=tiers, **values)

    return build(body, {**FIXED, **{f.key: option(f, negatable=True) for f in flags}})


def _codec_rows(text: str, chunk_mibs: list[float], total_mib: float, repeats: int, directory: Path | None,
                only: list[str], measured: list[str], settings: dict[str, Any]) -> tuple[list[Any], list[str]]:
    """``--codecs``: each chain against identity on the disk tier (unless ``--<tier>-only``) and on
    each shared tier measured (:mod:`kvtier.bench.codecbench`)."""
    import shutil
    import tempfile

    from kvtier.bench.codecbench import bench_chains, parse_chains
    from kvtier.core.tiers.registry import specs

    rows: list[Any] = []
    notes: list[str] = []
    try:
        chains = parse_chains(text)
        base = Path(tempfile.mkdtemp(prefix="kvtier-codecs-", dir=directory))
        try:
            disk = {"disk_path": str(base), "disk_gib": 4 * total_mib / 1024, "disk_io": "buffered"}
            local = [s.name for s in specs() if not s.shared and not s.top][:1]  # the disk tier, in --dir
            for tier, values in ([] if only else [(n, disk) for n in local]) + [(t, settings) for t in measured]:
                for mib in chunk_mibs:
                    got, more = bench_chains(tier, values, chains, mib, total_mib, repeats)
                    rows += got
                    notes += more
        finally:
            shutil.rmtree(base, ignore_errors=True)
    except UserError as exc:
        fail(str(exc).rstrip(".") + ".")
    return rows, notes


def bench_store(sizes: str, total_mib: float, repeats: int, threads: str, disk_io: str, buffered_reads: str,
                directory: Path | None, json_path: Path | None, flags: list[ToolFlag], tiers: dict[str, Any],
                codecs: str | None = None, force: bool = False) -> None:
    """Run ``kvtier bench-store`` (see :func:`bench_store_command`).

    Args:
        flags: every tier option: settings flags, the benchmarks' knobs and ``--<tier>-only``.
        tiers: each one's value, by key.
    """
    from rich.console import Console
    from rich.table import Table

    from kvtier.bench.storebench import StoreBenchResult, run_store_bench

    settings_flags = [f for f in flags if f.key != f"{f.tier}_only" and f not in _extras(flags)]

    try:
        chunk_mibs = [float(s) for s in sizes.split(",") if s.strip()]
    except ValueError:
        chunk_mibs = []
    if not chunk_mibs or not all(math.isfinite(c) and MIN_CHUNK_MIB <= c <= MAX_CHUNK_MIB for c in chunk_mibs):
        fail(f"--sizes {sizes!r} must be a comma-separated list of chunk sizes in MiB between {MIN_CHUNK_MIB} "
             f"and {MAX_CHUNK_MIB}; e.g. --sizes 0.5,4,32")
    if len(set(chunk_mibs)) != len(chunk_mibs):  # the wording of simulate's capacity lists
        fail(f"--sizes lists a chunk size twice ({sizes}); give each chunk size once")
    if not math.isfinite(total_mib) or not max(chunk_mibs) <= total_mib <= MAX_TOTAL_MIB:
        fail(f"--total-mib {total_mib} must be at least the largest chunk size and at most {MAX_TOTAL_MIB}")
    try:
        thread_counts = [int(t) for t in threads.split(",") if t.strip()]
    except ValueError:
        thread_counts = []
    if not thread_counts or not all(1 <= t <= MAX_THREADS for t in thread_counts):
        fail(f"--threads {threads!r} must be a comma-separated list of thread counts from 1 to {MAX_THREADS}; "
             "e.g. --threads 1,2,4")
    if len(set(thread_counts)) != len(thread_counts):
        fail(f"--threads lists a thread count twice ({threads}); give each thread count once")
    modes = [m.strip() for m in disk_io.split(",") if m.strip()]
    if not modes or not all(m in ("buffered", "direct") for m in modes):
        fail(f"--disk-io {disk_io!r} must list buffered and/or direct, e.g. --disk-io buffered,direct")
    ways = [w.strip() for w in buffered_reads.split(",") if w.strip()]
    if not ways or not all(w in ("auto", "serial", "split") for w in ways):
        fail(f"--buffered-reads {buffered_reads!r} must list auto, serial and/or split, e.g. --buffered-reads auto,split")
    if directory is not None:
        refuse_kernel_filesystem(directory, "--dir")
    if json_path is not None:
        refuse_kernel_filesystem(json_path, "--json")
    if directory is not None and (not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK)):
        fail(f"--dir {str(directory)!r} is not a writable directory; create it or omit --dir")
    if json_path is not None and (json_path.is_dir() or not json_path.parent.is_dir()):
        fail(f"--json {str(json_path)!r} must be a file path in an existing directory")
    check_new_files([("--json", json_path)], force)
    from kvtier.bench.tierbenches import tier_bench

    wanted = targets(flags)
    only = [t for t in wanted if tiers.get(f"{t}_only")]
    if len(only) > 1:
        fail(f"{' and '.join(f'--{t}-only' for t in only)} exclude each other; give one of them, or neither to "
             "measure every tier")
    for tier in only:
        target = wanted[tier]
        if not given(target, tiers.get(target.key)):
            example = f", e.g. {target.flag} {target.example}" if target.example else f" ({target.target})"
            fail(f"--{tier}-only needs {target.flag}{example}")
    # an option of a tier that is not measured would be ignored, the run reporting the other tiers alone
    refuse_stray([f for f in flags if f.key != f"{f.tier}_only"], tiers, "to measure the {tier} tier",
                 "to measure the other tiers only")
    measured = [t for t in wanted if given(wanted[t], tiers.get(wanted[t].key)) and (not only or t in only)]
    parsed = {}
    for tier in measured:
        bench = tier_bench(tier)
        try:
            parsed[tier] = bench.parse({f.key: tiers.get(f.key) for f in bench.extras})
        except UserError as exc:
            fail(str(exc))
    rows: list[StoreBenchResult] = []
    notes: list[str] = []
    if not only:
        try:
            rows, notes = run_store_bench(chunk_mibs, total_mib, repeats, directory, thread_counts, modes, ways)
        except ValueError as exc:
            fail(str(exc))
        except OSError as exc:
            fail(f"the disk benchmark could not write its files ({exc.strerror}); free space or pick another --dir")
    for tier in measured:
        mine = [f for f in settings_flags if f.tier == tier]
        keys = [f.key for f in mine]
        settings = {f.key: tiers[f.key] for f in mine if given(f, tiers.get(f.key))}
        try:
            got, more = tier_bench(tier).run(settings, parsed[tier], chunk_mibs, total_mib, repeats)
        except UserError as exc:
            fail(flag_names(str(exc), keys).rstrip(".") + ".")
        rows += got
        notes += more
    if codecs is not None:
        got, more = _codec_rows(codecs, chunk_mibs, total_mib, repeats, directory, only, measured,
                                {f.key: tiers[f.key] for f in settings_flags if given(f, tiers.get(f.key))})
        rows += got
        notes += more
    table = Table(title="kvtier bench-store (tier vs same-run reference)")
    for col in ("tier", "io", "threads", "op", "chunk MiB", "GiB/s", "reference GiB/s", "ratio", "round ratios"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.tier, r.io, str(r.threads), r.op, f"{r.chunk_mib:g}", f"{r.gib_per_s:.2f}",
                      f"{r.reference_gib_per_s:.2f}", f"{r.ratio:.2f}", f"{r.ratio_min:.2f}-{r.ratio_max:.2f}")
    Console().print(table)
    if not only:
        print("reference: cpu = numpy.copyto of the same bytes; disk = open/pwrite/preadv/close of the same "
              "bytes, same I/O mode and thread count")
    for tier in measured:
        print(tier_bench(tier).reference)
    for note in notes:
        print(note)
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    if json_path is not None:
        try:
            json_path.write_text(json.dumps({"results": [r.as_dict() for r in rows], "notes": notes,
                                             "load_average": list(load)}, indent=2))
        except OSError as exc:  # checked before the run, but a disk can fill or go away meanwhile
            fail(f"cannot write --json {json_path} ({exc.strerror}); free space or pass a path in a writable "
                 "directory (the table above has the results)")
        print(f"wrote {json_path}")
