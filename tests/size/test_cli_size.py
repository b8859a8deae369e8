"""``kvtier size`` end to end through the real CLI entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from tests.size.checkpoints import write_safetensors

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, ["size", *args], env={"COLUMNS": "200"})


def test_json_has_the_issue_keys_and_the_worked_numbers(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "hidden_size": 4096, "torch_dtype": "bfloat16"}))
    result = run("--model", str(cfg), "--gpu-memory-gib", "80", "--weights-gib", "40",
                 "--context", "8192", "--sessions", "200", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kv_bytes_per_token"] == 131072 and data["kv_bytes_per_token_per_rank"] == 131072
    assert data["hbm_kv_tokens"] == 28 * 8192
    # inclusive tiers: the whole warm set × 1.15 (not the how-to's (200 − 28) × 1.15 = 197.8)
    assert data["recommended_offload_gib"] == pytest.approx(230.0)
    assert data["recipe"]["cpu_gib"] == 230


def test_json_nulls_without_gpu():
    data = json.loads(run("--model", "Qwen/Qwen3-8B", "--json").stdout)
    assert data["hbm_kv_tokens"] is None and data["recommended_offload_gib"] is None
    assert data["kv_bytes_per_token"] == 2 * 36 * 8 * 128 * 2


def test_text_output_says_offload_not_needed():
    result = run("--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H200", "--context", "8192",
                 "--sessions", "4")
    assert result.exit_code == 0
    assert "offload not needed" in result.stdout


def test_text_output_prints_three_recipes():
    result = run("--model", "meta-llama/Llama-3.1-70B-Instruct", "--tp", "4", "--gpu", "H100",
                 "--context", "32768", "--sessions", "100", "--host-ram-gib", "2048")
    assert result.exit_code == 0, result.output
    for marker in ("KVTierConnector", "--kv-offloading-size", "LMCACHE_MAX_LOCAL_CPU_SIZE"):
        assert marker in result.stdout


def test_local_weights_come_from_safetensors_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "hidden_size": 256}))
    size = write_safetensors(tmp_path / "model.safetensors", 1 << 20)
    data = json.loads(run("--model", str(tmp_path), "--gpu-memory-gib", "8", "--json").stdout)
    assert data["hbm_kv_tokens"] is not None
    assert data["weights_note"].startswith("sum of") and data["weights_gib"] == size / (1 << 30)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--model", "{cfg_missing}"], "num_hidden_layers"),
        (["--model", "{cfg_bad_json}"], "not a readable JSON"),
        (["--model", "Qwen/Qwen3-8B", "--tp", "3"], "TP 3"),
        (["--model", "Qwen/Qwen3-8B", "--kv-dtype", "int3"], "--kv-dtype"),
        (["--model", "Qwen/Qwen3-8B", "--gpu", "Voodoo5"], "--gpu"),
        (["--model", "not-a-model"], "not an existing path"),
        ([], "--model is required"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, words):
    (tmp_path / "missing.json").write_text(json.dumps({"num_attention_heads": 4, "hidden_size": 64}))
    (tmp_path / "bad.json").write_text("{not json")
    args = [a.format(cfg_missing=tmp_path / "missing.json", cfg_bad_json=tmp_path / "bad.json") for a in args]
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "size", *args], check=False, capture_output=True, text=True)
    assert proc.returncode == 2
    assert words in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_unreachable_hub_is_a_clean_error(monkeypatch):
    env = {"HF_ENDPOINT": "http://127.0.0.1:9"}
    import os
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "size", "--model", "someorg/unknown-model"],
                          check=False, capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
    assert proc.returncode == 2
    assert "hub is unreachable" in proc.stderr and "Traceback" not in proc.stderr


def test_a_hub_that_trickles_config_json_is_a_clean_error_in_time():
    """The hub download has a total deadline (kvtier.tools.httpget): headers then a byte every 0.2 s
    (tests/bench/sse_server.py --trickle) end in one sentence, not a wait without end."""
    import os
    import time
    from pathlib import Path

    import httpx

    from kvtier.launch.serve import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, str(Path(__file__).parent.parent / "bench" / "sse_server.py"), str(port),
                               "--trickle", "/someorg/slow-model/resolve/main/config.json"])
    try:
        for _ in range(200):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "size", "--model", "someorg/slow-model"],
                              check=False, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    finally:
        server.kill()
        server.wait()
    assert proc.returncode == 2, proc.stderr
    assert "hub is unreachable or too slow" in proc.stderr and "within 10 s" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_list_presets_and_help_show_examples():
    assert "deepseek-ai/DeepSeek-V3" in run("--list-presets").stdout
    help_text = run("--help").stdout
    assert "Examples" in help_text and "kvtier size --model" in help_text


@pytest.mark.parametrize("args, wanted", [
    ([], ["--context TOKENS", "--sessions N"]),
    (["--context", "8192"], ["--sessions N"]),
])
def test_without_a_tier_size_it_says_what_to_add(tmp_path, args, wanted):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "hidden_size": 4096, "torch_dtype": "bfloat16"}))
    result = run("--model", str(cfg), "--gpu-memory-gib", "80", "--weights-gib", "40", *args, "--json")
    assert result.exit_code == 0, result.output
    (note,) = [n for n in json.loads(result.stdout)["notes"] if n.startswith("No offload tier size")]
    assert all(flag in note for flag in wanted) and ("--context" in note) == ("--context" not in args)


def test_redis_url_adds_the_shared_tier_and_sizes_the_server():
    result = run("--model", "Qwen/Qwen3-8B", "--offload-gib", "100", "--host-ram-gib", "512",
                 "--redis-url", "rediss://kv.internal:6380/0", "--json")
    assert result.exit_code == 0, result.output
    recipe = json.loads(result.stdout)["recipe"]
    config = json.loads(recipe["kvtier"].split("--kv-transfer-config ", 1)[1].strip("'"))
    extra = config["kv_connector_extra_config"]
    assert extra["redis_url"] == "rediss://kv.internal:6380/0" and extra["shared_secret_file"]
    assert recipe["redis_maxmemory_gib"] == 105  # the 100 GiB tier + 5% for headers and keys
    assert "--maxmemory 105gb --maxmemory-policy allkeys-lru" in recipe["redis"]
    from kvtier.core.config import KVTierConfig

    KVTierConfig.from_dict(extra)  # the recipe is a config the connector accepts


@pytest.mark.parametrize("url", ["http://kv:6379", "redis://:hunter2@kv:6379/0"])
def test_bad_redis_url_is_one_sentence(url):
    result = run("--model", "Qwen/Qwen3-8B", "--offload-gib", "10", "--redis-url", url)
    assert result.exit_code == 2 and "--redis-url" in result.output and "Traceback" not in result.output
    assert "hunter2" not in result.output


@pytest.mark.parametrize("url", ["redis://r:99999/0", "redis://r:abc/0", "redis://r:0/0", "redis://r:6379/db"])
def test_a_redis_url_the_connector_refuses_is_refused_before_any_recipe(url):
    """The recipe's redis_url passes the connector's own rule, so `kvtier check` accepts what `size`
    prints (second fresh-eyes pass: port 99999 went into the recipe, exit 0)."""
    result = run("--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--offload-gib", "10", "--redis-url", url)
    assert result.exit_code == 2 and "error: --redis-url's" in result.output and "{" not in result.output
    assert "redis_url" not in result.output  # the flag the user typed, not the config key


@pytest.mark.parametrize("path", ["", "relative/dir"])
def test_a_disk_path_that_is_not_absolute_is_refused(path):
    result = run("--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--offload-gib", "100", "--host-ram-gib",
                 "20", "--disk-path", path)
    assert result.exit_code == 2 and "--disk-path must be an absolute directory" in result.output


def test_s3_bucket_adds_the_object_store_tier_with_its_modeled_chunk_load():
    """The recipe names the bucket and endpoint (never a credential), expires objects without a cap, and
    models one chunk's load from the tier's registry record (latency + bytes / bandwidth)."""
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.registry import settings_keys, spec
    from kvtier.integrations.vllm.preflight import check_transfer_config

    result = run("--model", "meta-llama/Llama-3.1-8B", "--offload-gib", "64", "--s3-bucket", "kv-cache",
                 "--s3-endpoint-url", "https://minio.example:9000", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    recipe = report["recipe"]
    transfer = json.loads(recipe["kvtier"].split("--kv-transfer-config ", 1)[1].strip("'"))
    extra = transfer["kv_connector_extra_config"]
    assert extra["s3_bucket"] == "kv-cache" and extra["s3_endpoint_url"] == "https://minio.example:9000"
    assert extra["s3_ttl_s"] == 7 * 86400 and extra["shared_secret_file"] and "s3_capacity_gib" not in extra
    assert not any("key" in k and "access" in k for k in extra)
    KVTierConfig.from_dict(extra)  # a config the connector accepts
    assert [p for p in check_transfer_config(transfer, host_checks=False) if p.severity == "error"] == []
    model = spec(settings_keys()["s3_bucket"]).model
    assert model is not None
    chunk_bytes = 128 * report["kv_bytes_per_token"]
    assert recipe["object_store_chunk_ms"] == pytest.approx(model.latency_ms + chunk_bytes / model.gb_per_s / 1e6,
                                                            abs=0.1)
    assert "lifecycle rules" in recipe["object_store"] and "AWS_SECRET_ACCESS_KEY" in recipe["object_store"]
    capped = run("--model", "meta-llama/Llama-3.1-8B", "--offload-gib", "64", "--s3-bucket", "kv-cache",
                 "--s3-capacity-gib", "2048", "--json")
    extra = json.loads(json.loads(capped.stdout)["recipe"]["kvtier"].split("--kv-transfer-config ", 1)[1]
                       .strip("'"))["kv_connector_extra_config"]
    assert extra["s3_capacity_gib"] == 2048 and "s3_ttl_s" not in extra and "s3_endpoint_url" not in extra
    text = run("--model", "meta-llama/Llama-3.1-8B", "--offload-gib", "64", "--s3-bucket", "kv-cache")
    assert "object-store tier: the bucket" in text.output and "modeled: one chunk" in text.output


@pytest.mark.parametrize("args, words", [
    (("--s3-bucket", "KV_Cache"), "--s3-bucket"),
    (("--s3-bucket", "kv-cache", "--s3-endpoint-url", "ftp://minio:9000"), "--s3-endpoint-url must start with"),
    (("--s3-bucket", "kv-cache", "--s3-endpoint-url", "https://AKIAEXAMPLE:wJalrXUtnFEMI@minio:9000"),
     "--s3-endpoint-url must not carry credentials"),
    (("--s3-bucket", "kv-cache", "--s3-capacity-gib", "-1"), "--s3-capacity-gib"),
    (("--s3-capacity-gib", "100"), "--s3-capacity-gib needs --s3-bucket BUCKET"),
])
def test_bad_s3_flags_are_one_sentence_naming_the_flag(args, words):
    result = run("--model", "meta-llama/Llama-3.1-8B", "--offload-gib", "10", *args)
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output
    assert "wJalrXUtnFEMI" not in result.output and "s3_endpoint_url" not in result.output
    assert "s3_capacity_gib" not in result.output and "s3_allow_http" not in result.output


def test_gpu_a100_says_which_part_it_assumes():
    """--gpu A100 silently sized an 80 GB part: on an A100-40GB that is a budget twice too big and an
    offload tier too small; the alias now says so (tester3)."""
    alias = run("--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "a100", "--json")
    assert alias.exit_code == 0, alias.output
    doc = json.loads(alias.stdout)
    assert ("--gpu a100 read as A100-80GB (80 GiB); give the exact part (--gpu A100-80GB or A100-40GB) or "
            "--gpu-memory-gib if yours differs.") in doc["notes"]
    exact = json.loads(run("--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "A100-80GB", "--json").stdout)
    assert exact["hbm_kv_tokens"] == doc["hbm_kv_tokens"]
    assert not [n for n in exact["notes"] if "read as" in n]
    small = json.loads(run("--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "A100-40GB", "--json").stdout)
    assert small["hbm_kv_tokens"] < doc["hbm_kv_tokens"]


def test_a_compressing_disk_tier_stores_the_planned_chunks_in_one_rth_of_the_bytes():
    """Issue 36 item 5: with --compression-ratio disk=R the disk tier's chunks (the same plan as
    without) take 1/R of the GiB, in the table, the JSON and the recipe, and the note names R's
    source (a codec: docs/benchmarks.md's measured ratio)."""
    base = ("--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--context", "32768", "--sessions", "400",
            "--host-ram-gib", "256", "--nvme-gib", "4000", "--json")
    plain = json.loads(run(*base).stdout)
    assert plain["disk_gib"] > 100
    for value, ratio, source in (("disk=blosc2-zstd-shuffle2:2", 2.0, "as given"),
                                 ("disk=blosc2-zstd-shuffle2", 1.451, "docs/benchmarks.md")):
        result = run(*base, "--compression-ratio", value)
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["cpu_gib"] == plain["cpu_gib"]
        assert data["disk_gib"] == pytest.approx(plain["disk_gib"] / ratio, abs=0.01)
        assert data["recommended_offload_gib"] == pytest.approx(plain["cpu_gib"] + data["disk_gib"], abs=0.02)
        assert data["recipe"]["disk_gib"] < plain["recipe"]["disk_gib"]
        assert any(f"{ratio:g}× the chunks" in n and source in n for n in data["notes"]), data["notes"]
        # only kvtier runs the codec: its recipe enables it; LMCache's disk keeps the uncompressed GiB
        extra = json.loads(data["recipe"]["kvtier"].split("--kv-transfer-config ", 1)[1].strip("'"))
        assert extra["kv_connector_extra_config"]["codecs"] == {"disk": ["blosc2-zstd-shuffle2"]}
        assert extra["kv_connector_extra_config"]["disk_gib"] == data["recipe"]["disk_gib"]
        assert f"LMCACHE_MAX_LOCAL_DISK_SIZE={plain['recipe']['disk_gib']}" in data["recipe"]["lmcache"]
    assert "codecs" not in plain["recipe"]["kvtier"]


def test_lmcaches_uncompressed_disk_never_exceeds_the_nvme():
    """With the NVMe the bound, the compressing kvtier disk holds R× its bytes of chunks; LMCache
    (no kvtier codec) was given those R× GiB uncompressed (1,819 GiB on a 1,000 GiB NVMe)."""
    args = ("--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--sessions", "2000", "--context", "32000",
            "--host-ram-gib", "512", "--nvme-gib", "1000", "--compression-ratio", "disk=blosc2-zstd-shuffle2:2")
    data = json.loads(run(*args, "--json").stdout)
    lmcache_gib = int(data["recipe"]["lmcache"].split("LMCACHE_MAX_LOCAL_DISK_SIZE=", 1)[1].split()[0])
    assert data["disk_gib"] == pytest.approx(1000 / 1.1, abs=0.01)  # kvtier's stored bytes: the usable NVMe
    assert lmcache_gib == 909
    text = run(*args).output  # the note's codec list is printed as written, not eaten as rich markup
    assert "codecs {disk: [blosc2-zstd-shuffle2]}" in " ".join(text.split())


@pytest.mark.parametrize("value", ["disk=0.99", "disk=inf", "s3=2", "2", "disk=2", "disk=blosc2-zstd-shuffle2:0.5",
                                   "disk=zstd"])
def test_a_bad_compression_ratio_is_one_sentence(value):
    """A bare disk=R names no codec: no recipe could carry it, so size refuses it (it halved LMCache's disk too)."""
    result = run("--model", "Qwen/Qwen3-8B", "--compression-ratio", value)
    assert result.exit_code == 2 and "--compression-ratio" in result.output and "Traceback" not in result.output


def test_the_redis_server_holds_the_whole_tier_uncompressed_beside_a_compressing_disk_tier():
    """--compression-ratio disk=CODEC stores kvtier's disk tier in 1/R of its GiB, but the codec chain names
    the disk tier only: Redis gets every chunk uncompressed.  Its maxmemory was (cpu + compressed disk) × 1.05
    (782 GiB for a 1,000 GiB tier at R 1.451: a quarter of the warm set left out; tools tester)."""
    result = run("--model", "meta-llama/Llama-3.1-70B", "--tp", "4", "--gpu", "H100", "--offload-gib", "1000",
                 "--host-ram-gib", "256", "--nvme-gib", "2000", "--disk-gb-per-s", "40",
                 "--compression-ratio", "disk=blosc2-zstd-shuffle2", "--redis-url", "redis://10.0.0.7:6379/0", "--json")
    assert result.exit_code == 0, result.output
    recipe = json.loads(result.stdout)["recipe"]
    extra = json.loads(recipe["kvtier"].split("--kv-transfer-config ", 1)[1].strip("'"))["kv_connector_extra_config"]
    assert extra["codecs"] == {"disk": ["blosc2-zstd-shuffle2"]} and "redis" not in extra["codecs"]
    assert (extra["cpu_gib"], extra["disk_gib"]) == (176, 568)  # 824 GiB of chunks on disk, stored in 824 / 1.451
    assert recipe["redis_maxmemory_gib"] == 1050  # (176 + 824) × 1.05
    assert "--maxmemory 1050gb " in recipe["redis"]


@pytest.mark.parametrize("kv_dtype, flag", [("fp8", "fp8"), ("fp8_e4m3", "fp8_e4m3"), ("auto", None), ("bf16", None)])
def test_every_serve_line_runs_the_kv_dtype_the_sizes_assume(kv_dtype, flag):
    """--kv-dtype fp8 sized 1-byte KV (64 KiB a token for Llama-3.1-8B) but the serve lines left vLLM at
    --kv-cache-dtype auto, its model's bf16: twice the bytes, half the tokens in HBM and in every tier
    (tools tester).  The flag's value is one vLLM's CacheConfig takes (vllm/config/cache.py CacheDType)."""
    from typing import get_args

    from vllm.config.cache import CacheDType

    result = run("--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--kv-dtype", kv_dtype, "--offload-gib", "100",
                 "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    lines = [line for text in (report["recipe"]["kvtier"], report["recipe"]["vllm_native"], report["recipe"]["lmcache"])
             for line in text.splitlines() if "vllm serve" in line]
    assert len(lines) == 3
    for line in lines:
        if flag is None:
            assert "--kv-cache-dtype" not in line, line
        else:
            assert f" --kv-cache-dtype {flag} " in line, line
            assert flag in get_args(CacheDType)
    assert report["kv_bytes_per_token"] == (65536 if flag else 131072)


def test_an_offload_gib_split_whose_disk_tier_is_not_above_the_cpu_tier_says_the_cache_is_the_cpu_tier():
    """--offload-gib 300 on 256 GiB of host RAM at TP 4: 176 GiB of DRAM and 124 GiB of disk, "recommended 300",
    while docs/size.md § Inclusive tiers says a write-through disk tier holds the cpu tier's most recent chunks,
    so a smaller one adds nothing and the cache is 176 GiB (tools tester)."""
    def notes(offload: str) -> list[str]:
        result = run("--model", "meta-llama/Llama-3.1-70B", "--tp", "4", "--gpu", "H100", "--offload-gib", offload,
                     "--host-ram-gib", "256", "--json")
        assert result.exit_code == 0, result.output
        return [n for n in json.loads(result.stdout)["notes"] if "is no larger than the cpu tier" in n]

    (note,) = notes("300")
    assert note.startswith("The disk tier (124 GiB) is no larger than the cpu tier (176 GiB)")
    assert note.endswith("the cache is 176 GiB, not 300.")
    assert notes("500") == []  # 324 GiB of disk behind 176 of DRAM: the cache is 324 GiB


def test_a_tier_at_the_bound_rounded_to_whole_gib_per_rank_stays_a_size_the_connector_takes(tmp_path):
    """--offload-gib 1048576 (size's bound, the connector's) at TP 3 printed cpu_gib 1048578 (rounded up to
    whole GiB on each rank), which the connector refuses as "looks like bytes" (tools tester)."""
    from kvtier.core.config import KVTierConfig

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 24, "num_key_value_heads": 6,
                               "hidden_size": 1536, "torch_dtype": "bfloat16"}))
    result = run("--model", str(cfg), "--tp", "3", "--gpu-memory-gib", "80", "--weights-gib", "1",
                 "--offload-gib", "1048576", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    extra = json.loads(report["recipe"]["kvtier"].split("--kv-transfer-config ", 1)[1].strip("'"))[
        "kv_connector_extra_config"]
    assert extra["cpu_gib"] == 1048575  # 349,525 GiB on each of 3 ranks
    assert KVTierConfig.from_dict(extra).cpu_gib == 1048575
    assert not [n for n in report["notes"] if "kvtier-config-invalid" in n], report["notes"]


def test_a_chunk_the_default_block_sizes_do_not_divide_is_one_the_connector_refuses_as_check_says():
    """size's note said such chunks "will not line up with vLLM blocks", as if they ran misaligned, while
    kvtier check and the connector refuse them (KVTierConfig.validate_block_size; tools tester)."""
    from kvtier.core.config import KVTierConfig
    from kvtier.core.errors import ConfigError

    result = run("--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--chunk-tokens", "100", "--offload-gib", "100",
                 "--json")
    assert result.exit_code == 0, result.output
    (note,) = [n for n in json.loads(result.stdout)["notes"] if n.startswith("--chunk-tokens 100")]
    assert "the connector refuses it at start-up" in note and "unless the server's --block-size divides it" in note
    with pytest.raises(ConfigError):
        KVTierConfig.from_dict({"chunk_tokens": 100}).validate_block_size(16)
