"""``kvtier purge``: remove stored KV chunks by namespace, tenant (cache_salt, LoRA) or age from a
disk tier's directory, a Redis/Valkey server and/or an S3 bucket, offline or under a live engine
(the verbs: :mod:`kvtier.core.purge`; each tier's flags: its settings model, :mod:`kvtier.core.toolflags`)."""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable
from typing import Any

import typer

from kvtier.cli.errors import fail, flag_names
from kvtier.cli.tierflags import refuse_stray
from kvtier.core.errors import UserError
from kvtier.core.toolflags import ToolFlag, tool_flags

HELP = """Remove stored KV chunks from a disk tier's directory (--disk-path), a Redis/Valkey server or Cluster (--redis-url) and/or an S3 bucket (--s3-bucket, with --s3-endpoint-url for MinIO, Ceph RGW or R2; credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or --s3-credentials-file), selected by namespace, cache_salt, LoRA adapter or age. Safe under a live engine: a purged chunk is never served (the engine reads it as a miss and recomputes); a live engine may still report it as a hit for a bounded time (docs/purge.md).

Selectors (a chunk must match every one given): --namespace HEX (repeatable; the 32-hex-digit directory names under disk_path; a dry run lists them), --older-than DURATION (written more than that long ago: a file's modification time on disk; an object's Last-Modified on S3; redis_ttl_s minus the key's remaining PTTL on Redis, so give --redis-ttl-s if the engines do not use the default), --salt SALT (the requests' cache_salt), --lora NAME (the LoRA adapter's name), --key-id HEX (values encrypted under that master key: after a rotation, what only the old key opens; read without any key). --salt and --lora match only chunks saved with a tenant record (kvtier from this version on; disk files, Redis values and S3 objects alike): older chunks are left alone and counted as "unknown tenant", and a chunk whose record fails its check is left alone and named as a problem. Without any selector, purge refuses unless --all is given.

--dry-run prints what would go (chunks and bytes per tier and namespace) and removes nothing; without it the same numbers are what was removed. --json prints them as JSON. Exit code 0 when done, 1 when some chunk could not be read or removed or a server did not answer, 2 on bad input.

A purge reaches storage outside the engines (files, Redis keys): a live engine's cpu tier and vLLM's own GPU prefix cache keep what they hold until evicted (POST /reset_prefix_cache?reset_external=true clears them, for every tenant, on a server started with VLLM_SERVER_DEV_MODE=1).

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


def _refuse_stray_flags(flags: list[ToolFlag], given: dict[str, Any]) -> None:
    """A tier's flags without its target were ignored (only the other targets purged, as if this
    tier's had been too): refuse them, naming the target to add (:func:`kvtier.cli.tierflags.refuse_stray`)."""
    refuse_stray(flags, given, "({target})", "to purge only the other targets.")


def _purge(disk_path: str | None, namespace: list[str], older_than: str | None, salt: str | None, lora: str | None,
           key_id: str | None, purge_all: bool, dry_run: bool, as_json: bool, flags: list[ToolFlag],
           given: dict[str, Any]) -> None:
    from kvtier.core.purge import (
        PurgeFailed,
        PurgeSelector,
        parse_duration,
        parse_key_id,
        parse_namespace,
        purge,
    )

    _refuse_stray_flags(flags, given)
    targets = [f for f in flags if f.target]
    if disk_path is None and all(given.get(f.key) is None for f in targets):
        named = ["--disk-path DIR (the disk tier's directory)", *(f"{f.flag} {f.metavar or 'VALUE'}" for f in targets)]
        fail(f"give a target to purge: {', '.join(named[:-1])} and/or {named[-1]}." if len(named) > 1
             else f"give a target to purge: {named[0]}.")
    if disk_path is not None and not disk_path.strip():
        fail("--disk-path is empty; give the disk tier's directory (its disk_path).")
    for f in targets:
        value = given.get(f.key)
        if isinstance(value, str) and not value.strip():
            fail(f"{f.flag} is empty; {f.empty or 'give the value the engines use'}.")
    if salt is not None and salt == "":
        fail("--salt is empty; give the cache_salt the requests carried.")
    if lora is not None and lora == "":
        fail("--lora is empty; give the LoRA adapter's name as served (--lora-modules NAME=PATH).")
    try:
        selector = PurgeSelector(
            namespaces=frozenset(parse_namespace(n) for n in namespace),
            older_than_s=None if older_than is None else parse_duration(older_than),
            cache_salt=salt, lora_name=lora, key_id=None if key_id is None else parse_key_id(key_id))
    except UserError as exc:
        fail(str(exc).rstrip(".") + ".")
    if purge_all and selector.selects_anything:
        chosen = [flag for flag, value in (("--namespace", namespace), ("--older-than", older_than), ("--salt", salt),
                                           ("--lora", lora), ("--key-id", key_id)) if value]
        fail(f"--all removes every chunk, which contradicts {', '.join(chosen)}; drop --all to remove only the "
             "chunks the selectors name, or drop the selectors to remove everything.")
    if not selector.selects_anything and not purge_all:
        fail("no selector given, which would remove every chunk; add --namespace, --older-than, --salt, --lora or "
             "--key-id, "
             "or pass --all to remove everything.")
    config, keys = _config(disk_path, given)
    try:
        # only the targets named on the command line: a KVTIER_* variable must not add one
        results = purge(config, selector, dry_run, keys)
    except UserError as exc:
        fail(flag_names(str(exc), [*given, "disk_path"]).rstrip(".") + ".")
    except PurgeFailed as exc:
        fail(str(exc).rstrip(".") + ".", 1)
    problems = [p for r in results for p in r.problems]
    notes = [f"note: {r.tier}: {r.note}." for r in results if r.note]  # a shared store with no kvtier value at all
    results = [r for r in results if not r.note]
    unanswered = any(not r.namespace for r in results)  # a target that failed: its namespaces are unknown
    missing = sorted(n.hex() for n in selector.namespaces if not any(r.namespace == n for r in results))
    if missing and not unanswered:  # a mistyped digest removed nothing and said only "0 chunks"
        print(f"note: namespace {', '.join(missing)} holds nothing in the targets given; check the digest (a dry "
              "run without --namespace lists the namespaces there).", file=sys.stderr)
    if as_json:
        print(json.dumps({
            "dry_run": dry_run,
            "notes": [n.removeprefix("note: ") for n in notes],
            "namespaces": [{"tier": r.tier, "namespace": r.namespace.hex(), "chunks": r.chunks, "bytes": r.bytes,
                            "unknown_tenant": r.unknown_tenant, "damaged_tenant": r.damaged_tenant,
                            "problems": r.problems} for r in results],
            "total": {"chunks": sum(r.chunks for r in results), "bytes": sum(r.bytes for r in results),
                      "unknown_tenant": sum(r.unknown_tenant for r in results),
                      "damaged_tenant": sum(r.damaged_tenant for r in results)},
        }, indent=2))
    else:
        _print_table(results, dry_run, selector.needs_tenant)
    for note in notes:
        print(note, file=sys.stderr)
    if problems:
        raise typer.Exit(1)


