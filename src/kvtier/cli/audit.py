"""``kvtier audit``: check a vLLM serve command, env file or Kubernetes manifest for KV-cache mistakes."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import typer

from kvtier.cli.errors import fail
from kvtier.core.errors import UserError

HELP = """Audit a vLLM KV-cache configuration against version gates, pitfalls and known bugs.

Reads a `vllm serve ...` command line or script (every server it starts; or a `docker run` line), an env file (KEY=VALUE lines), a Docker Compose file (each vLLM service), a Kubernetes manifest (Deployment/StatefulSet/Pod YAML, multi-document) or a kustomize directory (rendered with `kustomize build` or `kubectl kustomize` when either is on PATH; else its resources read with namespace, images and strategic-merge patches applied; audited together) from FILE or stdin (`-`). The vLLM version comes from --vllm-version or the image tag. Each finding names its rule, severity, the fix and its source. Exit code 1 when any error is found, 2 on unreadable input.

Examples:

  kvtier audit serve.sh --vllm-version 0.32.0

  echo 'vllm serve Qwen/Qwen3-8B --cpu-offload-gb 40' | kvtier audit -

  kvtier audit deploy.yaml --format sarif > kvtier-audit.sarif

  kvtier audit --rules-markdown > docs/audit-rules.md
"""


MAX_INPUT_BYTES = 16 << 20
"""Largest input read (bytes): serve scripts and manifests are KiB; this bounds a regular file that is not one."""


def _read_input(file: str) -> tuple[str, str]:
    """The text of ``file`` (``-``: stdin) and its name for messages.

    Raises:
        UserError: closed stdin, unreadable file, a device, socket or kernel file (:func:`_read_path`),
            input over MAX_INPUT_BYTES, or not UTF-8 text.
    """
    origin = "<stdin>" if file == "-" else file
    if file != "-":
        from kvtier.audit.kustomize import kustomization_file, read_kustomization

        if kustomization_file(Path(file)) is not None or Path(file).is_dir():
            return read_kustomization(Path(file), MAX_INPUT_BYTES), origin
    try:
        if file == "-":
            if sys.stdin is None or sys.stdin.closed:
                raise UserError("stdin is closed; pass a FILE or pipe the configuration into `kvtier audit -`.")
            data = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1)
        else:
            data = _read_path(Path(file), origin)
    except UserError:
        raise
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {origin} ({exc.__class__.__name__}); check the path.") from None
    if len(data) > MAX_INPUT_BYTES:
        raise UserError(f"{origin} is larger than {MAX_INPUT_BYTES >> 20} MiB; give the serve command or manifest itself.")
    try:
        return data.decode("utf-8"), origin
    except UnicodeDecodeError:
        raise UserError(f"{origin} is not text (not UTF-8); give a command line, env file or manifest.") from None


def _read_path(path: Path, origin: str) -> bytes:
    """At most ``MAX_INPUT_BYTES + 1`` bytes of ``path``: a regular file, or a pipe (``<(cmd)``,
    ``/dev/stdin`` fed by a pipe; a named pipe nobody writes to reads as empty instead of blocking).

    Raises:
        UserError: a device, a socket, or a file of a kernel filesystem (``/proc/kmsg`` blocks a read
            forever): nothing a serve command or manifest is.
        OSError: the path cannot be read.
    """
    from kvtier.core.tiers.disk.check import pseudo_filesystem

    mode = path.stat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)) or (stat.S_ISREG(mode) and pseudo_filesystem(path)):
        raise UserError(f"{origin} is not a file of text (a device, a socket or a kernel file such as /proc/kmsg can "
                        "block forever); give a file, or pipe the text into `kvtier audit -`.")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a pipe with no writer yet opens at once
    try:
        os.set_blocking(fd, True)  # then reads wait for the writer's text; none: end of file at once
        with os.fdopen(fd, "rb") as handle:
            fd = -1
            return handle.read(MAX_INPUT_BYTES + 1)
    finally:
        if fd >= 0:
            os.close(fd)


def audit_command(
    file: str = typer.Argument("-", help="File to audit, or - for stdin."),
    vllm_version: str | None = typer.Option(None, "--vllm-version", help="vLLM version X.Y.Z (default: image tag)."),
    output_format: str = typer.Option("text", "--format", "-f", help="text, json or sarif."),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU the servers run on (H100, H200, B200, ...: kvtier size's "
                                   "names), so the engine's KV cache can be computed from the model, TP and "
                                   "--gpu-memory-utilization."),
    rules_markdown: bool = typer.Option(False, "--rules-markdown", help="Print the rule table as Markdown and exit."),
) -> None:
    from kvtier.audit.engine import audit, has_errors
    from kvtier.audit.loader import load_configs
    from kvtier.audit.report import print_text, to_json, to_sarif
    from kvtier.audit.report import rules_markdown as markdown
    from kvtier.audit.versions import parse_version

    if rules_markdown:
        sys.stdout.write(markdown())
        return
    if output_format not in ("text", "json", "sarif"):
        fail(f"--format {output_format!r} is not one of text, json, sarif.")
    try:
        version = parse_version(vllm_version) if vllm_version is not None else None
        from kvtier.size.hardware import GPUS, find_gpu

        found = find_gpu(gpu) if gpu is not None else None
        if gpu is not None and found is None:
            raise UserError(f"--gpu {gpu!r} is not known; use one of {', '.join(g.name for g in GPUS)}.")
        text, origin = _read_input(file)
        configs = load_configs(text, origin, version)
        for config in configs:
            config.gpu = found.name if found is not None else None
    except UserError as exc:
        fail(str(exc))
    findings = audit(configs)
    if output_format == "json":
        print(to_json(findings))
    elif output_format == "sarif":
        print(to_sarif(findings, origin if origin != "<stdin>" else "stdin"))
    else:
        print_text(findings, [c.origin for c in configs])
        if any(c.uses("KVTierConnector") for c in configs):
            from kvtier.integrations.vllm.compat import statement

            print(f"info: {statement()}")
    if has_errors(findings):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``kvtier audit`` to the CLI."""
    app.command("audit", help=HELP)(audit_command)
