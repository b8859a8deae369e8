"""The scheduler's chunk-key memo (``KeyMemo``): a request whose prefix was keyed before takes the
keys found again by vLLM's block hashes instead of hashing every chunk again, and gets exactly the
keys BLAKE3 gives (``kvtier.core.keys.chunk_keys``, pinned by tests/core/test_format_vectors.py).

Real vLLM ``Request`` objects with vLLM's own SHA-256 block hasher, and the connector inside vLLM's
real ``Scheduler`` for the wiring (which block size and hash algorithm it reads from vLLM's configs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import kvtier.integrations.vllm.scheduler.requests as requests_module
from kvtier.core.keys import chunk_keys, request_root
from kvtier.integrations.vllm.protocol import KVTierWorkerMeta, RankReport
from kvtier.integrations.vllm.scheduler.requests import RequestChain
from kvtier.integrations.vllm.scheduler.steps import KeyMemo

BLOCK = 16  # vLLM's block (and block-hash) size: a 128-token chunk ends at every 8th block hash
CHUNK = 128
ROOT = bytes(range(16))
PROMPT = list(range(1, 400))  # 3 full chunks


def _request(req_id: str, prompt: list[int] = PROMPT, salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, 0)
    init_none_hash(sha256)
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params, pooling_params=None,
                   mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256), cache_salt=salt)


class CountedChunkKeys:
    """``chunk_keys`` itself, counting the chunks it hashes (the memo's work is what it saves)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.chunks = 0
        real = requests_module.chunk_keys

        def counted(root: bytes, token_ids: Any, chunk_tokens: int) -> Any:
            keys = real(root, token_ids, chunk_tokens)
            self.chunks += len(keys)
            return keys

        monkeypatch.setattr(requests_module, "chunk_keys", counted)


def test_a_repeated_prefix_takes_the_memo_s_keys_which_are_blake3_s(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed = CountedChunkKeys(monkeypatch)
    memo = KeyMemo(BLOCK, CHUNK, "sha256")
    expected = chunk_keys(request_root(ROOT), PROMPT, CHUNK)
    first = _request("a")
    assert RequestChain(first, ROOT, CHUNK, memo).upto(first.all_token_ids, 3) == expected
    assert hashed.chunks == 3 and len(memo) == 3
    again = _request("b")  # a new request, the same prompt: vLLM hashed its blocks again, kvtier does not
    assert RequestChain(again, ROOT, CHUNK, memo).upto(again.all_token_ids, 3) == expected
    assert hashed.chunks == 3
    longer = _request("c", PROMPT + list(range(500, 700)))  # 3 chunks known, 1 more hashed from the 3rd
    keys = RequestChain(longer, ROOT, CHUNK, memo).upto(longer.all_token_ids, 4)
    assert keys == chunk_keys(request_root(ROOT), longer.all_token_ids, CHUNK)[:4]
    assert hashed.chunks == 4 and len(memo) == 4


def test_another_root_never_takes_the_memo_s_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed = CountedChunkKeys(monkeypatch)
    memo = KeyMemo(BLOCK, CHUNK, "sha256")
    first = _request("a")
    RequestChain(first, ROOT, CHUNK, memo).upto(first.all_token_ids, 3)
    # the same vLLM block hashes under another engine namespace's root: hashed, not taken
    other_root = bytes(16)
    same = _request("b")
    assert memo.known(request_root(other_root), same.block_hashes, 0, 3) == []
    keys = RequestChain(same, other_root, CHUNK, memo).upto(same.all_token_ids, 3)
    assert keys == chunk_keys(request_root(other_root), PROMPT, CHUNK) != chunk_keys(request_root(ROOT), PROMPT, CHUNK)
    assert hashed.chunks == 6
    salted = _request("c", salt="tenant-a")  # a cache_salt: its own root
    keys = RequestChain(salted, ROOT, CHUNK, memo).upto(salted.all_token_ids, 3)
    assert keys == chunk_keys(request_root(ROOT, "tenant-a"), PROMPT, CHUNK)
    assert hashed.chunks == 9


def test_the_memo_is_off_for_a_hash_that_is_not_collision_resistant_and_is_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hashed = CountedChunkKeys(monkeypatch)
    for memo in (KeyMemo(BLOCK, CHUNK, "xxhash"), KeyMemo(None, CHUNK, "sha256"), KeyMemo(48, CHUNK, "sha256")):
        assert memo.step == 0
        for req_id in ("a", "b"):
            request = _request(req_id)
            assert RequestChain(request, ROOT, CHUNK, memo).upto(request.all_token_ids, 3) == chunk_keys(
                request_root(ROOT), PROMPT, CHUNK)
        assert len(memo) == 0
    assert hashed.chunks == 18
    small = KeyMemo(BLOCK, CHUNK, "sha256", limit=4)
    for i in range(5):  # 5 distinct 3-chunk prompts
        request = _request(f"p{i}", [t + 1000 * i for t in PROMPT])
        RequestChain(request, ROOT, CHUNK, small).upto(request.all_token_ids, 3)
        assert len(small) <= 4
    newest = _request("again", [t + 4000 for t in PROMPT])  # the last prompt's: the newer half (2) stays
    expected = chunk_keys(request_root(ROOT), newest.all_token_ids, CHUNK)
    assert small.known(request_root(ROOT), newest.block_hashes, 1, 3) == expected[1:3]
    assert small.known(request_root(ROOT), newest.block_hashes, 0, 3) == []


def _scheduler(model: Path, hash_algo: str) -> Scheduler:
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", seed=0, max_model_len=4096),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=4096,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True, prefix_caching_hash_algo=hash_algo),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config={"cpu_gib": 0.05}),
        device_config=DeviceConfig("cpu"))
    config.cache_config.num_gpu_blocks = 200
    kv_cache_config = KVCacheConfig(num_blocks=200, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["model.layers.0.self_attn.attn"],
        FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32))])
    kv_cache_config.hash_block_size = BLOCK  # as vLLM's engine core sets it before building the scheduler
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=True,
                     structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)


@pytest.mark.parametrize(("hash_algo", "memo_step"), [("sha256", CHUNK // BLOCK), ("xxhash", 0)])
def test_the_scheduler_plans_hits_with_memo_keys_from_vllm_s_configs(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch, hash_algo: str, memo_step: int) -> None:
    pytest.importorskip("xxhash")
    hashed = CountedChunkKeys(monkeypatch)
    scheduler = _scheduler(tiny_model, hash_algo)
    side = scheduler.connector.scheduler_side  # type: ignore[union-attr]
    assert side.key_memo.step == memo_step
    keys = chunk_keys(request_root(ROOT), PROMPT, CHUNK)
    step = scheduler.schedule()  # the workers' first report: the 3 chunks in the cpu tier
    scheduler.update_from_output(step, ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                                                         kv_connector_output=KVConnectorOutput(
        kv_connector_worker_meta=KVTierWorkerMeta({0: RankReport(ROOT, [(k, "cpu") for k in keys], True,
                                                                 namespace=b"n" * 16)}))))
    for i, req_id in enumerate(("a", "b")):
        assert scheduler.reset_prefix_cache()  # vLLM's own cache forgets: every prompt is kvtier's full hit
        request = _request(req_id)
        scheduler.add_request(request)
        out = scheduler.schedule()
        load = out.kv_connector_metadata.loads[0]
        assert [p.key for p in load.pages] == keys  # the hit planned from the mirror, under BLAKE3's keys
        assert hashed.chunks == (3 if memo_step else 3 * (i + 1))
        scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        scheduler.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[]))
