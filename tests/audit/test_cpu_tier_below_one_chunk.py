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
