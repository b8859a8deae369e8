"""``kvtier size``'s notes and recipes agree with the command given and with each other (issue 24:
a fresh-eyes tester's findings 2, 10 and 13)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.audit.engine import audit
from kvtier.audit.loader import load_configs
from kvtier.audit.versions import parse_version
from kvtier.cli.main import app
from kvtier.cli.size_audit import recipe_audit, refusal
from kvtier.size.recipe import build_recipe

runner = CliRunner()


def size(*args: str) -> dict:
    result = runner.invoke(app, ["size", *args, "--json"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "config.json"  # no *.safetensors beside it: the weights are unknown
    path.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                "hidden_size": 4096}))
    return str(path)


def test_the_missing_flag_note_names_only_flags_not_given(config):
    notes = size("--model", config, "--gpu", "H100", "--context", "8192", "--sessions", "100")["notes"]
    (note,) = [n for n in notes if n.startswith("No offload tier size")]
    assert "--weights-gib" in note and "--gpu" not in note, notes


def test_offload_gib_0_does_not_suggest_offload_gib(config):
    notes = size("--model", config, "--offload-gib", "0")["notes"]
    assert not any("--offload-gib GIB" in n for n in notes), notes
    assert "--offload-gib 0 asks for no offload tier, so there is no config to print." in notes


def test_the_disk_share_in_the_notes_is_the_recipes(config):
    """10 GiB at TP 4 with 8 GiB of usable RAM: 2 GiB spill, which every recipe rounds to 1 GiB per rank."""
    data = size("--model", "meta-llama/Llama-3.1-70B-Instruct", "--tp", "4", "--offload-gib", "10",
                "--host-ram-gib", "24", "--host-reserve-gib", "16")
    recipe = data["recipe"]
    assert recipe["disk_gib"] == 4 and "LMCACHE_MAX_LOCAL_DISK_SIZE=1\n" in recipe["lmcache"]
    (note,) = [n for n in data["notes"] if "exceeds usable host RAM" in n]
    assert "put 4 GiB on a disk tier (2 GiB rounded up to whole GiB on each of 4 ranks)" in note, note


def test_a_computed_tier_has_the_bound_of_offload_gib(config):
    result = runner.invoke(app, ["size", "--model", config, "--context", "100000000", "--sessions", "100000000",
                                 "--gpu", "H100", "--weights-gib", "16"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "more than the 1,048,576 GiB kvtier size sizes" in result.output, result.output


@pytest.mark.parametrize(("url", "flags", "ca"), [
    ("redis://10.0.0.5:7000/0", "redis-server --port 7000 --maxmemory", False),
    ("redis://10.0.0.5/0", "redis-server --maxmemory", False),
    ("rediss://kvtier-redis:6380/0", "redis-server --port 0 --tls-port 6380 --tls-cert-file", True),
])
def test_the_redis_server_listens_where_the_url_points(url, flags, ca):
    recipe = size("--model", "Qwen/Qwen3-8B", "--offload-gib", "100", "--redis-url", url)["recipe"]
    assert recipe["redis"].startswith(flags), recipe["redis"]
    extra = json.loads(shlex.split(recipe["kvtier"].split("--kv-transfer-config ", 1)[1])[0])[
        "kv_connector_extra_config"]
    assert ("redis_tls_ca_file" in extra) is ca
    if ca:
        assert "must name kvtier-redis (the URL's host)" in recipe["redis"]


def test_a_disk_tier_recipe_gives_the_workers_time_to_flush_and_audits_clean():
    recipe = size("--model", "Qwen/Qwen3-8B", "--offload-gib", "100", "--host-ram-gib", "40")["recipe"]
    assert recipe["kvtier"].startswith("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=35 vllm serve "), recipe["kvtier"]
    findings = audit(load_configs(recipe["kvtier"], "recipe", parse_version("0.32.0")))
    # without --gpu the audit can only name the GPUs on which the 92 GiB disk tier would not pass the engine
    assert {(f.rule, f.severity) for f in findings} <= {("cpu-tier-vs-engine-cache-unknown", "info")}, findings
    no_disk = size("--model", "Qwen/Qwen3-8B", "--offload-gib", "10")["recipe"]
    assert no_disk["kvtier"].startswith("vllm serve ")


_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")  # kvtier's supported releases (compat.CHECKED_RELEASES)
_GRID = [
    # model, TP, GPU, workload, host RAM / NVMe
    ("meta-llama/Llama-3.1-8B", "1", "H100", ("--context", "32768", "--sessions", "100"), ()),
    ("meta-llama/Llama-3.1-8B", "1", "H100", ("--context", "32768", "--sessions", "100"),
     ("--host-ram-gib", "64", "--nvme-gib", "2000", "--disk-gb-per-s", "14")),
    ("meta-llama/Llama-3.1-8B", "1", "H100", ("--context", "8192", "--sessions", "50"), ("--host-ram-gib", "512")),
    ("meta-llama/Llama-3.1-70B", "8", "H200", ("--context", "32768", "--trace", "bundled"),
     ("--host-ram-gib", "2048", "--nvme-gib", "13970", "--disk-gb-per-s", "14")),
    ("meta-llama/Llama-3.1-70B-Instruct", "4", "H100", ("--context", "32768", "--sessions", "200"),
     ("--host-ram-gib", "256", "--nvme-gib", "4000", "--disk-gb-per-s", "14")),
    ("Qwen/Qwen3-32B", "2", "H100", ("--context", "32768", "--sessions", "200"), ("--host-ram-gib", "1024")),
    ("deepseek-ai/DeepSeek-V2-Lite-Chat", "1", "H200", ("--context", "65536", "--sessions", "300"),
     ("--host-ram-gib", "128", "--nvme-gib", "8000", "--disk-gb-per-s", "28")),
    ("google/gemma-3-27b-it", "2", "B200", ("--context", "32768", "--sessions", "500"), ("--host-ram-gib", "768")),
]


@pytest.mark.parametrize("model,tp,gpu,workload,host", _GRID)
def test_every_recipe_size_prints_audits_clean_on_every_supported_vllm(model, tp, gpu, workload, host):
    """docs/size.md says size's lines are clean under ``kvtier audit --gpu``: every serve line of every
    recipe (kvtier, vLLM native, LMCache), on every supported release, has no warning or error."""
    report = size("--model", model, "--tp", tp, "--gpu", gpu, *workload, *host)
    recipe = report["recipe"]
    assert recipe is not None, report["notes"]
    lines = [recipe[k] for k in ("kvtier", "vllm_native", "lmcache") if "vllm serve" in recipe[k]]
    assert lines and "vllm serve" in recipe["kvtier"]
    for version in _VERSIONS:
        for text in lines:
            audited = runner.invoke(app, ["audit", "-", "--gpu", gpu, "--vllm-version", version, "--format", "json"],
                                    input=text)
            assert audited.exit_code == 0, audited.output
            findings = [f for f in json.loads(audited.stdout)["findings"] if f["severity"] in ("warning", "error")]
            assert findings == [], (version, text, findings)
    assert not [n for n in report["notes"] if n.startswith("kvtier audit")], report["notes"]


def test_a_recipe_the_audit_would_flag_says_so_in_the_notes():
    """A tier the operator chose below the engine's KV cache: size prints the audit's warning as a note."""
    notes = size("--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--offload-gib", "10")["notes"]
    flagged = [n for n in notes if n.startswith("kvtier audit --vllm-version 0.32.0/0.33.0/0.34.0 warns")]
    assert any("cpu-tier-not-above-engine-cache" in n and "kvtier config" in n for n in flagged), notes
    assert any("vLLM native config" in n for n in flagged), notes


def test_a_recipe_the_audit_refuses_says_refuses_not_warns():
    """tools tester: a kvtier recipe whose cpu tier holds less than one chunk of the model (Llama-3.1-8B,
    1,048,576-token chunks: 128 GiB each) is an audit error (``kvtier-cpu-tier-below-one-chunk``, the
    connector refuses it at start-up); size's note said the audit "warns on" it.  (size itself now
    refuses such a recipe, below: the notes are read from the recipe directly.)"""
    recipe = build_recipe("meta-llama/Llama-3.1-8B", 1, 10, chunk_tokens=1048576, gpu_memory_utilization=0.9)
    notes = [note.text for note in recipe_audit(recipe, None)]
    refused = [n for n in notes if n.startswith("kvtier audit --vllm-version") and "kvtier-cpu-tier-below-one-chunk" in n]
    assert refused and all(" refuses the kvtier config " in n for n in refused), notes
    assert not any(" warns on " in n and "kvtier-cpu-tier-below-one-chunk" in n for n in notes), notes
    # the sentence size would exit 2 with were its own check not first: the fix in size's flags, not cpu_gib's
    line = refusal(recipe_audit(recipe, None))
    assert line is not None and "(kvtier-cpu-tier-below-one-chunk), so no recipe is printed: cpu_gib 10 " in line, line
    assert line.endswith("Fix: Give a larger --offload-gib (room for hundreds of chunks) or a shorter --chunk-tokens "
                         "(default 128)."), line


@pytest.mark.parametrize(("tp", "offload_gib", "refused"), [(1, "10", True), (1, "127", True), (1, "128", False),
                                                           (2, "10", True), (2, "128", False)])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_recipe_whose_cpu_tier_holds_less_than_one_chunk_is_refused_with_exit_2(tp, offload_gib, refused, as_json):
    """docs/size.md § Errors: no recipe for an engine that would not start.  size printed a kvtier recipe
    whose cpu tier (``--offload-gib 10``) holds less than one 1,048,576-token chunk of Llama-3.1-8B
    (128 GiB a chunk at TP 1, 64 GiB a rank at TP 2), which the connector refuses at start-up, with
    exit 0 and a note.  Now: one line naming the chunk and the least ``--offload-gib``, exit 2, nothing
    on stdout, in text and JSON alike; at 128 GiB (exactly one chunk a rank) the recipe is printed."""
    args = ["size", "--model", "meta-llama/Llama-3.1-8B", "--chunk-tokens", "1048576", "--offload-gib", offload_gib,
            "--tp", str(tp)] + (["--json"] if as_json else [])
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    if not refused:
        assert result.exit_code == 0, result.output
        assert '"cpu_gib":128' in result.stdout.replace(" ", "").replace('\\"', '"')
        return
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    line, = result.stderr.strip().splitlines()
    assert "smaller than one 1,048,576-token chunk of meta-llama/Llama-3.1-8B" in line, line
    assert f"({128 * 2**30 // tp:,} bytes a rank at 2-byte KV)" in line, line
    assert "--offload-gib of at least 128 " in line and "--chunk-tokens" in line, line


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_recipe_any_audit_error_refuses_is_not_printed(as_json):
    """docs/size.md § Errors: size runs the audit on the kvtier config it would print, and any audit error
    there (not only a cpu tier below one chunk) refuses the recipe.  Seen: ``--chunk-tokens 128`` on
    Qwen3-Next at TP 4 (its state block is at least 268 tokens) printed, exit 0, a recipe with a note that
    ``kvtier audit`` refuses it (``kvtier-chunk-tokens-below-state-block``: the connector would not start).
    Now: one line naming the rule, its message and the flag to change, exit 2, nothing on stdout."""
    args = ["size", "--model", "Qwen/Qwen3-Next-80B-A3B-Instruct", "--tp", "4", "--offload-gib", "100",
            "--chunk-tokens", "128"] + (["--json"] if as_json else [])
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    line, = result.stderr.strip().splitlines()
    assert "refuses the kvtier config this would print (kvtier-chunk-tokens-below-state-block)" in line, line
    assert "chunk_tokens 128 is shorter than the state block of Qwen/Qwen3-Next-80B-A3B-Instruct" in line, line
    assert line.endswith("Fix: Leave --chunk-tokens out: the recipe then says chunk_tokens auto, which the connector "
                         "makes a multiple of every block size, the state block's included."), line
    kept = size("--model", "Qwen/Qwen3-Next-80B-A3B-Instruct", "--tp", "4", "--offload-gib", "100")["recipe"]
    extra = json.loads(shlex.split(kept["kvtier"].split("--kv-transfer-config ", 1)[1])[0])["kv_connector_extra_config"]
    assert extra["chunk_tokens"] == "auto", kept["kvtier"]  # without --chunk-tokens: printed, exit 0
