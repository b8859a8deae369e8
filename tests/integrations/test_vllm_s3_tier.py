"""An engine configured with cpu + s3 tiers (no disk): a real vLLM process, a real ``rclone serve s3``.

Engine A serves a prompt twice: the first time computes it (and saves every chunk to S3), the
second is served by vLLM's own prefix cache: the reference.  Engine B, started afterwards (a
restart: its own empty cpu tier, nothing but the bucket in common), serves the same prompt first:
loaded from S3, with the tokens and logprobs of A's prefix-cache hit exactly (equal compute
threads, same KV bytes), counted as a hit by kvtier and by vLLM.
"""

from __future__ import annotations

from pathlib import Path

import obstore
import pytest

from tests.core.tier_harness import s3_credentials_file
from tests.integrations.vllm_helpers import PROMPT_WORDS, result_of, run_engine

pytestmark = pytest.mark.engine

LOADABLE = 6 * 64
# vLLM reserves one more core when a connector is set: pin it, so that every engine compared runs
# its forward passes on the same number of threads.
EQUAL_THREADS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def test_a_restarted_engine_serves_its_first_request_from_s3_exactly(tiny_model: Path, tmp_path: Path,
                                                                     s3_server) -> None:
    from kvtier.launch.testmodel import random_prompt

    bucket = s3_server.make_bucket()
    prompt = random_prompt(740, PROMPT_WORDS)
    kvtier = {"chunk_tokens": 64, "cpu_gib": 0.01, "tiers": ["cpu", "s3"], "s3_bucket": bucket,
              "s3_endpoint_url": s3_server.url, "s3_allow_http": True,
              "s3_credentials_file": str(s3_credentials_file(tmp_path, s3_server)),
              "shared_deadline_s": 5.0, "shared_transfer_deadline_s": 10.0}
    gen = {"op": "generate", "prompts": [prompt]}
    made = result_of(run_engine({"model": str(tiny_model), "steps": [gen, gen], "kvtier": kvtier},
                                tmp_path, "a", env=EQUAL_THREADS), tmp_path, "a")
    saved = made["metrics"]["kvtier_saved_tokens_total"]
    assert saved >= LOADABLE  # the prompt's chunks (and any the generated tokens completed)
    assert made["metrics"]["vllm:external_prefix_cache_hits_total"] == 0  # the second was vLLM's own hit
    listed = [m for page in obstore.list(s3_server.client(bucket)) for m in page]
    assert len(listed) == saved // 64  # one object per saved chunk (TP 1)

    served = result_of(run_engine({"model": str(tiny_model), "steps": [gen], "kvtier": kvtier},
                                  tmp_path, "b", env=EQUAL_THREADS), tmp_path, "b")
    (_computed,), (cached,) = made["results"]
    ((restarted,),) = served["results"]
    assert restarted["tokens"] == cached["tokens"]
    assert restarted["logprobs"] == cached["logprobs"]  # exact: same KV bytes, same compute threads
    end = served["metrics"]
    assert end["kvtier_loaded_tokens_total{s3}"] == LOADABLE
    assert end["vllm:external_prefix_cache_hits_total"] == LOADABLE
    assert end["kvtier_load_failed_blocks_total"] == 0
    assert end["kvtier_shared_lookup_hit_chunks_total"] == LOADABLE // 64
