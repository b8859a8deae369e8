"""``kvtier-cpu-tier-below-one-chunk`` (tools tester): ``kvtier size --model meta-llama/Llama-3.1-8B
--chunk-tokens 1048576 --offload-gib 10`` printed a kvtier recipe with ``cpu_gib`` 10, and ``kvtier audit``
of that line (the model known) only repeated ``check``'s model-blind warning about "a model as small as
Qwen2.5-0.5B", while the connector refuses it at start-up: one chunk of Llama-3.1-8B is 128 GiB.  The rule
is judged against the connector's own start-up check (:func:`kvtier.core.sizing.cpu_capacity_bytes`)."""

from __future__ import annotations

import pytest

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.sizing import cpu_capacity_bytes
from kvtier.size.models import resolve_model
from tests.audit.test_rules import _findings_on, kvtier_line

RULE = "kvtier-cpu-tier-below-one-chunk"
MODEL = "meta-llama/Llama-3.1-8B"


def _line(tp: int, extra_flags: str = "", **extra: object) -> str:
    return kvtier_line(**extra).replace("vllm serve m ", f"vllm serve {MODEL} --tensor-parallel-size {tp} {extra_flags} ")


@pytest.mark.parametrize("tp, cpu_gib, chunk_tokens, flags, fires", [
    (1, 10, 1048576, "", True),       # 128 GiB a chunk
    (1, 128, 1048576, "", False),     # exactly one chunk: the connector takes it
    (2, 127, 1048576, "", True),      # 63.5 GiB a rank against a 64 GiB shard of the chunk
    (1, 64, 1048576, "--kv-cache-dtype fp8", False),  # 1-byte KV: 64 GiB a chunk
    (1, 0.01, "auto", "", True),      # auto: at least 128 tokens, 16 MiB
    (1, 0.02, "auto", "", False),
])
def test_the_rule_refuses_what_the_connector_refuses(tp, cpu_gib, chunk_tokens, flags, fires):
    found = _findings_on(_line(tp, flags, cpu_gib=cpu_gib, chunk_tokens=chunk_tokens), None)
    assert (RULE in found) is fires, found
    geometry = resolve_model(MODEL, hub=False).geometry
    tokens = 128 if chunk_tokens == "auto" else chunk_tokens
    chunk = tokens * geometry.kv_bytes_per_token_per_rank(tp, 1 if "fp8" in flags else 2)
    config = KVTierConfig.from_dict({"cpu_gib": cpu_gib, "chunk_tokens": chunk_tokens})
    if fires:
        assert "so the connector refuses to start" in found[RULE]
        with pytest.raises(ConfigError, match="less than one chunk"):
            cpu_capacity_bytes(config, chunk, tp)
    else:
        assert config.cpu_bytes_per_rank(tp) >= chunk


def test_a_model_the_audit_does_not_know_is_left_to_checks_warning():
    found = _findings_on(kvtier_line(cpu_gib=10, chunk_tokens=1048576), None)
    assert RULE not in found and "kvtier-config-warning" in found, found


LMCACHE_LINE = ("LMCACHE_LOCAL_CPU=True LMCACHE_MAX_LOCAL_CPU_SIZE={cpu} {disk}vllm serve meta-llama/Llama-3.1-70B "
                "--tensor-parallel-size 8 --kv-transfer-config '{{\"kv_connector\":\"LMCacheConnectorV1\",\"kv_role\":\"kv_both\"}}'")


@pytest.mark.parametrize("cpu, disk, fires", [
    (51, "", True),     # 408 GiB over 8 ranks: the rule-of-thumb tier, half the engine's 847 GiB
    (238, "", False),   # 1,904 GiB: kvtier size's tier
    (4, "LMCACHE_LOCAL_DISK=file:///nvme/ LMCACHE_MAX_LOCAL_DISK_SIZE=693 ", False),  # staging before 5,544 GiB
])
def test_the_engine_cache_rule_judges_lmcaches_per_rank_sizes_as_the_other_dialects(cpu, disk, fires):
    """kvtier size prints one tier in three dialects; with --offload-gib below the engine's KV cache the audit
    flagged the kvtier and vLLM-native lines and never the LMCache one (sizes per rank in its environment)."""
    found = _findings_on(LMCACHE_LINE.format(cpu=cpu, disk=disk), "H200")
    assert ("cpu-tier-not-above-engine-cache" in found) is fires, found
    native = _findings_on(f"vllm serve meta-llama/Llama-3.1-70B --tensor-parallel-size 8 --kv-offloading-backend native "
                          f"--kv-offloading-size {cpu * 8}", "H200")
    if not disk:
        assert ("cpu-tier-not-above-engine-cache" in native) is fires
    if fires:
        assert found["cpu-tier-not-above-engine-cache"].startswith(
            "LMCache's LMCACHE_MAX_LOCAL_CPU_SIZE 51 × 8 rank(s) = 408 GiB is not larger than the engine's KV cache of 847")
