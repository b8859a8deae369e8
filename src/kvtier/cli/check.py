"""``kvtier check``: validate a ``--kv-transfer-config`` for KVTierConnector without starting vLLM."""

from __future__ import annotations

import json
import sys

import typer

from kvtier.cli.errors import fail
from kvtier.core.errors import ConfigError

HELP = """Check a --kv-transfer-config for KVTierConnector in under a second, without starting vLLM.

Runs the connector's own validator (the same checks it applies at engine start-up, after the model has loaded) and vLLM's transfer-config rules: unknown keys (with the closest known key), bad values, the disk tier path (exists or can be created, writable, enough free space, not a kernel filesystem such as /proc), cpu_gib against the memory this host has, the Redis password and shared_secret_file when redis_url is set, then each configured shared tier itself (Redis: connect and PING; S3: a LIST of at most one key; within 2 s, never a write: one line saying reachable, unreachable or auth failed, a warning unless reachable; --offline skips it), chunk_tokens against --block-size (without it, a warning when it is not a multiple of vLLM's default block sizes, 16 and 128 on CPU; auto, the default, always fits), kv_connector_module_path, kv_role, kv_load_failure_policy, and the installed vLLM against the releases kvtier supports (printed last; docs/vllm.md). Exit code 0 when it would start, 1 when it has errors, 2 when the input cannot be read (no such file, or not a JSON object).

CONFIG is the JSON itself, a file holding it, or - for stdin. To check a whole serve command line, use `kvtier audit` (it runs the same checks).

Examples:

  kvtier check '{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier.integrations.vllm","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"cpu_gib":4}}'

  kvtier check kv-transfer.json --block-size 16 --json
"""


def _read(config: str) -> str:
    """The JSON text: ``config`` itself when it looks like JSON, else the file it names (``-``: stdin)."""
    if config.lstrip().startswith(("{", "[")):  # inline JSON; not an object is named by the parser
        return config
    try:
        if config == "-":
            if sys.stdin is None or sys.stdin.closed:  # `kvtier check - <&-`
                fail("standard input is closed; pipe the JSON in, or give it or a file holding it.")
            return sys.stdin.read(1 << 20)
        with open(config, encoding="utf-8") as handle:
            return handle.read(1 << 20)
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read {config!r} ({exc.__class__.__name__}); give the JSON itself, a file holding it, or -.")


def check_command(
    config: str = typer.Argument(..., help="The --kv-transfer-config JSON, a file holding it, or - for stdin."),
    block_size: int | None = typer.Option(None, "--block-size", help="The server's --block-size, tokens."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
    offline: bool = typer.Option(False, "--offline", help="Do not probe the shared tiers (redis_url, s3_bucket)."),
) -> None:
    from kvtier.integrations.vllm.compat import SUPPORTED_RANGE, installed_vllm, statement, unsupported_reason
    from kvtier.integrations.vllm.preflight import (
        Problem,
        check_transfer_config,
        parse_transfer_config,
        probe_shared_tiers,
        uses_kvtier,
    )

    if block_size is not None and block_size < 1:
        fail(f"--block-size must be at least 1, got {block_size}.")
    text = _read(config)
    if not config.lstrip().startswith(("{", "[")):  # a file or stdin: no shell quoting to blame
        source = "standard input" if config == "-" else repr(config)
        if not text.strip():
            fail(f"{source} is empty; it must hold the --kv-transfer-config JSON object.")
        try:
            json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
            fail(f"{source} is not valid JSON{where}; check its braces, commas and quotes.")
    try:
        transfer = parse_transfer_config(text)
    except ConfigError as exc:  # not JSON, or not an object: the input cannot be read (exit 2, as documented)
        fail(str(exc))
    problems = check_transfer_config(transfer, block_size)
    installed = installed_vllm()  # the connector refuses a vLLM outside SUPPORTED_VLLM at start-up
    if installed is not None and (reason := unsupported_reason(installed)) is not None:
        problems.append(Problem("error", "", reason))
    probes = [] if offline else probe_shared_tiers(transfer)
    problems += [p.problem for p in probes if p.problem is not None]
    names_kvtier = False
    if not problems:
        names_kvtier = uses_kvtier(transfer)
    errors = [p for p in problems if p.severity == "error"]
    if as_json:
        print(json.dumps({"ok": not errors and (names_kvtier or bool(problems)),
                          "supported_vllm": SUPPORTED_RANGE, "installed_vllm": installed,
                          "problems": [{"severity": p.severity, "key": p.key, "message": p.message}
                                       for p in problems],
                          "shared_tier": [{"key": p.key, "state": p.result.state, "url": p.result.url,
                                           "detail": p.result.detail} for p in probes]}, indent=2))
    else:
        for p in problems:
            print(f"{p.severity}: {p.key + ': ' if p.key else ''}{p.message}")
        for probe in probes:
            if probe.problem is None:
                print(f"ok: {probe.key}: {probe.result.message}")
    if not problems and not names_kvtier:
        fail('the config does not name KVTierConnector ("kv_connector":"KVTierConnector"); nothing to check.', 1)
    if not as_json:
        print(f"info: {statement()}")
    if errors:
        raise typer.Exit(1)
    if not as_json:
        warned = len(problems)
        print(f"ok: vLLM would start with this KVTierConnector config{f' ({warned} warning(s))' if warned else ''}.")


def register(app: typer.Typer) -> None:
    """Add ``kvtier check`` to the CLI."""
    app.command("check", help=HELP)(check_command)
