"""``kvtier doctor``: read a live vLLM server's /metrics twice and say whether KV offload helps."""

from __future__ import annotations

import json
import math
import time

import typer

from kvtier.cli.errors import fail
from kvtier.core.errors import UserError

HELP = """Check a running vLLM server: prefix-cache hit rate, external (offload) hit rate, TTFT p50/p99, the offload size vLLM actually allocated, and each of kvtier's shared tiers (redis, s3: hit rate, read latency, circuit breaker, skipped writes), and, on a kvtier with request receipts, why the rest missed (the miss reasons ranked, each with what to do, the size that holds a tier's working set when its evictions lead, the prefill seconds each tier saved), then give a verdict.

Scrapes URL/metrics twice (a URL with a path is scraped as given), --interval seconds apart (run it while traffic flows), and compares the offload size with --expect-offload-gib (GiB, total across TP ranks): vLLM's --kv-offloading-size from vllm:cache_config_info, or for kvtier the sum of its tiers (cpu + disk, from kvtier_capacity_bytes), each tier also reported alone with what it holds and the prompt tokens it served. Exit code 1 when the verdict is "problem".

Examples:

  kvtier doctor --url http://localhost:8000

  kvtier doctor --url http://vllm:8000 --interval 60 --expect-offload-gib 1600 --tp 8

  kvtier doctor --from-files before.txt after.txt --json
"""


def _print_text(url: str, meters, alloc, diagnosis, expect_gib: float | None) -> None:  # type: ignore[no-untyped-def]
    from rich.console import Console
    from rich.markup import escape

    from kvtier.doctor.verdict import shared_summary

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f} s"

    console = Console(highlight=False)
    interval = "interval unknown: recorded files" if meters.interval_s is None else f"interval {meters.interval_s:.2f} s"
    console.print(f"[bold]kvtier doctor[/bold] {escape(str(url))} ({interval})")
    console.print(f"  reuse (GPU + offload)   {pct(meters.reuse_rate)}")
    console.print(f"  prefix-cache hit rate   {pct(meters.hit_rate)}  ({meters.hits:,.0f} / {meters.queries:,.0f} "
                  f"tokens; lifetime {pct(meters.lifetime_hit_rate)})")
    console.print(f"  external hit rate       {pct(meters.external_hit_rate)}  ({meters.external_hits:,.0f} / "
                  f"{meters.external_queries:,.0f} tokens)")
    console.print(f"  TTFT p50 / p99 (server) {sec(meters.ttft_p50_s)} / {sec(meters.ttft_p99_s)}  "
                  f"({meters.ttft_requests:,.0f} requests)  [dim]({TTFT_MEASURED})[/dim]")
    gib = "none" if alloc.gib is None else f"{alloc.gib:g} GiB"
    expected = "" if expect_gib is None else f", compared with --expect-offload-gib {expect_gib:g}"
    console.print(f"  offload allocated       {gib}  [dim]({alloc.compared}{expected})[/dim]")
    for tier, capacity in alloc.tiers_gib.items():
        loaded = meters.loaded_tokens_by_tier.get(tier)
        served = "" if loaded is None else f"; served {loaded:,.0f} prompt tokens"
        console.print(f"    kvtier {tier:<5}         {capacity:g} GiB, {alloc.used_gib.get(tier, 0.0):.3g} GiB held{served}")
    for shared in meters.shared_tiers:
        console.print(f"  {'shared tier (' + shared.tier + ')':<23} {shared_summary(shared)}; breaker {shared.breaker}")
    style = {"ok": "green", "warning": "yellow", "problem": "bold red"}
    for check in diagnosis.checks:
        console.print(f"  [{style[check.level]}]{check.level:<8}[/] {escape(check.message)}")
    verdict_style = {"healthy": "green", "warning": "yellow", "problem": "bold red", "inconclusive": "cyan"}
    console.print(f"verdict: [{verdict_style[diagnosis.verdict]}]{diagnosis.verdict}[/]")


TTFT_MEASURED = ("server-side: vLLM's vllm:time_to_first_token_seconds, from the request's arrival in the engine "
                 "to its first token, interpolated within the histogram's buckets; kvtier bench run measures at the "
                 "client, HTTP and streaming included, and reads higher")
"""What doctor's TTFT is (vllm/v1/metrics/stats.py: first token time - ``arrival_time``, set by
``AsyncLLM`` when the request enters the engine), said beside it so that it does not contradict the
client-side TTFT of ``kvtier bench run`` (:data:`kvtier.bench.run.TTFT_MEASURED`)."""

