"""``kvtier check``: validate a ``--kv-transfer-config`` for KVTierConnector without starting vLLM."""

from __future__ import annotations

import errno
import json
import re
import sys
from typing import TYPE_CHECKING, Any

import typer

from kvtier.cli.errors import fail
from kvtier.core.errors import ConfigError, UserError
from kvtier.tools.inputfile import not_a_regular_file

if TYPE_CHECKING:
    from kvtier.integrations.vllm.preflight import Problem

HELP = """Check a --kv-transfer-config for KVTierConnector in under a second, without starting vLLM.

Runs the connector's own validator (the same checks it applies at engine start-up, after the model has loaded) and vLLM's transfer-config rules: unknown keys (with the closest known key), bad values, the disk tier path (exists or can be created, writable, enough free space, not a kernel filesystem such as /proc), cpu_gib against the memory this host has, the client package of each configured shared tier (redis, obstore), the Redis password and shared_secret_file when redis_url is set, the codec chains and the encryption master key files or variables (read as start-up reads them; only key ids are printed), then each configured shared tier itself (Redis: connect, PING and, without redis_cluster, INFO cluster; S3: a LIST of at most one key; the node pool: its owner's STATS; within 2 s, never a write: one line saying reachable, unreachable, auth failed, no bucket or wrong mode (a Redis Cluster node named without redis_cluster), a warning unless reachable, an error with --strict; --offline skips it), chunk_tokens against --block-size (without it, a warning when it is not a multiple of vLLM's default block sizes, 16 and 128 on CPU; auto, the default, always fits), kv_connector_module_path, kv_role, kv_load_failure_policy, and the installed vLLM against the releases kvtier supports (printed last; docs/vllm.md). Exit code 0 when it would start, 1 when it has errors (with --strict, also when a configured tier cannot be reached), 2 when the input cannot be read (no such file, or not a JSON object) or names no KVTierConnector.

CONFIG is the JSON itself, a file holding it, or - for stdin. To check a whole serve command line, use `kvtier audit` (it runs the same config checks, statically: not the serving host's disk_path, memory or shared tiers).

Examples:

  kvtier check '{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier.integrations.vllm","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"cpu_gib":4}}'

  kvtier check kv-transfer.json --block-size 16 --json

  kvtier check --strict kv-transfer.json   # CI: fail when Redis or the S3 endpoint cannot be reached
"""


_SERVE_LINE = re.compile(r"^\s*(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:exec\s+)?(?:\S*/)?(?:vllm|python3?)(?:\s|$)")
"""A shell line starting vLLM: ``vllm serve ...``, ``VAR=x vllm ...``, ``python -m vllm...``, ``exec vllm ...``."""


def _serve_line(text: str) -> bool:
    """Whether ``text`` looks like a serve command line (its ``#`` comment and shebang lines aside)
    rather than the ``--kv-transfer-config`` JSON."""
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return _FLAG_WITH_VALUE.search(text) is not None or any(_SERVE_LINE.match(line) for line in lines)


_FLAG_WITH_VALUE = re.compile(r"(?:^|\s)--kv-transfer-config(?:=|\s+)[\"'{$]")
"""The flag given a value (quoted JSON, ``{``, or a shell variable) as on a serve line; the flag's
name in prose (a placeholder such as ``<the --kv-transfer-config JSON>``) is not a serve line."""


def _not_a_serve_line(text: str, source: str) -> None:
    """Exit 2 with one sentence when ``text`` (from ``source``) is a serve command line."""
    if _serve_line(text):
        fail(f"{source} is a vLLM serve command line, but kvtier check takes only the --kv-transfer-config JSON (that "
             "flag's value); give that, or run kvtier audit on the whole serve line (a file holding it, or -).")


