"""A fresh user's runs of ``kvtier size`` / ``kvtier trace``: ``--trace bundled`` everywhere a trace is read,
``size --tokens-per-block``, "needed, no room" instead of "not needed", one warm-set figure."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.size.presets import PRESETS

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "250"})


def _llama8b_config(tmp_path):
    preset = next(p for p in PRESETS if p.name == "meta-llama/Llama-3.1-8B-Instruct")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(preset.config))
    return cfg


def test_trace_stats_reads_the_bundled_trace_as_simulate_does():
    result = run("trace", "stats", "--trace", "bundled")
    assert result.exit_code == 0, result.output
    assert "does not exist" not in result.output
    assert re.search(r"[\d,]+ requests over", result.output)


def test_size_reads_a_synth_trace_of_other_block_tokens_with_tokens_per_block(tmp_path):
    trace = tmp_path / "chat128.jsonl"
    made = run("trace", "synth", "--regime", "chat", "--requests", "300", "--block-tokens", "128", "--out", str(trace))
    assert made.exit_code == 0, made.output
    args = ("size", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--trace", str(trace), "--json")
    wrong = run(*args)  # the default 512 does not match: the hint names an option size has
    assert wrong.exit_code == 2 and "--tokens-per-block" in wrong.output
    right = run(*args, "--tokens-per-block", "128")
    assert right.exit_code == 0, right.output
    assert json.loads(right.stdout)["warm_set_bytes"] > 0


def test_offload_needed_without_room_says_so(tmp_path):
    cfg = _llama8b_config(tmp_path)
    result = run("size", "--model", str(cfg), "--gpu", "H100", "--context", "8192", "--sessions", "100",
                 "--host-ram-gib", "8", "--weights-gib", "15")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "offload not needed" not in text
    assert "needed, no room: host RAM 8 GiB ≤ reserve 32 GiB" in text
    data = json.loads(run("size", "--model", str(cfg), "--gpu", "H100", "--context", "8192", "--sessions", "100",
                          "--host-ram-gib", "8", "--weights-gib", "15", "--json").stdout)
    assert data["offload_no_room"].startswith("host RAM 8 GiB ≤ reserve 32 GiB")
    roomy = json.loads(run("size", "--model", str(cfg), "--gpu", "H100", "--context", "8192", "--sessions", "100",
                           "--host-ram-gib", "1024", "--weights-gib", "15", "--json").stdout)
    assert roomy["offload_no_room"] is None and roomy["offload_needed"]


def test_table_and_notes_give_one_warm_set_figure(tmp_path):
    cfg = _llama8b_config(tmp_path)
    result = run("size", "--model", str(cfg), "--gpu", "H100", "--context", "8192", "--sessions", "100",
                 "--host-ram-gib", "8", "--weights-gib", "15")
    text = " ".join(result.output.split())
    row = re.search(r"warm set \(100 sessions, with ×1.15 headroom\) │? ?([\d,.]+) GiB", text)
    assert row, text
    noted = re.search(r"the warm set \(([\d,]+) GiB\)", text, re.IGNORECASE)
    assert noted, text
    assert round(float(row.group(1).replace(",", ""))) == int(noted.group(1).replace(",", ""))


def test_bench_trace_workload_takes_bundled_as_its_default():
    from pathlib import Path

    from kvtier.bench.factory import WorkloadKnobs, build_workload

    named = build_workload(WorkloadKnobs(trace_path=Path("bundled"), limit=20), 2048, 4096, closed_loop=True)
    default = build_workload(WorkloadKnobs(limit=20), 2048, 4096, closed_loop=True)
    assert len(named.requests) == 20 and named.requests == default.requests
