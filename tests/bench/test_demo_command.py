"""``kvtier demo``'s restart server, without starting it: the line the demo prints as "equivalent to
`vllm serve`" is the one it runs, environment included, and it passes ``kvtier audit``'s shutdown rules
(fresh-user tester: the demo ran with vLLM's 5 s worker shutdown timeout, and ``kvtier audit`` of the
printed line warned ``kvtier-worker-shutdown-timeout-short``)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from typer.testing import CliRunner

from kvtier.bench.demo import demo_kvtier_config, restart_command, restart_spec
from kvtier.cli.main import app

SHUTDOWN_RULES = {"kvtier-worker-shutdown-timeout-short", "kvtier-no-shutdown-timeout", "kvtier-grace-period-too-short"}


def _audit(line: str) -> list[dict[str, str]]:
    result = CliRunner().invoke(app, ["audit", "-", "--vllm-version", "0.32.0", "--format", "json"], input=line + "\n")
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)["findings"]


def test_the_restart_server_runs_with_a_worker_shutdown_timeout_the_audit_accepts(tmp_path: Path):
    spec = restart_spec(tmp_path, demo_kvtier_config(tmp_path / "disk"))
    env = spec.environment()
    line = shlex.join([*(f"{k}={v}" for k, v in env.items()), *spec.argv(8000)])
    assert [f["rule"] for f in _audit(line) if f["rule"] in SHUTDOWN_RULES] == []


def test_the_printed_command_carries_the_environment_the_server_gets(tmp_path: Path):
    spec = restart_spec(tmp_path, demo_kvtier_config(tmp_path / "disk"))
    command = restart_command(spec)
    words = [f"{k}={v}" for k, v in spec.environment().items()]
    assert words and command[:len(words)] == words and command[len(words):] == spec.argv(8000)
    assert "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=35" in command and "--shutdown-timeout" in command
    assert [f["rule"] for f in _audit(shlex.join(command)) if f["rule"] in SHUTDOWN_RULES] == []
