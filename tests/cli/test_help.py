"""``--help`` of every command through the real CLI: plain on/off flags show no ``<bool>`` type."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import typer

from kvtier.cli.main import app


def _command_paths() -> list[list[str]]:
    paths: list[list[str]] = [[]]
    root = typer.main.get_command(app)
    for name, command in getattr(root, "commands", {}).items():
        paths.append([name])
        paths.extend([name, sub] for sub in getattr(command, "commands", {}))
    return paths


@pytest.mark.parametrize("path", _command_paths(), ids=lambda p: " ".join(p) or "kvtier")
def test_help_shows_no_bool_type(path):
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", *path, "--help"], capture_output=True, text=True,
                          check=False, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    assert "--help" in proc.stdout and "<bool>" not in proc.stdout


def test_version_prints_the_installed_package_version():
    """``kvtier --version``: the version of the installed distribution (importlib.metadata), exit 0."""
    from importlib.metadata import version

    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "--version"], capture_output=True, text=True,
                          check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"kvtier {version('kvtier')}"


def test_every_kvtier_demo_command_in_the_docs_uses_only_options_demo_has():
    """docs/benchmarks.md gave `kvtier demo --geometry mid`; demo has no --geometry (its options: --help)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    demo = typer.main.get_command(app).commands["demo"]  # type: ignore[attr-defined]
    known = {opt for param in demo.params for opt in (*param.opts, *param.secondary_opts)}
    found = 0
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for command in re.findall(r"kvtier demo((?: +--?[\w-]+(?:[ =][^\s`|)-][^\s`|)]*)?)*)", doc.read_text()):
            found += 1
            flags = re.findall(r"(--?[\w-]+)", command)
            assert set(flags) <= known, (doc.name, command, sorted(known))
    assert found > 0


def test_check_offline_names_every_shared_tier_it_skips(tmp_path):
    """``kvtier check --offline`` skips the node pool's probe too, but its help named only redis_url and
    s3_bucket (fresh-user tester): the help names the key of every registered shared tier, each of which
    a real ``--offline`` run leaves unprobed."""
    from typer.testing import CliRunner

    from kvtier.core.tiers.registry import specs

    root = typer.main.get_command(app)
    offline = next(p for p in root.commands["check"].params if "--offline" in getattr(p, "opts", ()))
    shared = [s for s in specs() if s.shared]
    assert {s.name for s in shared} >= {"node", "redis", "s3"}
    assert [s.keys[0] for s in shared if s.keys[0] not in offline.help] == []
    extra = {"cpu_gib": 0.25, "node_socket": str(tmp_path / "node.sock"), "redis_url": "redis://127.0.0.1:1/0"}
    config = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    result = CliRunner().invoke(app, ["check", "--offline", json.dumps(config)])
    assert result.exit_code == 0 and "unreachable" not in result.output, result.output


def _options_by_command() -> dict[tuple[str, ...], set[str]]:
    """``(command[, subcommand]) → its option names`` (``--help`` included), from the real CLI."""
    root = typer.main.get_command(app)
    found: dict[tuple[str, ...], set[str]] = {}
    for name, command in getattr(root, "commands", {}).items():
        for path, cmd in [((name,), command), *(((name, s), c) for s, c in getattr(command, "commands", {}).items())]:
            found[path] = {"--help", *(o for p in cmd.params for o in (*p.opts, *p.secondary_opts))}
    return found


def test_every_kvtier_command_in_the_docs_uses_only_options_it_has():
    """Every ``--flag`` written after ``kvtier CMD [SUB]`` on one line of the README or a page of
    docs/ (``\\`` continuations joined; up to a backtick, ``|``, ``)``, ``;``, ``,``, ``#``, ``<`` or a
    quote, so prose and table cells end the command) is an option of that command: a renamed or
    removed option fails here, not in an operator's shell."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    options = _options_by_command()
    checked, wrong = 0, []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = re.sub(r"\\\n\s*", " ", doc.read_text())
        for m in re.finditer(r"kvtier ([a-z][\w-]*)(?: ([a-z][\w-]*))?([^`\n|);,#<'\"]*)", text):
            path = (m.group(1), m.group(2)) if (m.group(1), m.group(2)) in options else (m.group(1),)
            if path not in options:
                continue
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(3)):
                checked += 1
                if flag not in options[path]:
                    wrong.append(f"{doc.name}: kvtier {' '.join(path)} {flag}  ({m.group(0)[:100]})")
    assert not wrong, "\n".join(wrong)
    assert checked > 300  # the pages show about 400 such flags: the pattern still finds them
