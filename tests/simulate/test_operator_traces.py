"""Trace files an operator hands the trace tools that nobody wrote by hand before (trace-tools probe):
each tool runs as a real process on a real file, and a bad file is one ``error:`` line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def kvtier(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args], check=False, capture_output=True,
                          text=True, timeout=timeout, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin",
                                                          "PYTHONPATH": ":".join(sys.path)})


def _one_error_line(proc: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], lines
    assert "Traceback" not in proc.stderr


def test_an_infinite_arrival_time_is_refused_by_every_tool_that_reads_a_trace(tmp_path: Path) -> None:
    """``{"timestamp": Infinity}`` is JSON Python reads: every trace tool took it (trace stats printed '2 requests
    over inf s') and ``bench run`` then waited forever for that request's arrival (killed after 40 s with 1 of 2
    sent)."""
    mooncake = tmp_path / "inf.jsonl"
    mooncake.write_text('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]}\n'
                        '{"timestamp": Infinity, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]}\n')
    fragment = "inf.jsonl line 2: field 'timestamp' must be a finite number >= 0 (ms), got inf"
    _one_error_line(kvtier("trace", "stats", "--trace", str(mooncake)), fragment)
    _one_error_line(kvtier("simulate", "--trace", str(mooncake), "--kv-bytes-per-token", "2048", "--engine-gib", "0",
                           "--cpu-gib", "1", "--workers", "1"), fragment)
    _one_error_line(kvtier("size", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--trace", str(mooncake)), fragment)
    # the trace is read before the server is asked anything: nothing listens on port 9
    _one_error_line(kvtier("bench", "run", "--url", "http://127.0.0.1:9", "--workload", "trace", "--trace",
                           str(mooncake), "--vocab-size", "2048"), fragment)
    recorded = tmp_path / "inf.kv.jsonl"
    recorded.write_text("".join(json.dumps({"time_s": t, "num_tokens": 600, "chunk_tokens": 512, "chunk_keys": ["ab"]})
                                + "\n" for t in (0.0, float("inf"))))
    _one_error_line(kvtier("trace", "stats", "--trace", str(recorded), "--format", "kvtier-jsonl"),
                    "inf.kv.jsonl line 2: field 'time_s' must be a finite number >= 0, got inf")


def test_a_timestamp_past_a_double_is_infinite_and_refused_too(tmp_path: Path) -> None:
    """``1e309`` parses as inf: the same refusal, not a trace 'over inf s'."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 1e309, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]}\n')
    _one_error_line(kvtier("trace", "stats", "--trace", str(path)), "must be a finite number >= 0 (ms)")
