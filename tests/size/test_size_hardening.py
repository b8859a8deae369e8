"""Regression tests for ``kvtier size`` inputs found by the breaker (one case per defect)."""

from __future__ import annotations

import json
import os
import shlex

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.size.plan import MIN_CPU_GIB
from tests.size.checkpoints import write_safetensors

runner = CliRunner()
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def run(*args: str):
    return runner.invoke(app, ["size", *args], env={"COLUMNS": "200"})


def _json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_short_host_ram_keeps_a_minimum_dram_tier_in_front_of_disk():
    data = _json("--model", LLAMA, "--gpu", "H100", "--context", "131072", "--sessions", "100",
                 "--host-ram-gib", "10", "--nvme-gib", "100000")
    assert data["cpu_gib"] == MIN_CPU_GIB and data["disk_gib"] > 0 and data["cpu_staging"] is True
    assert data["recipe"]["cpu_gib"] >= MIN_CPU_GIB
    assert "LMCACHE_MAX_LOCAL_CPU_SIZE=0" not in data["recipe"]["lmcache"]
    assert "--kv-offloading-size 0" not in data["recipe"]["vllm_native"]
    assert any("in front of the disk tier" in note for note in data["notes"])
    assert any("exceeds usable host RAM" in note and "--host-reserve-gib" in note for note in data["notes"])


def test_explicit_offload_gib_is_capped_by_host_ram_with_a_note():
    data = _json("--model", LLAMA, "--offload-gib", "100", "--host-ram-gib", "40", "--host-reserve-gib", "16")
    assert data["recipe"]["cpu_gib"] == 24 and data["recipe"]["disk_gib"] == 76
    assert any("exceeds usable host RAM" in note for note in data["notes"])


@pytest.mark.parametrize("cfg, words", [
    ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 0, "hidden_size": 4096},
     "num_key_value_heads 0"),
    ({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100}, "not divisible"),
    # 0 % heads == 0: sized 0 bytes per token, exit 0 (tester3)
    ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 0},
     "has hidden_size 0; it must be at least 1 (or give the model's 'head_dim')."),
    # more KV heads than query heads, or a group size that is not whole: vLLM's Attention asserts
    # num_heads % num_kv_heads == 0; these were sized silently (tester3)
    ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 64, "hidden_size": 4096},
     "has num_attention_heads 32 not divisible by num_key_value_heads 64; vLLM refuses such a model"),
    ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 5, "hidden_size": 4096},
     "has num_attention_heads 32 not divisible by num_key_value_heads 5"),
])
def test_impossible_head_counts_are_refused(tmp_path, cfg, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    result = run("--model", str(path))
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output


def test_broken_safetensors_entries_are_refused_unless_weights_are_given(tmp_path):
    """A dangling link, a directory or an empty file named *.safetensors is a partial download: summing
    the rest sized the weights far too small (the HBM budget far too big), so the budget is refused
    until --weights-gib gives the weights (nu5; before: ignored with a note)."""
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "hidden_size": 256}))
    os.symlink(tmp_path / "missing-blob", tmp_path / "model-00001-of-00003.safetensors")
    (tmp_path / "model-00002-of-00003.safetensors").mkdir()
    (tmp_path / "model-00003-of-00003.safetensors").write_bytes(b"")
    write_safetensors(tmp_path / "real.safetensors", 1 << 20)
    refused = run("--model", str(tmp_path), "--gpu-memory-gib", "8")
    assert refused.exit_code == 2 and "pass --weights-gib" in refused.output and "Traceback" not in refused.output
    for name in ("model-00001-of-00003", "model-00002-of-00003", "model-00003-of-00003"):
        assert name in refused.output
    data = _json("--model", str(tmp_path), "--gpu-memory-gib", "8", "--weights-gib", "1")
    assert data["weights_note"] == "given" and data["weights_gib"] == 1


