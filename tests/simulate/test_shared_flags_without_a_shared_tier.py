"""``kvtier simulate`` refuses a shared-tier flag on a run without a shared tier (fresh-user tester,
user62): ``--shared-tier s3`` without ``--shared-gib`` printed the sweep with no shared tier and no
word that the flag did nothing, while ``--compression-ratio`` for an absent tier and ``--tp``
without ``--model`` are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    lines = [{"timestamp": 1000 * i, "input_length": 1500, "output_length": 8, "hash_ids": [0, 1, 2 + i % 3]}
             for i in range(12)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def simulate(trace: Path, *extra: str):
    return CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--kv-bytes-per-token", "131072",
                                    "--engine-gib", "0.0625", "--cpu-gib", "0.25", "--policy", "lru",
                                    "--workers", "1", *extra], prog_name="kvtier")


@pytest.mark.parametrize(("extra", "flag"), [
    (["--shared-tier", "s3"], "--shared-tier"),
    (["--shared-tier", "redis", "--shared-gib", "0"], "--shared-tier"),
    (["--shared-latency-ms", "100"], "--shared-latency-ms"),
    (["--shared-gb-per-s", "5"], "--shared-gb-per-s"),
    (["--shared-admission", "reused"], "--shared-admission"),
])
def test_a_shared_tier_flag_without_a_shared_tier_is_one_line(trace_file: Path, extra: list[str], flag: str) -> None:
    result = simulate(trace_file, *extra)
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"error: {flag} describes the shared tier, and this run has none (--shared-gib 0); add "
                             "--shared-gib GiB to model one, or drop it\n"), result.stderr
    assert result.stdout == ""


def test_the_same_flags_with_a_shared_tier_still_run(trace_file: Path) -> None:
    result = simulate(trace_file, "--shared-gib", "1", "--shared-tier", "s3", "--shared-latency-ms", "100")
    assert result.exit_code == 0, result.output
    assert "shared tier modeled as s3" in " ".join(result.output.split())