PROBLEM_LINES = 5
"""Problems printed one per line in the table output; the rest are counted on one line."""


def _print_table(results: list[Any], dry_run: bool, tenant: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
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
    reached = [r for r in results if r.namespace]  # one with no namespace did not answer: nothing to count
    for r in results:
        row = [r.tier, r.namespace.hex(), f"{r.chunks:,}", f"{r.bytes:,}"] if r.namespace else \
            [r.tier, "-", "not reached", "-"]
        table.add_row(*row, *([f"{r.unknown_tenant:,}" if r.namespace else "-"] if tenant else []))
    console.print(table)
    if reached or not results:  # no summary of "0 chunks" for a tier that was not reached
        chunks, size = sum(r.chunks for r in reached), sum(r.bytes for r in reached)
        console.print(f"{'Would remove' if dry_run else 'Removed'} {chunks:,} chunks, {size:,} bytes "
                      f"({size / 2**30:.3f} GiB) in {len(reached)} namespaces"
                      f"{' of the tiers reached' if len(reached) < len(results) else ''}.")
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
        console.print(f"[yellow]problem[/yellow] {r.tier}{' ' + r.namespace.hex() if r.namespace else ''}: {escape(p)}",
                      soft_wrap=True)
    count = sum(max(r.problem_count, len(r.problems)) for r in results)
    if count > len(problems):  # a read-only disk tier has one per chunk: hundreds
        console.print(f"[yellow]problem[/yellow] ... and {count - len(problems):,} more ({count:,} problems in all; "
                      "--json names the first 5 of each namespace).", soft_wrap=True)


def purge_command(flags: list[ToolFlag]) -> Callable[..., None]:
    """The ``kvtier purge`` command: the fixed options and selectors, and one option per tier flag
    in ``flags`` (a Typer command built from a signature; values not given are ``None``)."""

    def command(**values: Any) -> None:
        given = {f.key: (values.pop(f.key) or None) if f.kind is bool else values.pop(f.key) for f in flags}
        _purge(flags=flags, given=given, **values)

    fixed = {
        "disk_path": (str | None, typer.Option(None, "--disk-path", metavar="DIR",
                                               help="The disk tier's directory (its disk_path).")),
    }
    selectors = {
        "namespace": (list[str], typer.Option([], "--namespace", metavar="HEX",
                                              help="Namespace digest, 32 hex digits (repeatable).")),
        "older_than": (str | None, typer.Option(None, "--older-than", metavar="DURATION",
                                                help="Only chunks written longer ago: 90s, 30m, 12h, 7d, 2w.")),
        "salt": (str | None, typer.Option(None, "--salt", metavar="SALT",
                                          help="Only chunks saved for requests with this cache_salt.")),
        "lora": (str | None, typer.Option(None, "--lora", metavar="NAME",
                                          help="Only chunks saved for this LoRA adapter (its name).")),
        "key_id": (str | None, typer.Option(None, "--key-id", metavar="HEX", help=(
            "Only values encrypted under this master key id (8 hex digits; kvtier check prints the ids): "
            "what only an old key opens, after a rotation."))),
        "purge_all": (bool, typer.Option(False, "--all", help="Allow a purge with no selector (every chunk).")),
        "dry_run": (bool, typer.Option(False, "--dry-run", help="Show what would be removed; remove nothing.")),
        "as_json": (bool, typer.Option(False, "--json", help="Print JSON instead of a table.")),
    }
    tier_options: dict[str, tuple[Any, Any]] = {}
    for f in flags:
        if f.kind is bool:
            tier_options[f.key] = (bool, typer.Option(False, f.flag, help=f.help))
        else:
            tier_options[f.key] = (f.kind | None, typer.Option(None, f.flag, metavar=f.metavar, help=f.help))
    params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
              for name, (annotation, default) in {**fixed, **tier_options, **selectors}.items()]
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def register(app: typer.Typer) -> None:
    """Add ``kvtier purge`` to the CLI: its tier flags come from the tiers' settings models
    (:func:`kvtier.core.toolflags.tool_flags`, the fields marked for ``purge``), so a new tier
    needs no edit here."""
    app.command("purge", help=HELP)(purge_command(tool_flags("purge")))