MAX_INTERVAL_S = 86400.0
"""Longest --interval (one day): longer is a typo, and time.sleep overflows on huge values."""
DEFAULT_INTERVAL_S = 10.0
"""--interval when not given, seconds."""
DEFAULT_TIMEOUT_S = 10.0
"""--timeout when not given, seconds."""
MAX_TP = 1024
"""Largest --tp: GPUs in one tensor-parallel group, past any NVLink domain (GB200 NVL72: 72 GPUs); a
whole number of at least 1 as vLLM requires (``ParallelConfig.tensor_parallel_size``, ``ge=1``,
vllm/config/parallel.py; audit rule ``parallel-size-invalid``).  Beyond float range --tp crashed the
comparison with --expect-offload-gib (OverflowError)."""


def _read_file(path: str) -> str:
    """A recorded /metrics text, at most MAX_BODY_BYTES.  Raises UserError when unreadable or binary."""
    from kvtier.tools.inputfile import not_a_regular_file
    from kvtier.tools.scrape import MAX_BODY_BYTES

    if (kind := not_a_regular_file(path)) is not None:  # stat before open: a FIFO would hang
        raise UserError(f"{path} {kind}; give a recorded /metrics page (a file).")
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_BODY_BYTES + 1)
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or exc.__class__.__name__}); give a recorded /metrics "
                        "page, e.g. curl -s http://HOST:PORT/metrics > FILE, once before and once after.") from None
    if len(data) > MAX_BODY_BYTES:
        raise UserError(f"{path} is larger than {MAX_BODY_BYTES >> 20} MiB; that is not a /metrics recording.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not text (not UTF-8); give a recorded /metrics page.") from None


