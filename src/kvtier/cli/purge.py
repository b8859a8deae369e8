"""``kvtier purge``: remove stored KV chunks by namespace, tenant (cache_salt, LoRA) or age from a
disk tier's directory, a Redis/Valkey server and/or an S3 bucket, offline or under a live engine."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from kvtier.cli.errors import fail, flag_names
from kvtier.core.errors import UserError

HELP = """Remove stored KV chunks from a disk tier's directory (--disk-path), a Redis/Valkey server or Cluster (--redis-url) and/or an S3 bucket (--s3-bucket, with --s3-endpoint-url for MinIO, Ceph RGW or R2; credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or --s3-credentials-file), selected by namespace, cache_salt, LoRA adapter or age. Safe under a live engine: a purged chunk is never served (the engine reads it as a miss and recomputes); a live engine may still report it as a hit for a bounded time (docs/purge.md).

Selectors (a chunk must match every one given): --namespace HEX (repeatable; the 32-hex-digit directory names under disk_path; a dry run lists them), --older-than DURATION (written more than that long ago: a file's modification time on disk; an object's Last-Modified on S3; redis_ttl_s minus the key's remaining PTTL on Redis, so give --redis-ttl-s if the engines do not use the default), --salt SALT (the requests' cache_salt), --lora NAME (the LoRA adapter's name). --salt and --lora match only chunks saved with a tenant record (kvtier from this version on; disk files, Redis values and S3 objects alike): older chunks are left alone and counted as "unknown tenant", and a chunk whose record fails its check is left alone and named as a problem. Without any selector, purge refuses unless --all is given.

--dry-run prints what would go (chunks and bytes per tier and namespace) and removes nothing; without it the same numbers are what was removed. --json prints them as JSON. Exit code 0 when done, 1 when some chunk could not be read or removed or a server did not answer, 2 on bad input.

A purge reaches storage outside the engines (files, Redis keys): a live engine's cpu tier and vLLM's own GPU prefix cache keep what they hold until evicted (POST /reset_prefix_cache?reset_external=true clears them, for every tenant).

Examples:

  kvtier purge --disk-path /nvme/kvtier --salt tenant-b --dry-run

  kvtier purge --disk-path /nvme/kvtier --older-than 7d

  kvtier purge --redis-url redis://10.0.0.5:6379/0 --redis-password-env REDIS_PASSWORD --namespace 3f2a...e1 --json

  kvtier purge --redis-url redis://10.0.0.5:7000 --redis-cluster --salt tenant-b --dry-run

  kvtier purge --s3-bucket kvcache --s3-endpoint-url https://minio.example:9000 --salt tenant-b

  kvtier purge --disk-path /nvme/kvtier --all
"""


def _config(disk_path: str | None, targets: dict[str, Any]) -> tuple[Any, set[str]]:
    """The kvtier configuration of the targets given on the command line, and the keys given."""
    from kvtier.core.config import KVTierConfig

    values: dict[str, Any] = {k: v for k, v in targets.items() if v is not None}
    if disk_path is not None:
        values["disk_path"] = disk_path
    try:
        return KVTierConfig.from_dict(values), set(values)
    except UserError as exc:
        fail(flag_names(str(exc), [*targets, "disk_path"]).rstrip(".") + ".")


def purge_command(
    disk_path: str | None = typer.Option(None, "--disk-path", metavar="DIR", help="The disk tier's directory (its disk_path)."),
    redis_url: str | None = typer.Option(None, "--redis-url", metavar="URL", help="redis:// or rediss:// URL of the shared tier."),
    redis_cluster: bool = typer.Option(False, "--redis-cluster",
                                       help="--redis-url names a Cluster seed node (every primary is purged)."),
    redis_password_env: str | None = typer.Option(None, "--redis-password-env",
                                                  help="Environment variable holding the Redis password."),
    redis_password_file: str | None = typer.Option(None, "--redis-password-file",
                                                   help="File holding the Redis password."),
    redis_tls_ca_file: str | None = typer.Option(None, "--redis-tls-ca-file", help="CA bundle for rediss://."),
    redis_key_prefix: str | None = typer.Option(None, "--redis-key-prefix",
                                                help="The engines' redis_key_prefix (default kvtier:)."),
    redis_ttl_s: int | None = typer.Option(None, "--redis-ttl-s",
                                           help="The engines' redis_ttl_s, for --older-than (default 86400)."),
    s3_bucket: str | None = typer.Option(None, "--s3-bucket", metavar="BUCKET", help="The s3 tier's bucket (its s3_bucket)."),
    s3_endpoint_url: str | None = typer.Option(None, "--s3-endpoint-url", metavar="URL",
                                               help="https:// URL of an S3-compatible server (unset: AWS S3)."),
    s3_region: str | None = typer.Option(None, "--s3-region", help="The bucket's region (default us-east-1)."),
    s3_key_prefix: str | None = typer.Option(None, "--s3-key-prefix", help="The engines' s3_key_prefix (default kvtier/)."),
    s3_allow_http: bool = typer.Option(False, "--s3-allow-http", help="Allow a plain http:// --s3-endpoint-url."),
    s3_credentials_file: str | None = typer.Option(None, "--s3-credentials-file", metavar="FILE",
                                                   help="AWS credentials file (else AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                                                   "or the AWS chain)."),
    namespace: list[str] = typer.Option([], "--namespace", metavar="HEX", help="Namespace digest, 32 hex digits (repeatable)."),
    older_than: str | None = typer.Option(None, "--older-than", metavar="DURATION", help="Only chunks written longer ago: 90s, 30m, 12h, 7d."),
    salt: str | None = typer.Option(None, "--salt", metavar="SALT", help="Only chunks saved for requests with this cache_salt."),
    lora: str | None = typer.Option(None, "--lora", metavar="NAME", help="Only chunks saved for this LoRA adapter (its name)."),
    purge_all: bool = typer.Option(False, "--all", help="Allow a purge with no selector (every chunk)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be removed; remove nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    from kvtier.core.purge import PurgeFailed, PurgeSelector, parse_duration, parse_namespace, purge

    if s3_bucket is None and (s3_endpoint_url or s3_key_prefix is not None or s3_credentials_file or s3_region
                              or s3_allow_http):
        fail("--s3-endpoint-url, --s3-region, --s3-key-prefix, --s3-allow-http and --s3-credentials-file need "
             "--s3-bucket BUCKET (the bucket the engines use).")
    redis_given = [flag for flag, value in (("--redis-cluster", redis_cluster or None),
                                            ("--redis-password-env", redis_password_env),
                                            ("--redis-password-file", redis_password_file),
                                            ("--redis-tls-ca-file", redis_tls_ca_file),
                                            ("--redis-key-prefix", redis_key_prefix),
                                            ("--redis-ttl-s", redis_ttl_s)) if value is not None]
    if redis_url is None and redis_given:  # they were ignored: only the disk tier (if any) was purged
        fail(f"{', '.join(redis_given)} {'needs' if len(redis_given) == 1 else 'need'} --redis-url URL (the Redis/"
             f"Valkey server the engines use); add it, or drop {'it' if len(redis_given) == 1 else 'them'} to purge only the "
             "other targets.")
    if disk_path is None and redis_url is None and s3_bucket is None:
        fail("give a target to purge: --disk-path DIR (the disk tier's directory), --redis-url URL and/or "
             "--s3-bucket BUCKET.")
    if disk_path is not None and not disk_path.strip():
        fail("--disk-path is empty; give the disk tier's directory (its disk_path).")
    if redis_url is not None and not redis_url.strip():
        fail("--redis-url is empty; give the Redis/Valkey URL the engines use (their redis_url).")
    if salt is not None and salt == "":
        fail("--salt is empty; give the cache_salt the requests carried.")
    if lora is not None and lora == "":
        fail("--lora is empty; give the LoRA adapter's name as served (--lora-modules NAME=PATH).")
    try:
        selector = PurgeSelector(
            namespaces=frozenset(parse_namespace(n) for n in namespace),
            older_than_s=None if older_than is None else parse_duration(older_than),
            cache_salt=salt, lora_name=lora)
    except UserError as exc:
        fail(str(exc).rstrip(".") + ".")
    if not selector.selects_anything and not purge_all:
        fail("no selector given, which would remove every chunk; add --namespace, --older-than, --salt or --lora, "
             "or pass --all to remove everything.")
    targets = {"redis_url": redis_url, "redis_cluster": redis_cluster or None,
                                 "redis_password_env": redis_password_env, "redis_password_file": redis_password_file,
                                 "redis_tls_ca_file": redis_tls_ca_file, "redis_key_prefix": redis_key_prefix,
                                 "redis_ttl_s": redis_ttl_s, "s3_bucket": s3_bucket, "s3_endpoint_url": s3_endpoint_url,
                                 "s3_region": s3_region, "s3_key_prefix": s3_key_prefix,
                                 "s3_allow_http": s3_allow_http or None, "s3_credentials_file": s3_credentials_file}
    config, given = _config(disk_path, targets)
    try:
        # only the targets named on the command line: a KVTIER_* variable must not add one
        results = purge(config, selector, dry_run, given)
    except UserError as exc:
        fail(flag_names(str(exc), [*targets, "disk_path"]).rstrip(".") + ".")
    except PurgeFailed as exc:
        fail(str(exc).rstrip(".") + ".", 1)
    problems = [p for r in results for p in r.problems]
    unanswered = any(not r.namespace for r in results)  # a target that failed: its namespaces are unknown
    missing = sorted(n.hex() for n in selector.namespaces if not any(r.namespace == n for r in results))
    if missing and not unanswered:  # a mistyped digest removed nothing and said only "0 chunks"
        print(f"note: namespace {', '.join(missing)} holds nothing in the targets given; check the digest (a dry "
              "run without --namespace lists the namespaces there).", file=sys.stderr)
    if as_json:
        print(json.dumps({
            "dry_run": dry_run,
            "namespaces": [{"tier": r.tier, "namespace": r.namespace.hex(), "chunks": r.chunks, "bytes": r.bytes,
                            "unknown_tenant": r.unknown_tenant, "damaged_tenant": r.damaged_tenant,
                            "problems": r.problems} for r in results],
            "total": {"chunks": sum(r.chunks for r in results), "bytes": sum(r.bytes for r in results),
                      "unknown_tenant": sum(r.unknown_tenant for r in results),
                      "damaged_tenant": sum(r.damaged_tenant for r in results)},
        }, indent=2))
    else:
        _print_table(results, dry_run, selector.needs_tenant)
    if problems:
        raise typer.Exit(1)


PROBLEM_LINES = 5
"""Problems printed one per line in the table output; the rest are counted on one line."""


def _print_table(results: list[Any], dry_run: bool, tenant: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    verb = "would remove" if dry_run else "removed"
    table = Table(title=f"kvtier purge{' (dry run)' if dry_run else ''}")
    table.add_column("tier")
    table.add_column("namespace", no_wrap=True, min_width=32)  # copied into --namespace: never cut
    table.add_column(f"chunks {verb}", justify="right")
    table.add_column("bytes", justify="right")
    if tenant:
        table.add_column("unknown tenant (kept)", justify="right")
    for r in results:
        row = [r.tier, r.namespace.hex() or "-", f"{r.chunks:,}", f"{r.bytes:,}"]
        table.add_row(*row, *([f"{r.unknown_tenant:,}"] if tenant else []))
    console.print(table)
    chunks, size = sum(r.chunks for r in results), sum(r.bytes for r in results)
    console.print(f"{'Would remove' if dry_run else 'Removed'} {chunks:,} chunks, {size:,} bytes "
                  f"({size / 2**30:.3f} GiB) in {sum(1 for r in results if r.namespace)} namespaces.")
    unknown = sum(r.unknown_tenant for r in results)
    if unknown:
        console.print(f"Kept {unknown:,} chunks whose tenant is unknown (saved before tenant records, or by a store "
                      "not told its tenant): --salt and --lora never match them; use --namespace or --older-than to "
                      "remove them.")
    damaged = sum(r.damaged_tenant for r in results)
    if damaged:
        console.print(f"Kept {damaged:,} chunks whose tenant record fails its check (never trusted; named below): "
                      "use --namespace or --older-than to remove them.")
    problems = [(r, p) for r in results for p in r.problems][:PROBLEM_LINES]
    for r, p in problems:
        console.print(f"[yellow]problem[/yellow] {r.tier}{' ' + r.namespace.hex() if r.namespace else ''}: {p}",
                      soft_wrap=True)
    count = sum(max(r.problem_count, len(r.problems)) for r in results)
    if count > len(problems):  # a read-only disk tier has one per chunk: hundreds
        console.print(f"[yellow]problem[/yellow] ... and {count - len(problems):,} more ({count:,} problems in all; "
                      "--json names the first 5 of each namespace).", soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``kvtier purge`` to the CLI."""
    app.command("purge", help=HELP)(purge_command)
