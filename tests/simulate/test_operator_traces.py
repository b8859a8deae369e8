"""Trace files an operator hands the trace tools that nobody wrote by hand before (trace-tools probe):
each tool runs as a real process on a real file, and a bad file is one ``error:`` line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


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


def _three_requests(path: Path) -> Path:
    """Three prompts sharing chunks 1 and 2 (512-token chunks): 39.1 % of prompt tokens can hit, by hand:
    B (1,600 tokens) hits chunks 1, 2 (1,024 tokens), C (1,024 tokens) chunk 1 only (its last token's chunk is
    recomputed): 1,536 / 3,924."""
    lines = [(0, 1300, [1, 2, 3]), (1000, 1600, [1, 2, 4, 5]), (2000, 1024, [1, 2])]
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 10, "hash_ids": ids})
                            + "\n" for t, n, ids in lines))
    return path


def test_recommend_sizes_no_tier_where_the_engine_alone_reaches_the_ceiling_as_size_says(tmp_path: Path) -> None:
    """simulate --recommend printed 'cpu 1 GiB  the curve is flat ... sweep a wider range (e.g. --cpu-gib
    0.00292969,0.0625,1,4) to find where it bends; hits 39.1%' when the engine held the whole trace (the cpu
    column 0.0 %, all 39.1 % the engine's), and on a trace with nothing to reuse (ceiling 0.0 %), while
    kvtier size on the same trace and geometry says 'Offload not needed'."""
    trace = _three_requests(tmp_path / "three.jsonl")
    common = ("--model", "meta-llama/Llama-3.1-8B-Instruct", "--policy", "lru,default", "--workers", "1",
              "--recommend")
    sim = kvtier("simulate", "--trace", str(trace), "--engine-gib", "52.73", "--cpu-gib", "1,4", *common)
    assert sim.returncode == 0, sim.stdout + sim.stderr
    text = " ".join(sim.stdout.split())
    assert "39.1%" in text and "cpu none not needed: the engine's own prefix cache (53 GiB) already hits 39.1%" \
        in text, sim.stdout
    assert "disk none not needed either" in text and "sweep a wider range" not in text, sim.stdout
    size = kvtier("size", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--trace", str(trace),
                  "--json")
    assert size.returncode == 0, size.stderr
    report = json.loads(size.stdout)
    assert report["offload_needed"] is False and report["predicted_hits"]["total"] == pytest.approx(1536 / 3924)
    assert report["hbm_kv_budget_bytes"] / 2**30 == pytest.approx(52.73, abs=0.005)

    once = tmp_path / "once.jsonl"  # one prompt: nothing is ever used twice
    once.write_text('{"timestamp": 0, "input_length": 6758, "output_length": 5, "hash_ids": '
                    + json.dumps(list(range(14))) + "}\n")
    sim = kvtier("simulate", "--trace", str(once), "--engine-gib", "0", "--cpu-gib", "1,4", *common)
    assert sim.returncode == 0, sim.stdout + sim.stderr
    assert "cpu none not needed: no prompt token of this trace can be served from any cache (ceiling 0.0%" \
        in " ".join(sim.stdout.split()), sim.stdout


def test_a_cpu_capacity_below_one_chunk_under_a_lower_tier_is_refused_as_0_is(tmp_path: Path) -> None:
    """--cpu-gib 0 beside --disk-gib is refused (kvtier runs no lower tier without a cpu tier), but 0.05 GiB, less
    than one 64 MiB chunk of Llama-3.1-8B and so no cpu tier at all, was swept: its row said the disk served all
    39.1% of a configuration kvtier check refuses ('a cpu tier smaller than one chunk')."""
    trace = _three_requests(tmp_path / "three.jsonl")
    common = ("--trace", str(trace), "--model", "meta-llama/Llama-3.1-8B-Instruct", "--engine-gib", "0",
              "--policy", "lru", "--workers", "1")
    for lower in ("--disk-gib", "--shared-gib"):
        _one_error_line(kvtier("simulate", *common, "--cpu-gib", "0.05,1", lower, "2"),
                        "--cpu-gib 0.05 GiB is less than one 0.0625 GiB chunk: with --disk-gib or --shared-gib that "
                        "models a lower tier without a cpu tier, which kvtier refuses")
    one_chunk = kvtier("simulate", *common, "--cpu-gib", "0.0625,1", "--disk-gib", "2")  # one chunk: a cpu tier
    assert one_chunk.returncode == 0, one_chunk.stdout + one_chunk.stderr
    alone = kvtier("simulate", *common, "--cpu-gib", "0.05,1")  # no lower tier: the engine-alone row, as 0 is,
    assert alone.returncode == 0, alone.stdout + alone.stderr  # said so as 0 is (it was a silent 0.05 row)
    assert ("note: --cpu-gib 0.05 GiB holds less than one 0.0625 GiB chunk: the engine alone, like 0 (kvtier refuses "
            "a cpu tier smaller than one chunk)") in alone.stderr, alone.stderr
    assert "note:" not in one_chunk.stderr, one_chunk.stderr


def test_an_absurd_length_is_one_short_sentence_and_a_5000_digit_one_no_traceback(tmp_path: Path) -> None:
    """'input_length': 1e300 was taken as an integer and quoted back as a 301-digit token count beside a
    301-digit block count; 'output_length': 1e300 passed into bench's requests; a 5,000-digit integer
    (past Python's 4,300-digit limit, a ValueError, not a JSONDecodeError) ended every trace tool in a
    traceback, exit 1."""
    big = tmp_path / "big.jsonl"
    big.write_text('{"timestamp": 0, "input_length": 1e300, "output_length": 1, "hash_ids": [0, 1]}\n')
    _one_error_line(kvtier("trace", "stats", "--trace", str(big)),
                    "big.jsonl line 1: field 'input_length' must be an integer from 1 to 2^53, got 1e+300")
    out = tmp_path / "out.jsonl"
    out.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1e300, "hash_ids": [0, 1]}\n')
    _one_error_line(kvtier("bench", "run", "--url", "http://127.0.0.1:9", "--workload", "trace", "--trace", str(out),
                           "--vocab-size", "2048"), "field 'output_length' must be an integer from 0 to 2^53")
    digits = tmp_path / "digits.jsonl"
    digits.write_text('{"timestamp": 0, "input_length": ' + "9" * 5000 + ', "hash_ids": [0, 1]}\n')
    for tool in (("trace", "stats"), ("simulate", "--kv-bytes-per-token", "2048", "--engine-gib", "0",
                                      "--cpu-gib", "1", "--workers", "1")):
        _one_error_line(kvtier(*tool, "--trace", str(digits)), "digits.jsonl line 1 holds a number too long to read")