@pytest.mark.parametrize("flag, value", [("--offload-gib", "inf"), ("--offload-gib", "nan"),
                                         ("--gpu-memory-gib", "inf"), ("--gpu-memory-gib", "nan"),
                                         ("--weights-gib", "nan"), ("--host-ram-gib", "inf")])
def test_non_finite_numbers_are_refused(flag, value):
    result = run("--model", LLAMA, "--gpu", "H100", flag, value)
    assert result.exit_code == 2 and f"{flag} must be a finite number" in result.output


@pytest.mark.parametrize("flag, value, bound", [("--weights-gib", "1e308", "1,048,576"),
                                                ("--overhead-gib", "1e308", "1,048,576"),
                                                ("--gpu-memory-gib", "1e308", "1,048,576"),
                                                ("--offload-gib", "1e308", "1,048,576"),
                                                ("--context", "100000000000", "100,000,000")])
def test_huge_finite_numbers_are_refused(flag, value, bound):
    result = run("--model", LLAMA, "--gpu", "H100", "--sessions", "10", flag, value)
    assert result.exit_code == 2 and f"{flag} must be at most {bound}" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("value", ["1e300", "1048577"])
def test_s3_capacity_past_the_connectors_bound_is_refused(value):
    """1e300 GiB passed --s3-capacity-gib and the connector's s3_capacity_gib alike: a cap that never binds
    (clifix2); both now stop at 1 PiB, the bound of --offload-gib, in the connector's own sentence."""
    from kvtier.core.config import KVTierConfig
    from kvtier.core.errors import ConfigError

    result = run("--model", LLAMA, "--offload-gib", "10", "--s3-bucket", "kv-cache", "--s3-capacity-gib", value)
    assert result.exit_code == 2, result.output
    assert result.output == ("error: --s3-capacity-gib must be at most 1,048,576 GiB (1 PiB); for no cap leave it "
                             "unset (objects then expire by s3_ttl_s or a lifecycle rule).\n")
    with pytest.raises(ConfigError, match="s3_capacity_gib must be at most 1,048,576 GiB"):
        KVTierConfig.from_dict({"s3_bucket": "kv-cache", "s3_capacity_gib": float(value)})
    assert '"s3_capacity_gib":1048576.0' in _json("--model", LLAMA, "--offload-gib", "10", "--s3-bucket", "kv-cache",
                                                  "--s3-capacity-gib", "1048576")["recipe"]["kvtier"]


@pytest.mark.parametrize("value", ["1e300", "inf", "nan", "-1"])
def test_gpu_memory_utilization_names_its_own_range(value):
    """--gpu-memory-utilization 1e300 was told the GiB bound ("at most 1,048,576"), not its range (0, 1]."""
    result = run("--model", LLAMA, "--gpu", "H100", "--gpu-memory-utilization", value)
    assert result.exit_code == 2 and "--gpu-memory-utilization must be in (0, 1], got" in result.output


def test_lmcache_recipe_quotes_paths_and_follows_chunk_tokens():
    data = _json("--model", LLAMA, "--offload-gib", "100", "--host-ram-gib", "40", "--disk-path", "/mnt/my kv",
                 "--chunk-tokens", "512")
    lmcache = data["recipe"]["lmcache"]
    exports = dict(shlex.split(line[len("export "):])[0].split("=", 1)
                   for line in lmcache.splitlines() if line.startswith("export "))
    assert exports["LMCACHE_LOCAL_DISK"] == "file:///mnt/my kv/"
    assert exports["LMCACHE_CHUNK_SIZE"] == "512"
    assert not any("block size" in note for note in data["notes"])


def test_chunk_tokens_off_the_block_grid_are_warned_about():
    data = _json("--model", LLAMA, "--offload-gib", "10", "--chunk-tokens", "200")
    note = next(n for n in data["notes"] if "--chunk-tokens 200" in n)
    assert "16" in note and "128" in note
    data = _json("--model", LLAMA, "--offload-gib", "10", "--chunk-tokens", "64")
    note = next(n for n in data["notes"] if "--chunk-tokens 64" in n)
    assert "128" in note and "16 (" not in note


