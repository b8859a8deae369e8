"""Output paths on a kernel filesystem (/proc, /sys) are refused before any work: root may write
to their directories, so the writability checks passed and the command failed only after the work
with a message about free space (clifix3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvtier.cli.errors import check_output_path, make_output_dir
from kvtier.cli.main import app


def _refused(result, option: str, path: str, fstype: str) -> None:
    assert result.exit_code == 2, result.output
    assert (f"error: {option} {path} is on the {fstype} filesystem mounted at /{path.split('/')[1]}, a kernel "
            "interface that cannot hold files; pass a path on a local disk") in result.output, result.output


@pytest.mark.parametrize("option, path, fstype", [
    ("--dir", "/proc", "proc"),
    ("--dir", "/sys/kernel", "sysfs"),
    ("--json", "/proc/bench-store.json", "proc"),
])
def test_bench_store_refuses_a_kernel_filesystem(tmp_path, option, path, fstype) -> None:
    args = {"--dir": str(tmp_path), "--json": str(tmp_path / "out.json"), option: path}
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "0.25", "--total-mib", "1", "--repeats", "1",
                                      *[a for item in args.items() for a in item]])
    _refused(result, option, path, fstype)


@pytest.mark.parametrize("option, path, fstype", [
    ("--plot", "/proc/kvtier-plot.png", "proc"),
    ("--json", "/sys/kvtier.json", "sysfs"),
])
def test_simulate_refuses_a_kernel_filesystem_before_reading_the_trace(tmp_path, option, path, fstype) -> None:
    trace = tmp_path / "t.jsonl"
    result = CliRunner().invoke(app, ["trace", "synth", "--regime", "cycle", "--out", str(trace), "--requests", "3"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--kv-bytes-per-token", "2048",
                                      "--engine-gib", "0", "--cpu-gib", "1", option, path])
    _refused(result, option, path, fstype)


def test_a_report_directory_on_a_kernel_filesystem_is_refused_before_mkdir(capsys) -> None:
    """make_output_dir (``kvtier bench run/compare --out``): refused, not "cannot be created (No such file...)"."""
    with pytest.raises(typer.Exit) as exited:
        make_output_dir(Path("/proc/kvtier-bench/run1"), "--out")
    assert exited.value.exit_code == 2
    assert capsys.readouterr().err == ("error: --out /proc/kvtier-bench/run1 is on the proc filesystem mounted at "
                                       "/proc, a kernel interface that cannot hold files; pass a path on a local "
                                       "disk\n")


@pytest.mark.parametrize("stream", ["/dev/null", "/proc/self/fd/1"])
def test_a_stream_on_a_kernel_filesystem_is_still_written(stream) -> None:
    """``--json /dev/null`` or ``/proc/self/fd/1`` (a device, a pipe) is the user's wish, not a mistake."""
    check_output_path(Path(stream), "--json")  # returns: no typer.Exit
