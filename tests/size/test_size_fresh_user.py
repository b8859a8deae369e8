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


def test_gpu_and_gpu_memory_gib_together_are_refused():
    """--gpu H100 --gpu-memory-gib 40 sized a 40 GiB GPU with exit 0, --gpu silently ignored (fresh-user tester)."""
    result = run("size", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--gpu-memory-gib", "40")
    assert result.exit_code == 2 and result.output == (
        "error: give --gpu (a known GPU's memory) or --gpu-memory-gib (the memory of one GPU in GiB), not both.\n")


def test_a_config_json_path_is_served_as_its_directory(tmp_path):
    """--model DIR/config.json printed `vllm serve DIR/config.json`, which vLLM cannot load (fresh-user tester)."""
    cfg = _llama8b_config(tmp_path)
    doc = json.loads(run("size", "--model", str(cfg), "--offload-gib", "64", "--json").stdout)
    for dialect in ("kvtier", "vllm_native", "lmcache"):
        assert f"vllm serve {tmp_path} " in doc["recipe"][dialect] and "config.json" not in doc["recipe"][dialect]
    assert f"The configs serve {tmp_path}, the directory of --model {cfg}: vllm serve takes a model's directory " \
           "(or hub id), not its config.json." in doc["notes"]
    by_dir = json.loads(run("size", "--model", str(tmp_path), "--offload-gib", "64", "--json").stdout)
    assert by_dir["recipe"] == doc["recipe"] and not [n for n in by_dir["notes"] if "The configs serve" in n]


def test_the_recommended_tiers_and_the_configs_agree_on_their_rounding(tmp_path):
    """The table recommended 345.00 GiB and the configs said 346 with no word why (TP 2 rounds up to whole GiB
    per rank; fresh-user tester): a note gives the configs' figures and says they are rounded up."""
    cfg = _llama8b_config(tmp_path)
    doc = json.loads(run("size", "--model", str(cfg), "--tp", "2", "--gpu", "H100", "--weights-gib", "16",
                         "--context", "8192", "--sessions", "300", "--host-ram-gib", "512", "--json").stdout)
    recipe = doc["recipe"]
    asked = doc["cpu_gib"] + (doc["disk_gib"] or 0)
    assert recipe["cpu_gib"] + recipe["disk_gib"] > asked and recipe["cpu_gib"] % 2 == 0
    assert (f"The configs give {recipe['cpu_gib']} GiB (cpu tier) + {recipe['disk_gib']} GiB (disk tier) = "
            f"{recipe['cpu_gib'] + recipe['disk_gib']} GiB: the {asked:,.2f} GiB above rounded up to whole GiB on "
            "each of 2 ranks.") in doc["notes"]
    whole = json.loads(run("size", "--model", str(cfg), "--offload-gib", "64", "--tp", "2", "--json").stdout)
    assert whole["recipe"]["cpu_gib"] == 64 and not [n for n in whole["notes"] if n.startswith("The configs give")]


def test_offload_gib_is_the_tier_the_table_json_and_recipes_all_give():
    args = ("size", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--offload-gib", "100",
            "--context", "8192", "--sessions", "50")
    text = " ".join(run(*args).output.split())
    assert re.search(r"offload tiers \(total, --offload-gib\) │ 100\.00 GiB", text), text
    assert "the workload alone would need 57.50 GiB" in text
    data = json.loads(run(*args, "--json").stdout)
    assert data["recommended_offload_gib"] == 100 and data["cpu_gib"] == 100 and data["disk_gib"] == 0
    assert data["recipe"]["cpu_gib"] == 100 and "--kv-offloading-size 100" in data["recipe"]["vllm_native"]
    assert any("would need 57.50 GiB" in note for note in data["notes"])


def test_json_and_text_agree_offload_is_needed_when_the_host_has_no_room():
    args = ("size", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--context", "32768", "--sessions", "100",
            "--host-ram-gib", "64", "--host-reserve-gib", "128")
    text = " ".join(run(*args).output.split())
    assert "needed, no room: host RAM 64 GiB ≤ reserve 128 GiB" in text
    data = json.loads(run(*args, "--json").stdout)
    assert data["offload_needed"] is True
    assert data["offload_no_room"].startswith("host RAM 64 GiB ≤ reserve 128 GiB")
    assert data["recipe"] is None  # no tier to configure: no 0 GiB recipe


def test_the_readmes_size_line_prints_what_its_comment_promises():
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = [ln for ln in readme.splitlines() if ln.startswith("kvtier size ") and "#" in ln]
    assert lines
    for line in lines:
        command, comment = line.split("#", 1)
        text = " ".join(run(*shlex.split(command)[1:]).output.split())
        if "HBM budget" in comment:
            assert "HBM KV budget" in text, line
        if "tier size" in comment:
            assert re.search(r"recommended offload tiers \(total\) │ [\d,.]+ GiB", text), (line, text)


def test_an_unknown_gpu_is_refused_naming_the_known_ones_as_audit_does():
    """``kvtier size --gpu H999`` said only "pass --gpu-memory-gib", while ``kvtier audit --gpu H999`` lists
    the GPUs it knows (fresh-user tester): both name every known GPU, and size still offers the memory flag."""
    from kvtier.size.hardware import GPUS

    for args in (("size", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "H999"),
                 ("audit", "-", "--gpu", "H999")):
        result = runner.invoke(app, list(args), input="vllm serve meta-llama/Llama-3.1-8B\n", env={"COLUMNS": "250"})
        assert result.exit_code == 2, result.output
        line = result.output.strip()
        assert line.count("\n") == 0 and "Traceback" not in line, line
        assert "--gpu 'H999' is not known" in line and all(g.name in line for g in GPUS), line
    assert "--gpu-memory-gib" in run("size", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "H999").output


def test_the_examples_a_bad_compression_ratio_offers_are_accepted():
    """``kvtier size --compression-ratio cpu=...`` answered "(e.g. disk=1.45 or disk=blosc2-zstd-shuffle2)", and
    ``disk=1.45`` is then refused by size, which needs a codec (fresh-user tester): every example the
    message offers runs, in size and in simulate."""
    base = ("--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--context", "8192", "--sessions", "100",
            "--nvme-gib", "1000")
    for command, args in (("size", base),
                          ("simulate", ("--trace", "bundled", "--kv-bytes-per-token", "131072", "--engine-gib", "40",
                                        "--cpu-gib", "64", "--disk-gib", "128", "--policy", "lru"))):
        wrong = run(command, *args, "--compression-ratio", "cpu=blosc2-zstd-shuffle2")
        assert wrong.exit_code == 2, wrong.output
        examples = re.search(r"\(e\.g\. (\S+) or (\S+?)\)", wrong.output)
        assert examples is not None, wrong.output
        for example in examples.groups():
            if command == "simulate":  # a replay per example is slow; the parse is what is checked
                from kvtier.size.compression import parse_ratios

                assert parse_ratios([example], ("disk", "redis"))
                continue
            result = run(command, *args, "--compression-ratio", example)
            assert result.exit_code == 0, (example, result.output)


def test_an_engine_with_no_hbm_left_names_the_overhead_not_only_the_weights():
    """The quick start's tiny model on a 4 GiB GPU: "the weights leave no HBM for the KV cache", though its
    weights are a few MiB and the per-GPU overhead (--overhead-gib, 4 by default) took it all (fresh-user
    tester): the line gives the arithmetic and names --overhead-gib among the fixes."""
    result = run("size", "--model", "meta-llama/Llama-3.1-8B", "--weights-gib", "0.01", "--gpu-memory-gib", "4",
                 "--context", "2048", "--sessions", "10")
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert "vLLM would not start" in line and "--overhead-gib 4" in line and "3.60 GiB" in line, line
    assert run("size", "--model", "meta-llama/Llama-3.1-8B", "--weights-gib", "0.01", "--gpu-memory-gib", "4",
               "--overhead-gib", "1", "--context", "2048", "--sessions", "10").exit_code == 0
