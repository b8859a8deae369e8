"""Trace arrival order: one rule for every tool that replays a trace (simulate, size --trace,
trace stats, bench run and bench compare --workload trace).

A trace whose timestamps went backwards (e.g. several log files concatenated) was replayed in file
order by all four, silently, with negative gaps; every reader now refuses it in one sentence naming
both lines and how to sort the file.  A sorted trace (the shipped and the shared Mooncake trace)
reads as before; equal timestamps are in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.simulate.trace import read_trace
from kvtier.tools.mooncake import bundled_trace_path, iter_records

SRC = str(Path(__file__).resolve().parents[2] / "src")
SHARED_TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")

TOOLS = {
    "simulate": ["simulate", "--engine-gib", "1", "--kv-bytes-per-token", "1024", "--cpu-gib", "1", "--trace"],
    "size": ["size", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--context", "8192", "--trace"],
    "trace stats": ["trace", "stats", "--trace"],
    "bench run": ["bench", "run", "--url", "http://127.0.0.1:9", "--workload", "trace", "--trace"],
    # refused before any server starts (the fresh user's compare on such a trace started vLLM first)
    "bench compare": ["bench", "compare", "--model", "/nonexistent-model", "--arms", "baseline", "--workload", "trace",
                      "--trace"],
}


def kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args], capture_output=True, text=True,
                          check=False, timeout=120, env=env)


def mooncake(path: Path, stamps: list[float]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]})
                            + "\n" for t in stamps))
    return path


@pytest.mark.parametrize("tool", TOOLS)
def test_a_timestamp_going_backwards_is_refused_by_every_tool_in_one_sentence(tool, tmp_path):
    trace = mooncake(tmp_path / "merged.jsonl", [5000, 0])
    out = kvtier(*TOOLS[tool], str(trace))
    said = (out.stdout + out.stderr).strip()
    assert out.returncode == 2, said
    assert said == ("error: merged.jsonl line 2: timestamp 0 is before line 1's 5000; sort the trace by timestamp "
                    "(e.g. jq -cs 'sort_by(.timestamp)[]' merged.jsonl > sorted.jsonl)"), said


def test_the_kvtier_format_follows_the_same_rule_and_equal_times_are_in_order(tmp_path):
    lines = [{"time_s": t, "num_tokens": 16, "chunk_tokens": 16, "chunk_keys": ["aa"]} for t in (5, 5, 1.5)]
    trace = tmp_path / "k.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = kvtier("trace", "stats", "--format", "kvtier-jsonl", "--trace", str(trace))
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith("error: k.jsonl line 3: time_s 1.5 is before line 2's 5; sort the trace "
                                         "by time_s"), out.stderr
    mooncake(trace, [0, 7, 7, 9])
    assert read_trace(trace).times_s == [0.0, 0.007, 0.007, 0.009]


@pytest.mark.parametrize("path", [bundled_trace_path(), SHARED_TRACE], ids=["bundled", "shared"])
def test_a_real_sorted_trace_reads_as_its_lines_say(path):
    if not path.exists():
        pytest.skip(f"{path} is not on this machine")
    opener = __import__("gzip").open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        stamps = [json.loads(line)["timestamp"] for line in handle if line.strip()]
    assert [r.timestamp_ms for r in iter_records(path)] == stamps
    trace = read_trace(path)
    assert trace.times_s == [(t - stamps[0]) / 1000.0 for t in stamps]
