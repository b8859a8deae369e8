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
    # click's own question ends a sentence: the hint follows as the next one, not after "?;"
    (["nope"], "error: No such command 'nope'. Did you mean 'node'? (See 'kvtier --help'.)"),
    (["trace", "synth", "--regime", "chat"], "error: Missing option '--out'; see 'kvtier trace synth --help'"),
])
def test_a_usage_error_is_one_line(args: list[str], line: str) -> None:
    result = CliRunner().invoke(app, args, prog_name="kvtier")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith(line) and result.stderr.count("\n") == 1, result.stderr


def test_help_and_a_command_still_exit_as_before() -> None:
    assert CliRunner().invoke(app, ["check", "--help"], prog_name="kvtier").exit_code == 0
    errors = CliRunner().invoke(app, ["check", "--offline", ('{"kv_connector":"KVTierConnector","kv_role":"kv_both",'
                                      '"kv_connector_extra_config":{"cpu_gb":4}}')], prog_name="kvtier")
    assert errors.exit_code == 1 and "'cpu_gb'" in errors.stdout, errors.output  # a config with errors
    no_args = CliRunner().invoke(app, ["trace"], prog_name="kvtier")
    assert no_args.exit_code == 2 and "synth" in no_args.output  # no arguments: the help, as before


def test_the_console_entry_prints_one_line() -> None:
    result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "audit", "--nope"], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("error: No such option: --nope") and result.stderr.count("\n") == 1, result.stderr


def test_the_test_model_writer_refuses_an_unwritable_out_in_one_sentence(tmp_path) -> None:
    """``python -m kvtier.launch.testmodel --out`` a file, or where nothing can be written, printed an
    OSError / FileExistsError traceback (fresh-user tester): one ``error:`` sentence, exit 2."""
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    cases = [(a_file, (f"error: --out {a_file} is a file, not a directory; give a directory to write the model into "
                      "(it is created if missing).")),
             (a_file / "m", (f"error: cannot write the model to --out {a_file / 'm'} (Not a directory); give a "
                            "directory this user can write.")),
             ("/proc/self/kvtier-none/m", "error: cannot write the model to --out /proc/self/kvtier-none/m (")]
    for out, line in cases:
        result = subprocess.run([sys.executable, "-m", "kvtier.launch.testmodel", "--geometry", "tiny", "--out",
                                 str(out)], capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 2 and result.stdout == "", result
        assert result.stderr.startswith(line) and result.stderr.count("\n") == 1, result.stderr
    assert a_file.read_bytes() == b"x" and sorted(p.name for p in tmp_path.iterdir()) == ["weights.bin"]