def _read(config: str) -> str:
    """The JSON text: ``config`` itself when it looks like JSON, else the file it names (``-``: stdin)."""
    if config.lstrip().startswith(("{", "[")):  # inline JSON; not an object is named by the parser
        return config
    if config != "-" and (kind := not_a_regular_file(config)) is not None:  # stat before open: a FIFO would hang
        fail(f"{config!r} {kind}; give the JSON itself, a file holding it, or - for standard input.")
    try:
        if config == "-":
            if sys.stdin is None or sys.stdin.closed:  # `kvtier check - <&-`
                fail("standard input is closed; pipe the JSON in, or give it or a file holding it.")
            return sys.stdin.read(1 << 20)
        with open(config, encoding="utf-8") as handle:
            return handle.read(1 << 20)
    except (OSError, UnicodeDecodeError) as exc:
        _not_a_serve_line(config, "the argument")
        if isinstance(exc, FileNotFoundError) or getattr(exc, "errno", None) == errno.ENAMETOOLONG:
            fail(f"{config!r} is neither JSON nor an existing file; give the JSON, a file holding it, or -.")
        fail(f"cannot read {config!r} ({exc.__class__.__name__}); give the JSON itself, a file holding it, or -.")


def check_command(
    config: str = typer.Argument(..., help="The --kv-transfer-config JSON, a file holding it, or - for stdin."),
    block_size: int | None = typer.Option(None, "--block-size", help="The server's --block-size, tokens."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
    offline: bool = typer.Option(False, "--offline", help="Do not probe the shared tiers (redis_url, s3_bucket, node_socket)."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when a configured tier cannot be reached "
                                "(unreachable or auth failed), for CI; without it that is a warning."),
) -> None:
    from kvtier.core.tiers.probe import PROBE_DEADLINE_S
    from kvtier.integrations.vllm.compat import SUPPORTED_RANGE, installed_vllm, statement, unsupported_reason
    from kvtier.integrations.vllm.preflight import (
        Problem,
        check_transfer_config,
        kvtier_entries,
        parse_transfer_config,
        probe_shared_tiers,
        uses_kvtier,
    )
    from kvtier.integrations.vllm.preflight_tiers import node_pool_size_problems

    if strict and offline:
        fail("--strict needs the shared-tier probes that --offline skips; give one of them.")
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
            _not_a_serve_line(text, source)
            where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
            fail(f"{source} is not valid JSON{where}; check its braces, commas and quotes.")
    try:
        transfer = parse_transfer_config(text)
    except ConfigError as exc:  # not JSON, or not an object: the input cannot be read (exit 2, as documented)
        fail(str(exc))
    if not uses_kvtier(transfer):  # a usage error (exit 2), before any probe or verdict
        fail(_not_kvtier(transfer, text))
    problems = check_transfer_config(transfer, block_size) + _duplicate_keys(text, transfer)
    installed = installed_vllm()  # the connector refuses a vLLM outside SUPPORTED_VLLM at start-up
    if installed is not None and (reason := unsupported_reason(installed)) is not None:
        problems.append(Problem("error", "", reason))
    probes = [] if offline else probe_shared_tiers(transfer)
    problems += [] if offline else node_pool_size_problems(kvtier_entries(transfer), PROBE_DEADLINE_S)
    unreached = [p.problem for p in probes if p.problem is not None]
    # --strict: a tier that cannot be reached fails the check (exit 1), as an error of its own key
    problems += [Problem("error", p.key, p.message) for p in unreached] if strict else unreached
    errors = [p for p in problems if p.severity == "error"]
    if as_json:
        ok = not errors
        # the text's last line's first word: a warning that is a refusal on some servers (only_if)
        # qualifies the verdict, as "conditional: ... only if ..." does in text
        verdict = "error" if not ok else "conditional" if any(p.only_if for p in problems) else "ok"
        print(json.dumps({"ok": ok, "verdict": verdict,
                          "supported_vllm": SUPPORTED_RANGE, "installed_vllm": installed,
                          "problems": [{"severity": p.severity, "key": p.key, "message": p.message,
                                        **({"only_if": p.only_if} if p.only_if else {})} for p in problems],
                          "shared_tier": [{"key": p.key, "state": p.result.state, "url": p.result.url,
                                           "detail": p.result.detail} for p in probes]}, indent=2))
    else:
        for p in problems:
            print(f"{p.severity}: {p.key + ': ' if p.key else ''}{p.message}")
        for probe in probes:
            if probe.problem is None:
                print(f"ok: {probe.key}: {probe.result.message}")
    if errors:
        if strict and unreached and not as_json:
            print(f"error: --strict: {len(unreached)} configured tier(s) cannot be reached.")
        raise typer.Exit(1)
    if not as_json:  # the errors above are the whole answer when there are any
        missing = _missing_state_dir(transfer)
        if missing is not None:
            print(f"info: {missing} does not exist yet: kvtier check created nothing; the engine creates it at "
                  "start-up (its nearest existing parent was checked for room and write access).")
        if (keys := _key_ids(transfer)) is not None:
            print(f"info: {keys}")
        print(f"info: {statement()}")
        warned = f" ({len(problems)} warning(s))" if problems else ""
        # a warning that is a refusal on some servers qualifies the verdict: not "would start" outright
        only_if = "; ".join(p.only_if for p in problems if p.only_if)
        print(f"ok: vLLM would start with this KVTierConnector config{warned}." if not only_if else
              f"conditional: vLLM would start with this KVTierConnector config only if {only_if}{warned}; pass "
              "--block-size to check against the server's.")


def _not_kvtier(transfer: dict[str, Any], text: str) -> str:
    """The sentence ``kvtier check`` exits 2 with on a config that names no KVTierConnector (directly or
    as a MultiConnector child): what it names instead, and what to give."""
    named = transfer.get("kv_connector")
    twice = any(p.key == "kv_connector" for p in _duplicate_keys(text, transfer))
    what = "names no kv_connector" if named is None else (
        f"names kv_connector {json.dumps(named)}" + (" (it is given twice and vLLM keeps the last)" if twice else "")
        + (" with no KVTierConnector among its connectors" if named == "MultiConnector" else ", not KVTierConnector"))
    return (f"the config {what}, so kvtier check has nothing to check; give a config "
            'with "kv_connector":"KVTierConnector" (directly or among a MultiConnector\'s connectors), or check '
            "another connector's serve line with kvtier audit.")


def _duplicate_keys(text: str, transfer: dict[str, Any]) -> list[Problem]:
    """A warning for each key given twice in one JSON object of ``text``: vLLM's ``json.loads`` keeps
    the last value and drops the other without a word (``{"cpu_gib": 1, "cpu_gib": 64}`` serves 64)."""
    from kvtier.integrations.vllm.preflight import Problem

    twice: list[tuple[str, object, object]] = []

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                twice.append((key, seen[key], value))
            seen[key] = value
        return seen

    json.loads(text, object_pairs_hook=pairs_hook)  # parsed already: cannot fail here
    extra = transfer.get("kv_connector_extra_config")
    problems = []
    for key, first, last in twice:
        dotted = f"kv_connector_extra_config.{key}" if isinstance(extra, dict) and key in extra else key
        problems.append(Problem("warning", dotted, (
            f"{key!r} is given twice ({json.dumps(first)}, then {json.dumps(last)}); vLLM keeps the last, "
            f"{json.dumps(last)}, and ignores the other without a word; remove the one you did not mean")))
    return problems


def _missing_state_dir(transfer: object) -> str | None:
    """The configured tiers' directory (``disk_path``: :func:`kvtier.core.tiers.factory.state_dir`)
    when it does not exist yet, else ``None`` (also when the config does not load: its errors are reported)."""
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.factory import state_dir

    extra = transfer.get("kv_connector_extra_config") if isinstance(transfer, dict) else None
    try:
        found = state_dir(KVTierConfig.from_dict(extra if isinstance(extra, dict) else {}))
    except (UserError, ValueError):
        return None
    return None if found is None or found.exists() else str(found)


def _key_ids(transfer: object) -> str | None:
    """What the configured master keys are, by id only (docs/security.md), or ``None`` without encryption."""
    from kvtier.core.codecsettings import load_keyring
    from kvtier.core.config import KVTierConfig

    extra = transfer.get("kv_connector_extra_config") if isinstance(transfer, dict) else None
    try:
        ring = load_keyring(KVTierConfig.from_dict(extra if isinstance(extra, dict) else {}).encryption)
    except (UserError, ValueError):
        return None
    if ring is None:
        return None
    older = [i for i in ring.hex_ids if i != ring.current.hex_id]
    return (f"encryption: master key {ring.current.hex_id} seals new values"
            + (f"; {', '.join(older)} still open older ones (kvtier purge --key-id removes them)" if older else ""))


def register(app: typer.Typer) -> None:
    """Add ``kvtier check`` to the CLI."""
    app.command("check", help=HELP)(check_command)
