"""kvtier size reads the model families vLLM serves as vLLM does (nu5: a new user's configs).

Falcon-7B was sized with 71 KV heads (``multi_query``: vLLM keeps 1) and Falcon-40B with 128
(``num_kv_heads`` 8); GPT-2, GPT-J, Bloom, GPTBigCode, DBRX (``n_layer``/``n_head``/``n_embd``,
``n_layers``/``n_heads``/``d_model``) and ChatGLM (``num_layers``) were refused, and so was
``"num_key_value_heads": null``; a float16 config was labelled "auto (bf16)".  Each config below is
written to disk and read by vLLM's own ``ModelConfig`` (installed vLLM, no engine started) and by
kvtier: KV heads, head size, layers and the dtype ``--dtype auto`` resolves to must agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli.main import app
from kvtier.size.hf_config import auto_dtype, geometry_from_config
from kvtier.size.models import resolve_model
from kvtier.size.presets import find_preset
from tests.size.test_size_hardening import _json

FALCON_7B = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 4544,
             "num_attention_heads": 71, "num_hidden_layers": 32, "multi_query": True,
             "new_decoder_architecture": False, "vocab_size": 65024, "torch_dtype": "bfloat16"}
FALCON_40B = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 8192,
              "num_attention_heads": 128, "num_hidden_layers": 60, "num_kv_heads": 8,
              "new_decoder_architecture": True, "vocab_size": 65024, "torch_dtype": "bfloat16"}
CONFIGS = {
    "falcon-7b": FALCON_7B,
    "falcon-40b": FALCON_40B,
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12,
             "n_positions": 1024, "vocab_size": 50257, "torch_dtype": "float32"},
    "gpt-j": {"architectures": ["GPTJForCausalLM"], "model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_layer": 28,
              "rotary_dim": 64, "vocab_size": 50400, "torch_dtype": "float16"},
    "bloom": {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "n_embed": 1024, "n_head": 16,
              "n_layer": 24, "vocab_size": 250880, "torch_dtype": "float16"},
    "gpt-bigcode": {"architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode", "n_embd": 2048,
                    "n_head": 16, "n_layer": 24, "multi_query": True, "vocab_size": 49152, "bos_token_id": 0,
                    "eos_token_id": 0, "torch_dtype": "float32"},
    "chatglm": {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "hidden_size": 4096,
                "num_attention_heads": 32, "num_layers": 28, "multi_query_attention": True,
                "multi_query_group_num": 2, "kv_channels": 128, "padded_vocab_size": 65024, "torch_dtype": "float16"},
    "dbrx": {"architectures": ["DbrxForCausalLM"], "model_type": "dbrx", "d_model": 6144, "n_heads": 48,
             "n_layers": 40, "attn_config": {"kv_n_heads": 8},
             "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4, "ffn_hidden_size": 10752},
             "vocab_size": 100352, "torch_dtype": "bfloat16"},
    "null-kv-heads": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": None,
                      "head_dim": None, "vocab_size": 32000, "intermediate_size": 11008, "torch_dtype": "bfloat16"},
    "gemma2-float16": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304,
                       "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "num_hidden_layers": 26,
                       "sliding_window": 4096, "vocab_size": 256000, "intermediate_size": 9216,
                       "torch_dtype": "float16"},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kv_heads_head_size_layers_and_dtype_match_vllms_model_config(tmp_path: Path, monkeypatch, name: str):
    pytest.importorskip("vllm")
    import torch
    from vllm.config import ModelConfig, ParallelConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local directory: nothing to ask the hub (20 s of timeouts each)
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name]))
    vllm_model = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), skip_tokenizer_init=True,
                             trust_remote_code=True)
    geometry = geometry_from_config(CONFIGS[name], name)
    assert geometry.num_kv_heads == vllm_model.get_total_num_kv_heads()
    assert geometry.head_dim == vllm_model.get_head_size()
    assert geometry.num_attention_layers == vllm_model.get_num_layers(ParallelConfig(tensor_parallel_size=1))
    assert auto_dtype(CONFIGS[name]) == {torch.bfloat16: "bf16", torch.float16: "fp16"}[vllm_model.dtype]


def test_falcon_40b_is_120_kib_per_token_at_bf16(tmp_path: Path):
    """vLLM's page: 2 (K and V) × 60 layers × 8 KV heads × 64 (8192 / 128) × 2 bytes = 122,880 B per
    token (the new user's figure; before: 128 heads, 16× that); Falcon-7B: 2 × 32 × 1 × 64 × 2."""
    for config, tp, per_token in ((FALCON_40B, "2", 122_880), (FALCON_7B, "1", 8_192)):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        data = _json("--model", str(path), "--tp", tp)
        assert data["kv_bytes_per_token"] == per_token and data["kv_dtype"] == "auto (bf16)"


def test_the_kv_dtype_label_is_what_dtype_auto_resolves_to(tmp_path: Path):
    """A float16 config runs in fp16 under --dtype auto: the label says so (bytes were right before)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIGS["gpt-j"]}))
    assert _json("--model", str(path))["kv_dtype"] == "auto (fp16)"
    assert _json("--model", str(path), "--kv-dtype", "fp8")["kv_dtype"] == "fp8"


def test_simulate_and_audit_read_the_same_families(tmp_path: Path):
    """``simulate --model`` (and audit) share the reader: a GPT-2 config is sized, not refused."""
    from typer.testing import CliRunner

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS["gpt2"]))
    assert resolve_model(str(path), hub=False).geometry.num_kv_heads == 12
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 8,
                                         "hash_ids": [1, 2]}) + "\n" for i in range(4)))
    result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--model", str(path), "--engine-gib", "0",
                                      "--cpu-gib", "0.125"])
    assert result.exit_code == 0, result.output
    assert "36,864 B" in result.output  # 2 × 12 layers × 12 heads × 64 × 2 bytes (float32 runs in bf16)


@pytest.mark.parametrize("alias, preset", [
    ("meta-llama/Llama-3.1-405B", "meta-llama/Llama-3.1-405B-Instruct"),
    ("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B-Instruct"),
    ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct"),
    ("Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-72B-Instruct"),
    ("mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"),
    ("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
    ("Qwen/Qwen3-8B-FP8", "Qwen/Qwen3-8B"),
])
def test_base_and_instruct_models_of_one_geometry_resolve_offline(alias: str, preset: str):
    """These were "not a built-in preset" offline (audit, simulate); each shares its preset's published
    geometry.  The FP8 checkpoint has its own preset: same KV, half the weights."""
    resolved = resolve_model(alias, hub=False)
    same = find_preset(preset)
    assert same is not None and resolved.geometry.kv_bytes_per_token(1, 2) == same.geometry().kv_bytes_per_token(1, 2)
    assert resolved.weights_gib == (same.weights_gib / 2 if alias.endswith("-FP8") else same.weights_gib)
