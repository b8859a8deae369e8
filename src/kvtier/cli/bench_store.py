"""``kvtier bench-store``: tier throughput as a ratio to the machine's plain copy and file I/O."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import typer

from kvtier.cli.errors import fail, flag_names, refuse_kernel_filesystem

MIN_CHUNK_MIB = 0.004  # 4 KiB: one OS page
MAX_CHUNK_MIB = 1024.0
MAX_TOTAL_MIB = 16384.0
MAX_THREADS = 64


def register(app: typer.Typer) -> None:
    app.command("bench-store")(bench_store)


def bench_store(
    sizes: str = typer.Option("0.5,4,32", help="Chunk sizes in MiB, comma-separated."),
    total_mib: float = typer.Option(256, help="MiB moved per measurement round."),
    repeats: int = typer.Option(5, min=1, help="Rounds per figure; the median is reported."),
    threads: str = typer.Option("1", help="Disk thread counts, comma-separated: chunks moved at once by the "
                                          "tier (io_threads) and by the reference, e.g. 1,2,4."),
    disk_io: str = typer.Option("buffered,direct", help="Disk I/O modes to measure: buffered and/or direct "
                                                        "(O_DIRECT); the reference uses the same mode."),
    buffered_reads: str = typer.Option("auto", help="Buffered reads to measure: auto (serial or split over two "
                                                    "threads, as measured), serial and/or split (forced)."),
    directory: Path | None = typer.Option(None, "--dir", help="Where the disk tier writes (default: a temp dir)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write results as JSON here."),
    redis_url: str | None = typer.Option(None, help="Also measure the redis tier on this server "
                                                     "(redis:// or rediss://); its keys are deleted afterwards."),
    redis_cluster: bool = typer.Option(False, help="--redis-url names a seed node of a Redis Cluster."),
    redis_only: bool = typer.Option(False, help="Measure only the redis tier (needs --redis-url)."),
    s3_bucket: str | None = typer.Option(None, help="Also measure the s3 tier on this bucket (created beforehand; "
                                                     "credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                                                     "--s3-credentials-file); its objects are deleted afterwards."),
    s3_endpoint_url: str | None = typer.Option(None, help="S3-compatible server of --s3-bucket (default: AWS S3)."),
    s3_region: str = typer.Option("us-east-1", help="Region the s3 requests are signed for."),
    s3_allow_http: bool = typer.Option(False, help="Allow a plain http:// --s3-endpoint-url."),
    s3_credentials_file: str | None = typer.Option(None, help="AWS shared-credentials file for --s3-bucket."),
    s3_in_flight: str = typer.Option("1,4,16", help="s3 requests in flight (tier and reference alike), "
                                                    "comma-separated, e.g. 1,4,16."),
    s3_only: bool = typer.Option(False, help="Measure only the s3 tier (needs --s3-bucket)."),
    s3_assume_conditional_put: bool = typer.Option(
        False, help="Time s3 puts as on a server that honours If-None-Match: * (one PUT per chunk, no HEAD) even "
                    "where the server ignores it, as rclone serve s3 does; every key the benchmark writes is new, "
                    "so the requests are the same ones."),
) -> None:
    """Measure cpu and disk tier put/get throughput against numpy copy and raw file I/O.

    Example: kvtier bench-store --sizes 4,32 --threads 1,2,4 --json out/bench-store.json
    """
    from rich.console import Console
    from rich.table import Table

    from kvtier.bench.storebench import StoreBenchResult, run_store_bench

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
    if redis_only and s3_only:
        fail("--redis-only and --s3-only exclude each other; give one of them, or neither to measure every tier")
    if redis_only and not redis_url:
        fail("--redis-only needs --redis-url, e.g. --redis-url redis://127.0.0.1:6379/0")
    if s3_only and not s3_bucket:
        fail("--s3-only needs --s3-bucket, e.g. --s3-bucket kvcache --s3-endpoint-url https://minio:9000")
    # an option of a tier that is not measured would be ignored, the run reporting the other tiers alone
    s3_given = [flag for flag, given in (("--s3-endpoint-url", s3_endpoint_url is not None),
                                         ("--s3-region", s3_region != "us-east-1"), ("--s3-allow-http", s3_allow_http),
                                         ("--s3-credentials-file", s3_credentials_file is not None),
                                         ("--s3-in-flight", s3_in_flight != "1,4,16"),
                                         ("--s3-assume-conditional-put", s3_assume_conditional_put)) if given]
    if s3_given and not s3_bucket:
        fail(f"{', '.join(s3_given)} {'needs' if len(s3_given) == 1 else 'need'} --s3-bucket BUCKET to measure the "
             "s3 tier; add it, or drop them to measure the other tiers only")
    if redis_cluster and not redis_url:
        fail("--redis-cluster needs --redis-url (a seed node of the Cluster) to measure the redis tier; add it, or "
             "drop --redis-cluster to measure the other tiers only")
    try:
        in_flights = [int(t) for t in s3_in_flight.split(",") if t.strip()]
    except ValueError:
        in_flights = []
    if not in_flights or not all(1 <= t <= 256 for t in in_flights):
        fail(f"--s3-in-flight {s3_in_flight!r} must be a comma-separated list of counts from 1 to 256; e.g. 1,4,16")
    rows: list[StoreBenchResult] = []
    notes: list[str] = []
    if not redis_only and not s3_only:
        try:
            rows, notes = run_store_bench(chunk_mibs, total_mib, repeats, directory, thread_counts, modes, ways)
        except ValueError as exc:
            fail(str(exc))
        except OSError as exc:
            fail(f"the disk benchmark could not write its files ({exc.strerror}); free space or pick another --dir")
    if redis_url and not s3_only:
        rows += _redis_rows(redis_url, redis_cluster, chunk_mibs, total_mib, repeats)
    if s3_bucket and not redis_only:
        s3 = {"s3_bucket": s3_bucket, "s3_endpoint_url": s3_endpoint_url, "s3_region": s3_region,
              "s3_allow_http": s3_allow_http, "s3_credentials_file": s3_credentials_file}
        s3_rows, s3_path = _s3_rows({k: v for k, v in s3.items() if v is not None}, chunk_mibs, total_mib, repeats,
                                    in_flights, s3_assume_conditional_put)
        rows += s3_rows
        notes.append(f"s3 put: {s3_path}")
    table = Table(title="kvtier bench-store (tier vs same-run reference)")
    for col in ("tier", "io", "threads", "op", "chunk MiB", "GiB/s", "reference GiB/s", "ratio", "round ratios"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.tier, r.io, str(r.threads), r.op, f"{r.chunk_mib:g}", f"{r.gib_per_s:.2f}",
                      f"{r.reference_gib_per_s:.2f}", f"{r.ratio:.2f}", f"{r.ratio_min:.2f}-{r.ratio_max:.2f}")
    Console().print(table)
    if not redis_only and not s3_only:
        print("reference: cpu = numpy.copyto of the same bytes; disk = open/pwrite/preadv/close of the same "
              "bytes, same I/O mode and thread count")
    if redis_url and not s3_only:
        print("reference: redis = raw redis-py pipelined SET/GET of the same bytes to the same server")
    if s3_bucket and not redis_only:
        print("reference: s3 = raw obstore put/get of the same bytes to the same bucket, same requests in flight")
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


def _redis_rows(url: str, cluster: bool, chunk_mibs: list[float], total_mib: float, repeats: int) -> list:
    from kvtier.bench.redisbench import bench_redis
    from kvtier.core.config import redact_url
    from kvtier.core.errors import ConfigError

    rows: list = []
    try:
        for mib in chunk_mibs:
            rows += bench_redis(url, mib, total_mib, repeats, cluster=cluster)
    except ConfigError as exc:
        fail(str(exc))
    except RuntimeError as exc:
        fail(f"the redis benchmark on {redact_url(url)} failed: {exc}; check --redis-url, that the server is up "
             "and its maxmemory")
    return rows


def _s3_rows(settings: dict[str, object], chunk_mibs: list[float], total_mib: float, repeats: int,
             in_flights: list[int], assume_conditional_put: bool) -> tuple[list, str]:
    from kvtier.bench.s3bench import bench_s3
    from kvtier.core.errors import ConfigError

    rows: list = []
    path = ""
    try:
        for mib in chunk_mibs:
            for n in in_flights:
                got, path = bench_s3(settings, mib, total_mib, repeats, n,
                                     assume_conditional_put=assume_conditional_put)
                rows += got
    except ConfigError as exc:
        fail(flag_names(str(exc), S3_FLAG_KEYS).rstrip(".") + ".")
    except RuntimeError as exc:
        fail(f"the s3 benchmark on bucket {settings['s3_bucket']} failed: {exc}; check the server and credentials")
    except Exception as exc:  # noqa: BLE001 - obstore's errors (unreachable, 403, no such bucket): one sentence
        from kvtier.core.tiers.s3.client import describe_failure
        from kvtier.core.tiers.s3.settings import S3Settings

        state, detail = describe_failure(exc, S3Settings(**settings), 1.0)  # type: ignore[arg-type]
        fail(flag_names(f"the s3 benchmark on bucket {settings['s3_bucket']} failed: {state}: {detail}; check "
                        "--s3-endpoint-url, that the server is up and the credentials", S3_FLAG_KEYS))
    return rows, path


S3_FLAG_KEYS = ("s3_bucket", "s3_endpoint_url", "s3_region", "s3_allow_http", "s3_credentials_file")
"""The s3 settings bench-store takes as flags (its errors name the flags)."""