def test_non_regular_and_oversized_configs_are_refused(tmp_path):
    result = run("--model", "/dev/zero")
    assert result.exit_code == 2 and "not a regular file" in result.output
    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "config.json")
    result = run("--model", str(fifo_dir))
    assert result.exit_code == 2 and "not a regular file" in result.output
    big = tmp_path / "big.json"
    big.write_text('{"pad": "' + "x" * (9 << 20) + '"}')
    result = run("--model", str(big))
    assert result.exit_code == 2 and "larger than" in result.output


def test_a_huge_layer_count_or_deep_nesting_is_one_sentence_and_exit_2(tmp_path):
    """num_hidden_layers 10^20 overflowed building one entry per layer; 100,000 nested objects hit
    Python's recursion limit in the JSON decoder, in kvtier size and kvtier simulate (issue 24)."""
    huge = tmp_path / "huge.json"
    huge.write_text('{"num_hidden_layers": 100000000000000000000, "num_attention_heads": 32, '
                    '"num_key_value_heads": 8, "hidden_size": 4096}')
    result = run("--model", str(huge))
    assert result.exit_code == 2 and "'num_hidden_layers' is 100,000,000,000,000,000,000, more than" in result.output
    deep = tmp_path / "deep.json"
    deep.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    result = run("--model", str(deep))
    assert result.exit_code == 2 and "nested too deeply" in result.output, result.output
    simulate = runner.invoke(app, ["simulate", "--model", str(deep), "--trace", str(huge), "--engine-gib", "1",
                                   "--cpu-gib", "1"], env={"COLUMNS": "200"})
    assert simulate.exit_code == 2 and "nested too deeply" in simulate.output, simulate.output


@pytest.mark.parametrize(("dtype", "hybrid"), [("int3", False), ("bfloat17", True), (16, False)])
def test_an_unknown_torch_dtype_is_refused_in_one_sentence(tmp_path, dtype, hybrid):
    """An unknown ``torch_dtype`` was read as bf16 silently (fresh-operator tester)."""
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 512,
              "torch_dtype": dtype}
    if hybrid:
        config.update({"layer_types": ["full_attention", "linear_attention"] * 2, "linear_num_value_heads": 4,
                       "linear_num_key_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                       "linear_conv_kernel_dim": 4})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = run("--model", str(path))
    assert result.exit_code == 2, result.output
    assert f"field 'torch_dtype' is {dtype!r}, a dtype kvtier size does not know; use one of bfloat16, float16, " \
           "half, float32, float (vLLM's names), or fix the config." in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("dtype", ["float16", "torch.bfloat16", "Float32"])
def test_a_known_torch_dtype_is_read(tmp_path, dtype):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512,
                                "torch_dtype": dtype}))
    assert run("--model", str(path)).exit_code == 0


@pytest.mark.parametrize("tokens", ["0", "16777232", "1000000000000"])
def test_chunk_tokens_out_of_the_connectors_range_is_refused(tokens):
    """--chunk-tokens 10^12 gave a recipe whose chunk_tokens the connector (and kvtier check) refuses."""
    result = run("--model", LLAMA, "--gpu", "H100", "--chunk-tokens", tokens)
    assert result.exit_code == 2, result.output
    assert f"--chunk-tokens must be from 1 to 16,777,216 (longer than any model's context), got {int(tokens):,}." \
        in result.output


def test_gpu_memory_beyond_any_gpu_is_refused_as_a_unit_mistake():
    result = run("--model", "meta-llama/Llama-3.1-8B", "--gpu-memory-gib", "81559", "--context", "8192",
                 "--sessions", "50")
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "--gpu-memory-gib 81,559 is beyond any GPU" in text and "--gpu-memory-gib 79.65" in text, text
    assert "Traceback" not in result.output and "HBM KV budget" not in text
    assert run("--model", "meta-llama/Llama-3.1-8B", "--gpu-memory-gib", "2048").exit_code == 0  # the bound itself
