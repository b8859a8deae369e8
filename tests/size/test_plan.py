"""HBM budget, the (warm set − HBM) × 1.15 recommendation, host-RAM check, and the three recipes."""

from __future__ import annotations

import json
import shlex

import pytest

from kvtier.core.errors import UserError
from kvtier.size.hf_config import geometry_from_config
from kvtier.size.plan import Deployment, hbm_kv_budget_bytes, plan
from kvtier.size.presets import find_preset
from kvtier.size.recipe import build_recipe, round_total

GIB = 1 << 30
LLAMA = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}


def test_howto_worked_example_80gb_card_40gb_weights_200_warm_8k_sessions():
    # how-to § "The sizing math": 80 GB × 0.90 − 40 GB weights − a few GB ≈ 28 GB of KV.  Its tier,
    # (200 − 28) × 1.15 ≈ 198, assumes tiers that do not repeat the engine's; kvtier's are inclusive
    # (every computed chunk is stored), so the cpu tier must hold the whole warm set: 200 × 1.15.
    dep = Deployment(gpu_memory_gib=80, gpu_memory_utilization=0.9, weights_gib=40, overhead_gib=4,
                     context_tokens=8192, sessions=200)
    report = plan(geometry_from_config(LLAMA, "m"), dep)
    assert report.hbm_kv_budget_bytes == 28 * GIB
    assert report.hbm_kv_tokens == 28 * 8192
    assert report.hbm_sessions == 28
    assert report.warm_set_bytes == 200 * GIB
    assert report.recommended_offload_gib == pytest.approx(200 * 1.15)
    assert report.cpu_gib == pytest.approx(200 * 1.15) and report.cpu_gib > 28
    assert report.offload_needed is True


def test_recommendation_floors_at_zero_and_says_offload_not_needed():
    dep = Deployment(gpu_memory_gib=80, weights_gib=40, context_tokens=8192, sessions=10)
    report = plan(geometry_from_config(LLAMA, "m"), dep)
    assert report.recommended_offload_gib == 0.0
    assert report.offload_needed is False
    assert any("Offload not needed" in n for n in report.notes)


def test_tp_splits_weights_and_multiplies_the_budget():
    dep = Deployment(tp=4, gpu_memory_gib=80, gpu_memory_utilization=0.9, weights_gib=140, overhead_gib=4)
    assert hbm_kv_budget_bytes(dep) == int((72 - 35 - 4) * GIB) * 4


def test_weights_larger_than_hbm_leave_a_zero_budget():
    dep = Deployment(gpu_memory_gib=24, weights_gib=140)
    assert hbm_kv_budget_bytes(dep) == 0


def test_unknown_gpu_leaves_the_recommendation_null():
    report = plan(geometry_from_config(LLAMA, "m"), Deployment(context_tokens=8192, sessions=10))
    assert report.hbm_kv_tokens is None and report.recommended_offload_gib is None
    assert any("--gpu" in n for n in report.notes)


def test_host_ram_too_small_moves_the_rest_to_disk():
    """The cpu tier takes the usable DRAM; a write-through disk tier holds the whole warm set (inclusive)."""
    dep = Deployment(gpu_memory_gib=80, weights_gib=40, context_tokens=8192, sessions=200,
                     host_ram_gib=128, host_reserve_gib=16, nvme_gib=1000)
    report = plan(geometry_from_config(LLAMA, "m"), dep)
    assert report.cpu_gib == 112
    assert report.disk_gib == pytest.approx(200 * 1.15, abs=0.01)


def test_host_ram_large_enough_keeps_everything_in_dram():
    dep = Deployment(gpu_memory_gib=80, weights_gib=40, context_tokens=8192, sessions=200, host_ram_gib=1024)
    report = plan(geometry_from_config(LLAMA, "m"), dep)
    assert report.cpu_gib == report.recommended_offload_gib and report.disk_gib == 0


def test_replication_note_when_tp_exceeds_kv_heads():
    g = find_preset("deepseek-ai/DeepSeek-V3").geometry()
    report = plan(g, Deployment(tp=8))
    assert report.kv_bytes_per_token == 8 * report.kv_bytes_per_token_tp1
    assert any("replicated" in n for n in report.notes)


@pytest.mark.parametrize("bad", [Deployment(gpu_memory_utilization=1.5), Deployment(weights_gib=-1),
                                 Deployment(sessions=0), Deployment(tp=0)])
def test_bad_deployment_values_are_user_errors(bad):
    with pytest.raises(UserError):
        plan(geometry_from_config(LLAMA, "m"), bad)


def test_round_total_gives_each_rank_whole_gib():
    assert round_total(197.8, 1) == 198
    assert round_total(197.8, 8) == 200
    assert round_total(0.0, 8) == 0


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_three_dialects_state_the_same_total(tp):
    recipe = build_recipe("org/model", tp, cpu_gib=197.8, disk_gib=500, disk_path="/nvme/kv")  # disk above cpu: no warning
    total = round_total(197.8, tp)
    # kvtier: JSON inside --kv-transfer-config, sizes are totals
    args = shlex.split(recipe.kvtier.replace("\\\n", " "))
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVTierConnector"
    assert config["kv_load_failure_policy"] == "recompute"  # a failed kvtier load is recomputed, not an error
    from kvtier.integrations.vllm.preflight import check_transfer_config
    assert check_transfer_config(config, host_checks=False) == []  # the connector's pre-flight accepts it
    extra = config["kv_connector_extra_config"]
    assert extra["cpu_gib"] == total and extra["disk_gib"] == round_total(500, tp)
    assert extra["disk_path"] == "/nvme/kv" and extra["chunk_tokens"] == 128
    # vLLM native: --kv-offloading-size is the TP-wide total
    native = shlex.split(recipe.vllm_native.split("\n#")[0].replace("\\\n", " "))
    assert float(native[native.index("--kv-offloading-size") + 1]) == total
    assert ("--tensor-parallel-size" in native) == (tp > 1)
    # LMCache: per-rank size × TP equals the same total
    env = dict(line.removeprefix("export ").split("=", 1) for line in recipe.lmcache.splitlines()
               if line.startswith("export "))
    assert float(env["LMCACHE_MAX_LOCAL_CPU_SIZE"]) * tp == total
    assert env["LMCACHE_ENABLE_ASYNC_LOADING"] == "False"


def test_the_kvtier_recipe_stops_gracefully():
    # without --shutdown-timeout vLLM 0.32 force-kills the engine core on SIGTERM: no flush to disk
    from kvtier.core.config import KVTierConfig
    from kvtier.size.recipe import SHUTDOWN_TIMEOUT_S

    recipe = build_recipe("org/model", 2, cpu_gib=64, disk_gib=500, disk_path="/nvme/kv")
    args = shlex.split(recipe.kvtier.replace("\\\n", " "))
    timeout_s = int(args[args.index("--shutdown-timeout") + 1])
    assert timeout_s == SHUTDOWN_TIMEOUT_S >= KVTierConfig.model_fields["shutdown_flush_s"].default
