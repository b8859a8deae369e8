"""An engine configured with the shared redis tier (real vLLM process, real redis-server).

Today the connector writes to the shared tier (write-through) but does not yet look it up
(docs/shared-tier.md § Status in the vLLM connector); this test pins what holds now: the engine
serves normally, and every chunk it saved is in Redis as one verifiable kvtier value.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.core.tiers.sharedvalue import HEADER_BYTES, ValueCodec
from tests.integrations.vllm_helpers import PROMPT_WORDS, result_of, run_engine

pytestmark = pytest.mark.engine

LOADABLE = 6 * 64


def test_engine_writes_every_saved_chunk_to_redis(tiny_model: Path, tmp_path: Path, redis_server, key_prefix) -> None:
    from kvtier.integrations.vllm.testmodel import random_prompt

    prompts = [random_prompt(700 + i, PROMPT_WORDS) for i in range(2)]
    spec = {"model": str(tiny_model), "role": "kv_both", "steps": [{"op": "generate", "prompts": prompts}],
            "kvtier": {"chunk_tokens": 64, "cpu_gib": 0.01, "redis_url": redis_server.url,
                       "redis_key_prefix": key_prefix, "shared_deadline_s": 5.0, "redis_timeout_s": 5.0}}
    out = result_of(run_engine(spec, tmp_path, "redis"), tmp_path, "redis")
    assert out["metrics"]["kvtier_saved_tokens_total"] == 2 * LOADABLE
    assert all(r["tokens"] for r in out["results"][0])
    client = redis_server.client()
    keys = list(client.scan_iter(match=f"{key_prefix}*".encode(), count=1000))
    assert len(keys) == 2 * 6  # one value per saved chunk (TP 1: one namespace)
    for rk in keys:
        value = client.get(rk)
        namespace, key = value[8:24], bytes.fromhex(rk.decode().rsplit(":", 1)[1])
        assert rk.decode().startswith(f"{key_prefix}{namespace.hex()}:")
        decoded = ValueCodec(namespace, None).decode(key, value, len(value))  # raises unless it verifies
        assert decoded.length == len(value) - HEADER_BYTES > 0
