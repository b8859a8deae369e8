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
