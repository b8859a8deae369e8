"""Typer/click's own usage errors end as every kvtier error does: one ``error:`` line on stderr, exit 2
(fresh-operator tester: they printed Typer's boxed usage panel)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app


@pytest.mark.parametrize(("args", "line"), [
    (["check", "--bogus", "{}"], "error: No such option: --bogus; see 'kvtier check --help'"),
    (["check"], "error: Missing argument 'config'; see 'kvtier check --help'"),
    (["check", "--block-size", "abc", "{}"], "error: Invalid value for '--block-size': "),
    (["size", "--tp"], "error: Option '--tp' requires an argument"),
    (["nosuch"], "error: No such command 'nosuch'; see 'kvtier --help'"),
    (["trace", "synth", "--regime", "chat"], "error: Missing option '--out'; see 'kvtier trace synth --help'"),
])
def test_a_usage_error_is_one_line(args: list[str], line: str) -> None:
    result = CliRunner().invoke(app, args, prog_name="kvtier")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith(line) and result.stderr.count("\n") == 1, result.stderr


def test_help_and_a_command_still_exit_as_before() -> None:
    assert CliRunner().invoke(app, ["check", "--help"], prog_name="kvtier").exit_code == 0
    assert CliRunner().invoke(app, ["check", "{}"], prog_name="kvtier").exit_code == 1  # errors.fail(..., 1)
    no_args = CliRunner().invoke(app, ["trace"], prog_name="kvtier")
    assert no_args.exit_code == 2 and "synth" in no_args.output  # no arguments: the help, as before


def test_the_console_entry_prints_one_line() -> None:
    result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "audit", "--nope"], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("error: No such option: --nope") and result.stderr.count("\n") == 1, result.stderr
