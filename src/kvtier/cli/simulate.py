"""``kvtier simulate``: replay a request trace through modelled tiers, per capacity and policy."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from kvtier.cli.errors import fail
from kvtier.cli.outputs import FORCE_HELP, REFUSED, check_new_files
from kvtier.core.errors import UserError
from kvtier.core.policies import available_policies

MAX_CAPACITY_GIB = float(1 << 20)  # 1 PiB: the bound of `kvtier size --offload-gib` (docs/size.md)


def parse_gib_list(text: str, option: str) -> tuple[float, ...]:
    """``"64,128,256"`` → ``(64.0, 128.0, 256.0)``; one sentence on a bad list (typer.Exit).

    ``option`` ``--cpu-pct`` reads percentages of the trace's distinct chunks (0 to 100: 100 % already
    holds every chunk, so the tier never evicts); any other option reads GiB, at most 1 PiB.
    """
    pct = option == "--cpu-pct"
    unit, example, maximum = ("%", "1,5,10,100", 100.0) if pct else ("GiB", "64,128,256", MAX_CAPACITY_GIB)
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            fail(f"{option} must be comma-separated {'percentages' if pct else 'GiB numbers'} such as {example}; "
                 f"{part.strip()!r} is not a number")
        if not value >= 0 or value == float("inf"):
            fail(f"{option} values must be finite and >= 0 {unit}; got {part.strip()}")
        if value > maximum:
            fail(f"{option} values must be at most 100 % (a cpu tier holding every distinct chunk of the trace); "
                 f"got {part.strip()}" if pct else
                 f"{option} values must be at most {MAX_CAPACITY_GIB:,.0f} GiB (1 PiB); got {part.strip()}")
        values.append(value)
    if len(set(values)) != len(values):
        fail(f"{option} lists a capacity twice ({text}); give each capacity once")
    return tuple(values)


def _per_token(model: str, tp: int, kv_dtype: str) -> int:
    """KV bytes per token of ``model`` at ``tp`` (totals across ranks), resolved exactly as ``kvtier size``
    resolves it (:func:`kvtier.size.models.resolve_model`: a path, a preset, or the hub).

    Raises:
        UserError: the model cannot be resolved, TP does not fit its heads, or the dtype is unknown.
    """
    from kvtier.core.dtypes import DTYPE_BYTES, kv_cache_short_name
    from kvtier.size.models import resolve_model

    dtype = "bf16" if kv_dtype.strip().lower() == "auto" else kv_cache_short_name(kv_dtype)
    if dtype is None:
        raise UserError(f"--kv-dtype {kv_dtype!r} is not one of auto, bf16, fp16, fp8.")
    geometry = resolve_model(model).geometry
    geometry.check_tp(tp)
    return geometry.kv_bytes_per_token(tp, DTYPE_BYTES[dtype])


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate(
        trace: Path = typer.Option(..., "--trace", help="Request trace (.jsonl or .jsonl.gz; 'bundled': the "
                                   "Mooncake trace shipped with kvtier)."),
        fmt: str = typer.Option("auto", "--format", "--trace-format", help="Trace format: auto (from its first "
                                 "record), mooncake or kvtier-jsonl."),
        model: str | None = typer.Option(None, "--model", help="Model as kvtier size reads it: a config.json, a model "
                                         "directory, a built-in preset or a hub id (kvtier size --list-presets)."),
        tp: int = typer.Option(1, "--tp", help="With --model: tensor-parallel size (KV bytes per token are totals "
                               "across ranks, as kvtier size prints them)."),
        kv_dtype: str = typer.Option("auto", "--kv-dtype", help="With --model: KV cache dtype: auto (bf16), bf16, "
                                     "fp16 or fp8."),
        kv_bytes_per_token: int | None = typer.Option(
            None, "--kv-bytes-per-token", help="KV bytes per token, all layers (instead of --model)."),
        tokens_per_block: int | None = typer.Option(
            None, "--tokens-per-block", help="Tokens per trace block / chunk key (512 for mooncake traces; "
            "kvtier-jsonl records carry their own)."),
        engine_gib: float = typer.Option(..., "--engine-gib", help="The engine's own prefix-cache KV budget "
                                         "(tier 0, HBM), GiB, total across tensor-parallel ranks."),
        cpu_gib: str | None = typer.Option(None, "--cpu-gib", help="CPU tier capacities to sweep, GiB, "
                                           "comma-separated, total across tensor-parallel ranks (e.g. 64,128,256)."),
        cpu_pct: str | None = typer.Option(None, "--cpu-pct", help="Instead of --cpu-gib: capacities as % of the "
                                           "trace's distinct chunks (e.g. 1,2,5,10,20,50,100)."),
        disk_gib: float = typer.Option(0.0, "--disk-gib", help="Disk tier capacity, GiB (0: none)."),
        shared_gib: float = typer.Option(0.0, "--shared-gib", help="Shared tier capacity, GiB (0: none): Redis/Valkey "
                                         "maxmemory, or the s3 tier's s3_capacity_gib."),
        shared_tier: str | None = typer.Option(None, "--shared-tier", help="Which shared tier --shared-gib models: "
                                               "its bandwidth and latency defaults (redis: 1.25 GB/s, 0.5 ms; s3: "
                                               "1.25 GB/s, 100 ms first byte). Default: the first registered."),
        disk_admission: str = typer.Option("all", "--disk-admission", help="all, or reused: the disk takes only "
                                           "chunks the cpu tier served."),
        shared_admission: str = typer.Option("all", "--shared-admission", help="all or reused, for the shared tier."),
        policy: str = typer.Option("lru,lru-tail,default,belady", "--policy",
                                   help="Eviction policies, comma-separated, from: "
                                   + ", ".join(available_policies() + ["belady"]) + "."),
        compression_ratio: list[str] | None = typer.Option(None, "--compression-ratio", help="TIER=R: the disk or "
                                                           "shared tier compresses, holding R× the chunks (R >= 1, or "
                                                           "a codec: its ratio measured in docs/benchmarks.md)."),
        json_path: Path | None = typer.Option(None, "--json", help=f"Write results as JSON here ({REFUSED})."),
        plot_path: Path | None = typer.Option(None, "--plot", help=f"Write a PNG hit-ratio plot here ({REFUSED})."),
        force: bool = typer.Option(False, "--force", help=FORCE_HELP),
        recommend_mode: bool = typer.Option(False, "--recommend", help="Print a size per tier (cpu: knee of "
                                            "the default's curve, never 0; a disk or shared tier given: as given; "
                                            "no lower tier given: the smallest disk tier reaching 95% of the "
                                            "no-eviction ceiling, by extra replays), or one line saying why none "
                                            "is enough."),
        prefill_tokens_per_s: float = typer.Option(20_000.0, "--prefill-tokens-per-s",
                                                   help="Prefill throughput, tokens/s (see docs/simulate.md)."),
        cpu_gb_per_s: float = typer.Option(64.0, "--cpu-gb-per-s", help="CPU→GPU bandwidth, GB/s (PCIe Gen5 x16)."),
        disk_gb_per_s: float = typer.Option(7.0, "--disk-gb-per-s", help="Disk read bandwidth, GB/s (Gen4 NVMe)."),
        shared_gb_per_s: float | None = typer.Option(None, "--shared-gb-per-s", help="Shared tier bandwidth, GB/s "
                                                     "(default: --shared-tier's, 10 Gb/s Ethernet)."),
        disk_latency_ms: float = typer.Option(0.1, "--disk-latency-ms", help="Disk latency per request served, ms."),
        shared_latency_ms: float | None = typer.Option(None, "--shared-latency-ms", help="Shared tier latency per "
                                                       "request served, ms (default: --shared-tier's)."),
        workers: int = typer.Option(0, "--workers", help="Processes (0: one per CPU core)."),
        host_ram_gib: float | None = typer.Option(None, "--host-ram-gib", help="With --recommend: host RAM of the "
                                                  "node, GiB: print kvtier size's tiers for this trace and replay them."),
        host_reserve_gib: float | None = typer.Option(None, "--host-reserve-gib", help="Host RAM kept from the cpu "
                                                      "tier, GiB (default: 16 + 16 per GPU of --tp, as kvtier size)."),
        nvme_gib: float | None = typer.Option(None, "--nvme-gib", help="With --recommend: NVMe capacity for the disk "
                                              "tier, GiB (as kvtier size --nvme-gib)."),
    ) -> None:
        """Replay a trace through the engine's prefix cache, a cpu tier and a disk tier, and report
        hit ratios per capacity and eviction policy next to Belady's offline optimum."""
        from rich.console import Console
        from rich.markup import escape

        from kvtier.simulate.cost import Throughputs
        from kvtier.simulate.recommend import advise
        from kvtier.simulate.report import print_report, write_json
        from kvtier.simulate.sweep import SweepSpec, check_policies, policy_label, run_sweep
        from kvtier.simulate.trace import read_trace, trace_path

        started = time.perf_counter()
        if (model is None) == (kv_bytes_per_token is None):
            fail("pass exactly one of --model MODEL (a config.json, a model directory, a kvtier size preset or a hub id) "
                 "or --kv-bytes-per-token N (all ranks) to give the KV size per token")
        if kv_bytes_per_token is not None and kv_bytes_per_token <= 0:
            fail(f"--kv-bytes-per-token must be a positive integer, got {kv_bytes_per_token}")
        if kv_bytes_per_token is not None and (tp != 1 or kv_dtype != "auto"):
            fail("--tp and --kv-dtype apply with --model (they derive its KV bytes per token); with "
                 "--kv-bytes-per-token give the bytes of all ranks at your TP and dtype, and drop them")
        if tokens_per_block is not None and tokens_per_block <= 0:
            fail(f"--tokens-per-block must be a positive integer, got {tokens_per_block}")
        if not all(0 <= g < float("inf") for g in (engine_gib, disk_gib, shared_gib)):
            fail("--engine-gib, --disk-gib and --shared-gib must be finite and >= 0 GiB")
        for option, capacity in (("--engine-gib", engine_gib), ("--disk-gib", disk_gib), ("--shared-gib", shared_gib)):
            if capacity > MAX_CAPACITY_GIB:
                fail(f"{option} must be at most {MAX_CAPACITY_GIB:,.0f} GiB (1 PiB), got {capacity:g}")
        from kvtier.core.policies.admission import available_admissions

        for option, value in (("--disk-admission", disk_admission), ("--shared-admission", shared_admission)):
            if value not in available_admissions():
                fail(f"{option} must be one of {', '.join(available_admissions())}, got {value!r}")
        if workers < 0:
            fail(f"--workers must be >= 0, got {workers}")
        if (cpu_gib is None) == (cpu_pct is None):
            fail("pass exactly one of --cpu-gib (GiB) or --cpu-pct (% of the trace's distinct chunks)")
        # `is not None`, not truthiness: an empty --cpu-gib '' is --cpu-gib's mistake, not --cpu-pct's
        gibs = parse_gib_list(cpu_gib if cpu_gib is not None else cpu_pct or "",
                              "--cpu-gib" if cpu_gib is not None else "--cpu-pct")
        option = "--cpu-gib" if cpu_gib is not None else "--cpu-pct"
        if 0 in gibs and (disk_gib > 0 or shared_gib > 0):  # a tier below a cpu tier that is not there
            fail(f"{option} 0 with --disk-gib or --shared-gib models a lower tier without a cpu tier, which kvtier "
                 "refuses (cpu_gib must be above 0: every chunk passes through the cpu tier, also on its way to disk "
                 f"or Redis); drop the 0 from {option}")
        if 0 in gibs:  # kept: the engine alone is the baseline the other capacities are read against
            print(f"note: {option} 0 is the engine alone (no kvtier), a baseline row; kvtier itself refuses cpu_gib 0 "
                  "(every chunk passes through the cpu tier)", file=sys.stderr)
        model_file = Path(model) if model is not None and Path(model).is_file() else None
        check_new_files([("--json", json_path), ("--plot", plot_path)], force,
                        [("--trace", trace), ("--model", model_file)])
        policies = tuple(p.strip() for p in policy.split(",") if p.strip())
        if not policies:
            fail("--policy lists no policy; give e.g. lru,default,belady")
        unused = [flag for flag, value in (("--shared-tier", shared_tier), ("--shared-gb-per-s", shared_gb_per_s),
                                           ("--shared-latency-ms", shared_latency_ms)) if value is not None]
        from kvtier.core.tiers.registry import modeled_tiers

        models = {spec.name: spec.model for spec in modeled_tiers() if spec.model is not None}
        name = shared_tier if shared_tier is not None else next(iter(models), None)
        if name not in models:
            fail(f"--shared-tier must be one of {', '.join(models) or '(none registered)'}, got {shared_tier!r}")
        assert name is not None
        shared_model = models[name]
        shared_gb_per_s = shared_model.gb_per_s if shared_gb_per_s is None else shared_gb_per_s
        shared_latency_ms = shared_model.latency_ms if shared_latency_ms is None else shared_latency_ms
        try:
            check_policies(policies)
            rates = Throughputs(prefill_tokens_per_s, cpu_gb_per_s, disk_gb_per_s, shared_gb_per_s, 0.0,
                                disk_latency_ms, shared_latency_ms)
        except ValueError as exc:
            fail(str(exc))
        if shared_gib == 0 and (unused or shared_admission != "all"):  # a shared tier never sized by replay
            fail(f"{(unused or ['--shared-admission'])[0]} describes the shared tier, and this run has none "
                 "(--shared-gib 0); add --shared-gib GiB to model one, or drop it")
        if (host_ram_gib is not None or nvme_gib is not None) and not recommend_mode:
            fail("--host-ram-gib and --nvme-gib size kvtier size's tiers, which --recommend prints; add --recommend")
        try:
            per_token = _per_token(model, tp, kv_dtype) if model is not None else int(kv_bytes_per_token or 0)
            requests = read_trace(trace_path(trace), fmt, tokens_per_block)
            for flag, gib in (("--host-ram-gib", host_ram_gib), ("--host-reserve-gib", host_reserve_gib),
                              ("--nvme-gib", nvme_gib)):
                if gib is not None and not 0 <= gib <= MAX_CAPACITY_GIB:
                    raise UserError(f"{flag} must be from 0 to {MAX_CAPACITY_GIB:,.0f} GiB, got {gib:g}")
        except UserError as exc:
            fail(str(exc).rstrip("."))
        chunk_gib = per_token * requests.block_tokens / 2**30
        # --cpu-gib below one chunk (SweepSpec.chunks' rounding) holds nothing, as 0 does, refused above under a
        # lower tier; --cpu-pct is whole chunks, at least one
        below = [g for g in gibs if 0 < g and int(g / chunk_gib + 1e-6) == 0] if cpu_gib is not None else []
        if below and (disk_gib > 0 or shared_gib > 0):
            fail(f"{option} {below[0]:g} GiB is less than one {chunk_gib:g} GiB chunk: with --disk-gib or "
                 "--shared-gib that models a lower tier without a cpu tier, which kvtier refuses (a cpu tier "
                 f"smaller than one chunk fails at start-up); drop it from {option} or sweep at least {chunk_gib:g}")
        if below:  # as the note on 0: a row of the engine alone, which kvtier itself refuses
            print(f"note: {option} {','.join(f'{g:g}' for g in below)} GiB holds less than one {chunk_gib:g} GiB "
                  "chunk: the engine alone, like 0 (kvtier refuses a cpu tier smaller than one chunk)", file=sys.stderr)
        if cpu_pct is not None:  # whole chunks: pct of the footprint, at least one (0 %: no cpu tier, like --cpu-gib 0)
            gibs = tuple(max(1, round(requests.num_unique_chunks * p / 100)) * chunk_gib if p > 0 else 0.0
                         for p in gibs)
        from kvtier.size.compression import DISK, parse_ratios

        try:
            ratios = parse_ratios(compression_ratio, (DISK, name))
        except UserError as exc:
            fail(str(exc).rstrip("."))
        for tier, gib, flag in ((DISK, disk_gib, "--disk-gib"), (name, shared_gib, "--shared-gib")):
            if tier in ratios and gib <= 0:
                fail(f"--compression-ratio {tier}=... compresses the {tier} tier, which this run does not have; "
                     f"give {flag} GIB or drop it")
        # a compressing tier's GiB hold R× the chunks: modelled as R× the GiB of uncompressed chunks
        disk_gib *= ratios[DISK].ratio if DISK in ratios else 1.0
        shared_gib *= ratios[name].ratio if name in ratios else 1.0
        spec = SweepSpec(per_token * requests.block_tokens, engine_gib, gibs, disk_gib, policies, shared_gib,
                         (disk_admission, shared_admission))
        try:
            result = run_sweep(requests, spec, workers)
        except UserError as exc:
            fail(str(exc).rstrip("."))
        elapsed = time.perf_counter() - started

        console = Console()
        console.print(f"{escape(requests.name)}: {requests.num_requests:,} requests, {requests.num_chunks:,} chunks "
                      f"({requests.num_unique_chunks:,} distinct)")
        console.print(f"{requests.block_tokens} tokens × {per_token:,} B = {spec.chunk_bytes / 2**20:,.1f} MiB "
                      f"per chunk; replayed in {elapsed:.1f} s")
        if shared_gib > 0:
            defaults = (shared_gb_per_s, shared_latency_ms) == (shared_model.gb_per_s, shared_model.latency_ms)
            console.print(f"shared tier modeled as {name}: {shared_gb_per_s:g} GB/s, {shared_latency_ms:g} ms per "
                          f"request served ({shared_model.source if defaults else 'as given'})",
                          markup=False, highlight=False)
        for tier, ratio in ratios.items():
            console.print(f"{ratio.describe(tier)}; its GiB below are uncompressed chunk bytes",
                          markup=False, highlight=False)
        print_report(console, result, rates)
        if shared_gib > 0 and shared_admission != "all":  # a what-if: the connector's config refuses it
            console.print(f"note: --shared-admission {shared_admission} models a policy kvtier does not run: its "
                          "connector takes admission 'all' only for a shared tier (a chunk is judged when it "
                          "leaves the cpu tier, and a shared tier's chunks never do)", markup=False, highlight=False)
        if recommend_mode:
            name = "default" if "default" in policies else next((p for p in policies if p != "belady"), None)
            if name is None:
                fail("--recommend needs an online policy in --policy (belady knows the future)")
            planned = host_ram_gib is not None or nvme_gib is not None
            try:
                ceiling, sizes = advise(requests, spec, result.curve(name), name, rates, workers=workers,
                                        say=lambda line: console.print(line, markup=False, highlight=False),
                                        disk_elsewhere="sized below, as kvtier size sizes it" if planned else None)
            except UserError as exc:
                fail(str(exc).rstrip("."))
            import textwrap

            console.print(textwrap.fill(f"sizes for {policy_label(name)}, read from the table's rows (ceiling "
                                        f"{ceiling:.1%}: a cache that never evicts):", 80), soft_wrap=True)
            for size in sizes:
                shown = "none" if size.gib is None else f"{size.gib:,.0f} GiB" if size.gib >= 10 else f"{size.gib:g} GiB"
                console.print(textwrap.fill(f"  {size.tier:<6} {shown:>10}  {size.reason}", 80,
                                            subsequent_indent=" " * 21, break_on_hyphens=False), soft_wrap=True,
                              markup=False, highlight=False)
            if host_ram_gib is not None or nvme_gib is not None:
                from kvtier.cli.simulate_plan import print_plan

                print_plan(console, requests, spec, name, tp, host_ram_gib, host_reserve_gib, nvme_gib, rates)
        writing = None
        try:
            if json_path is not None:
                writing = f"--json {json_path}"
                write_json(json_path, result, elapsed, rates)
                console.print(f"JSON: {json_path}", markup=False)
            if plot_path is not None:
                from kvtier.simulate.plot import write_plot

                writing = f"--plot {plot_path}"
                write_plot(plot_path, result, f"{requests.name}, engine tier {engine_gib:g} GiB, "
                                              f"{spec.chunk_bytes / 2**20:,.0f} MiB chunks")
                console.print(f"plot: {plot_path}", markup=False)
        except OSError as exc:
            fail(f"cannot write {writing} ({exc.strerror}); free space or pass a path in a writable directory")