def doctor_command(
    url: str | None = typer.Option(None, "--url", help="vLLM server, http://HOST:PORT (/metrics is added); a URL with a path (http://HOST:PORT/prefix/metrics behind a proxy) is scraped as given, nothing added."),
    interval: float | None = typer.Option(None, "--interval", help="With --url: seconds between the two scrapes "
                                          f"(default {DEFAULT_INTERVAL_S:g})."),
    expect_offload_gib: float | None = typer.Option(None, "--expect-offload-gib",
                                                    help="Offload size you configured, GiB total across TP ranks: --kv-offloading-size, or for kvtier cpu_gib + disk_gib (compared with the tiers' sum)."),
    tp: int = typer.Option(1, "--tp", help=f"Tensor-parallel size of the server, 1 to {MAX_TP:,}."),
    from_files: tuple[str, str] | None = typer.Option(None, "--from-files",
                                                      help="Two recorded /metrics texts (before, after) instead of --url."),
    timeout: float | None = typer.Option(None, "--timeout", help="With --url: HTTP timeout per scrape, seconds "
                                         f"(default {DEFAULT_TIMEOUT_S:g})."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    from kvtier.doctor import allocation, diagnose, measure, parse_metrics
    from kvtier.doctor.causes import causes_json
    from kvtier.doctor.meters import recorded_after
    from kvtier.size.plan import MAX_GIB
    from kvtier.tools.scrape import fetch_metrics, metrics_url

    try:
        if not 1 <= tp <= MAX_TP:
            raise UserError(f"--tp must be a whole number of GPUs from 1 to {MAX_TP:,}, got {tp:,}.")
        if expect_offload_gib is not None and not 0 <= expect_offload_gib <= MAX_GIB:  # nan fails too
            raise UserError(f"--expect-offload-gib must be from 0 to {MAX_GIB:,.0f} GiB (1 PiB, the bound of "
                            f"kvtier size --offload-gib), got {expect_offload_gib:g}.")
        elapsed: float | None
        if from_files and url:
            raise UserError("--url and --from-files are two sources of the metrics; give --url to scrape a live "
                            "server, or --from-files BEFORE AFTER to read recorded texts, not both.")
        if from_files:
            given = [flag for flag, value in (("--interval", interval), ("--timeout", timeout)) if value is not None]
            if given:  # silently unused before: a recording has no scrape to time or wait for
                raise UserError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to --url only "
                                f"(the live scrapes); --from-files reads recorded texts, so drop "
                                f"{'them' if len(given) > 1 else 'it'}.")
            texts = [_read_file(path) for path in from_files]
            before, after = (parse_metrics(t, p, from_file=True) for t, p in zip(texts, from_files, strict=True))
            if recorded_after(before, after):
                first, second = from_files
                raise UserError(f"the files are in the wrong order: {first} was recorded after {second} (the same "
                                f"server process, every counter at or above {second}'s); give --from-files {second} "
                                f"{first}.")
            source, elapsed = " → ".join(from_files), None
        elif url:
            interval = DEFAULT_INTERVAL_S if interval is None else interval
            timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
            if not math.isfinite(interval) or not 0 < interval <= MAX_INTERVAL_S:
                raise UserError(f"--interval must be in (0, {MAX_INTERVAL_S:g}] seconds, got {interval}.")
            if not math.isfinite(timeout) or not 0 < timeout <= MAX_INTERVAL_S:  # 1e300 overflowed a thread wait
                raise UserError(f"--timeout must be in (0, {MAX_INTERVAL_S:g}] seconds, got {timeout}.")
            source = metrics_url(url)
            before = parse_metrics(fetch_metrics(source, timeout), source)
            start = time.monotonic()
            time.sleep(interval)
            after = parse_metrics(fetch_metrics(source, timeout), source)
            elapsed = time.monotonic() - start
        else:
            raise UserError("give --url http://HOST:PORT of a vLLM server (or --from-files BEFORE AFTER).")
    except UserError as exc:
        fail(str(exc))
    meters = measure(before, after, elapsed)
    alloc = allocation(after)
    diagnosis = diagnose(meters, alloc, after.cache_config, expect_offload_gib, tp)
    if as_json:
        print(json.dumps({
            "url": source, "interval_s": None if meters.interval_s is None else round(meters.interval_s, 3),
            "prefix_cache_hit_rate": meters.hit_rate, "external_hit_rate": meters.external_hit_rate,
            "reuse_rate": meters.reuse_rate,
            "prefix_cache_queries": meters.queries, "prefix_cache_hits": meters.hits,
            "external_queries": meters.external_queries, "external_hits": meters.external_hits,
            "lifetime_hit_rate": meters.lifetime_hit_rate,
            "ttft_p50_s": meters.ttft_p50_s, "ttft_p99_s": meters.ttft_p99_s, "ttft_measured": TTFT_MEASURED, "ttft_requests": meters.ttft_requests,
            "offload_allocated_gib": alloc.gib, "offload_backend": alloc.backend, "offload_detail": alloc.detail,
            "offload_compared": alloc.compared,
            "tiers": {tier: {"capacity_gib": gib, "used_gib": alloc.used_gib.get(tier, 0.0),
                             "loaded_tokens": meters.loaded_tokens_by_tier.get(tier)}
                      for tier, gib in alloc.tiers_gib.items()},
            "shared_tier": None if meters.shared is None else {
                "hit_rate": meters.shared.hit_rate, "lookup_chunks": meters.shared.lookup_chunks,
                "hit_chunks": meters.shared.hit_chunks, "timed_out_lookups": meters.shared.timed_out_lookups,
                "skipped_lookups": meters.shared.skipped_lookups, "errors": meters.shared.errors,
                "skipped_calls": meters.shared.skipped_calls, "skipped_writes": meters.shared.skipped_writes,
                "breaker": meters.shared.breaker, "breaker_state": meters.shared.breaker_state},
            "shared_tiers": {t.tier: {
                "hit_rate": t.hit_rate if t.asked else None, "lookup_chunks": t.lookup_chunks,
                "hit_chunks": t.hit_chunks, "timed_out_lookups": t.timed_out_lookups, "errors": t.errors,
                "skipped_calls": t.skipped_calls, "skipped_writes": t.skipped_writes, "reads": t.reads,
                "read_latency_s": t.read_latency_s, "read_gib_per_s": t.read_gib_per_s,
                "loaded_tokens": t.loaded_tokens, "breaker": t.breaker, "breaker_state": t.breaker_state}
                for t in meters.shared_tiers},
            "pins": None if meters.pins is None else {
                "pinned_chunks": meters.pins.chunks, "pinned_bytes": meters.pins.bytes,
                "refused_chunks": meters.pins.refused},
            "controls": None if meters.controls is None else {
                "kv_events_enabled": meters.controls.events_enabled,
                "tenant_quota_default_share": meters.controls.quota_default_share,
                "tenant_quota_salts": meters.controls.quota_salts,
                "tenant_quota_no_salt_share": meters.controls.quota_no_salt_share,
                "quota_evictions": meters.controls.quota_evictions, "tenant_usage_bytes": meters.controls.tenants,
                "problems": list(meters.controls.problems)},
            "causes": causes_json(meters.causes, tp),
            "expected_offload_gib": expect_offload_gib, "tp": tp,
            "checks": [{"level": c.level, "message": c.message} for c in diagnosis.checks],
            "verdict": diagnosis.verdict,
        }, indent=2))
    else:
        _print_text(source, meters, alloc, diagnosis, expect_offload_gib)
    if diagnosis.verdict == "problem":
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``kvtier doctor`` to the CLI."""
    app.command("doctor", help=HELP)(doctor_command)
