"""One rule for every file a command writes (kvtier.cli.outputs): an existing file is refused
without --force, and an output that is the same file as an input is refused even with --force.
Before it, ``simulate --trace t.jsonl --json t.jsonl`` replaced the trace with its results (exit 0),
and ``--plot``, ``bench-store --json`` and ``bench run --out DIR`` replaced files silently."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app

SIM = ["--kv-bytes-per-token", "2048", "--engine-gib", "0", "--cpu-gib", "1", "--policy", "lru"]


def _error(result) -> str:
    """The one ``error:`` line of a refused command, which exited 2 without a traceback."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.fixture()
def trace(tmp_path) -> Path:
    path = tmp_path / "t.jsonl"
    result = CliRunner().invoke(app, ["trace", "synth", "--regime", "cycle", "--out", str(path), "--requests", "5"])
    assert result.exit_code == 0, result.output
    return path


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_simulate_never_writes_over_its_trace_even_with_force(trace, option) -> None:
    before = trace.read_bytes()
    result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), *SIM, option, str(trace), "--force"])
    assert _error(result) == (f"error: {option} {trace} is the same file as --trace {trace}, which writing it would "
                              f"destroy; pass another file for {option}")
    assert trace.read_bytes() == before


def test_a_hard_link_to_the_trace_is_the_trace(trace) -> None:
    link = trace.with_name("link.jsonl")
    os.link(trace, link)
    result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), *SIM, "--json", str(link), "--force"])
    assert "is the same file as --trace" in _error(result)


def test_simulate_refuses_an_existing_output_without_force_and_replaces_it_with(trace) -> None:
    out = trace.with_name("out.json")
    out.write_text("keep me")
    result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), *SIM, "--json", str(out)])
    assert _error(result) == f"error: --json {out} already exists; pass another file name, or --force to replace it"
    assert out.read_text() == "keep me"
    result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), *SIM, "--json", str(out), "--force"])
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("{")


def test_simulate_refuses_one_file_for_two_outputs(trace) -> None:
    out = trace.with_name("both")
    result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), *SIM, "--json", str(out), "--plot",
                                      str(out)])
    assert _error(result) == f"error: --plot {out} is the same file as --json {out}; give each output a file of its own"
    assert not out.exists()


def test_bench_store_json_refuses_an_existing_file(tmp_path) -> None:
    out = tmp_path / "bench.json"
    out.write_text("keep me")
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "0.25", "--total-mib", "1", "--repeats", "1",
                                      "--dir", str(tmp_path), "--json", str(out)])
    assert _error(result) == f"error: --json {out} already exists; pass another file name, or --force to replace it"
    assert out.read_text() == "keep me"


def _bench_run(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "run", "--url", url, "--workload",
                           "prefix-repetition", "--num-requests", "2", "--prefix-len", "8", "--suffix-len", "4",
                           "--num-prefixes", "1", "--output-len", "2", "--vocab-size", "500", "--no-progress", *args],
                          capture_output=True, text=True, timeout=90, check=False)


def test_bench_run_out_refuses_a_directory_holding_an_earlier_run(tmp_path) -> None:
    from tests.bench.sse_server import launch

    proc, url = launch()
    try:
        out = tmp_path / "run"
        first = _bench_run(url, "--out", str(out))
        assert first.returncode == 0, first.stderr
        earlier = (out / "summary.json").read_text()
        again = _bench_run(url, "--out", str(out))
        assert again.returncode == 2 and "Traceback" not in again.stderr
        assert again.stderr.strip() == (f"error: --out {out} already holds metrics-after.txt, metrics-before.txt, "
                                        "requests.json and summary.json; pass a new or empty directory, or --force to "
                                        "replace its files")
        assert (out / "summary.json").read_text() == earlier
        # the earlier summary as --baseline of a run into the same directory: never replaced, even with --force
        same = _bench_run(url, "--out", str(out), "--force", "--baseline", str(out / "summary.json"))
        assert same.returncode == 2
        assert same.stderr.strip() == (f"error: --out {out / 'summary.json'} is the same file as --baseline "
                                       f"{out / 'summary.json'}, which writing it would destroy; pass another file "
                                       "for --out")
        forced = _bench_run(url, "--out", str(out), "--force")
        assert forced.returncode == 0, forced.stderr
    finally:
        proc.kill()
        proc.wait()


def test_trace_synth_keeps_its_refusal(trace) -> None:
    result = CliRunner().invoke(app, ["trace", "synth", "--regime", "cycle", "--out", str(trace)])
    assert _error(result) == f"error: --out {trace} already exists; pass another file name, or --force to replace it"
