"""KV bytes per token and per sequence for every layer kind, checked against hand arithmetic."""

from __future__ import annotations

import pytest

from kvtier.core.errors import UserError
from kvtier.size.geometry import KVGeometry
from kvtier.size.hf_config import geometry_from_config
from kvtier.size.presets import PRESETS, find_preset

GIB = 1 << 30


def llama8b() -> KVGeometry:
    return geometry_from_config(
        {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096},
        "llama-like",
    )


def test_worked_check_from_the_howto_128_kib_per_token_and_1_gib_per_8k_session():
    g = llama8b()
    assert g.kv_bytes_per_token(tp=1, dtype_bytes=2) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert g.bytes_per_sequence(8192, tp=1, dtype_bytes=2) == GIB


def test_fp8_halves_the_bytes():
    g = llama8b()
    assert g.kv_bytes_per_token(1, 1) * 2 == g.kv_bytes_per_token(1, 2)


def test_tp_splits_heads_per_rank_and_keeps_the_total_while_tp_divides_kv_heads():
    g = llama8b()
    assert g.kv_bytes_per_token_per_rank(tp=8, dtype_bytes=2) == 128 * 1024 // 8
    assert g.kv_bytes_per_token(tp=8, dtype_bytes=2) == 128 * 1024


def test_tp_beyond_kv_heads_replicates_heads_and_the_total_grows():
    g = llama8b()
    assert g.kv_heads_per_rank(16) == 1
    assert g.kv_bytes_per_token_per_rank(16, 2) == 2 * 32 * 1 * 128 * 2
    assert g.kv_bytes_per_token(16, 2) == 2 * g.kv_bytes_per_token(1, 2)


def test_tp_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(UserError, match="attention heads"):
        llama8b().check_tp(3)
    kv6 = geometry_from_config({"num_hidden_layers": 2, "num_attention_heads": 24, "num_key_value_heads": 6,
                                "hidden_size": 3072}, "kv6")
    with pytest.raises(UserError, match="KV heads"):
        kv6.check_tp(4)
    kv6.check_tp(12)  # 12 is a multiple of 6: heads replicated twice, allowed


def test_mla_is_one_latent_plus_rope_tensor_and_replicated_on_every_rank():
    g = find_preset("deepseek-ai/DeepSeek-V3").geometry()
    assert g.mla is not None
    per_token = 61 * (512 + 64) * 2  # one tensor, not 2 × heads × head_dim
    assert g.kv_bytes_per_token(1, 2) == per_token == 70_272
    assert g.kv_bytes_per_token_per_rank(8, 2) == per_token
    assert g.kv_bytes_per_token(8, 2) == 8 * per_token


def test_sliding_window_layers_hold_only_the_window():
    g = find_preset("google/gemma-3-27b-it").geometry()
    assert (g.num_full_layers, g.num_swa_layers, g.sliding_window) == (10, 52, 1024)
    per_layer = 2 * 16 * 128 * 2
    assert g.bytes_per_sequence(32768, 1, 2) == per_layer * (10 * 32768 + 52 * 1024)
    assert g.bytes_per_sequence(512, 1, 2) == per_layer * 62 * 512  # inside the window every layer holds all


def test_gpt_oss_alternates_full_and_128_token_window():
    g = find_preset("openai/gpt-oss-120b").geometry()
    assert (g.num_full_layers, g.num_swa_layers, g.sliding_window) == (18, 18, 128)
    assert g.bytes_per_sequence(10_000, 1, 2) == 2 * 8 * 64 * 2 * (18 * 10_000 + 18 * 128)


def test_gemma2_alternates_from_its_model_type():
    g = find_preset("google/gemma-2-9b-it").geometry()
    assert (g.num_full_layers, g.num_swa_layers, g.sliding_window) == (21, 21, 4096)


def test_gated_deltanet_hybrid_adds_a_constant_state_per_sequence():
    g = find_preset("Qwen/Qwen3-Next-80B-A3B-Instruct").geometry()
    assert (g.num_full_layers, g.num_state_layers) == (12, 36)
    conv = (4 - 1) * (2 * 16 * 128 + 32 * 128)
    recurrent = 32 * 128 * 128
    state = 36 * (conv + recurrent) * 2
    assert g.state_bytes_per_sequence(1) == state
    kv = 2 * 2 * 256 * 2 * 12
    assert g.kv_bytes_per_token(1, 2) == kv
    assert g.bytes_per_sequence(1000, 1, 2) == kv * 1000 + state
    assert g.bytes_per_sequence(2000, 1, 2) - g.bytes_per_sequence(1000, 1, 2) == kv * 1000


def test_mamba_ssm_dtype_float32_doubles_the_recurrent_state_bytes():
    base = {"num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
            "hidden_size": 2560, "full_attention_interval": 4, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4}
    bf16 = geometry_from_config(base, "a").state_bytes_per_sequence(1)
    fp32 = geometry_from_config(dict(base, mamba_ssm_dtype="float32"), "b").state_bytes_per_sequence(1)
    assert fp32 - bf16 == 3 * 32 * 128 * 128 * 2


def test_jamba_places_attention_every_eighth_layer_at_offset_four():
    g = find_preset("ai21labs/AI21-Jamba-1.5-Mini").geometry()
    assert (g.num_full_layers, g.num_state_layers) == (4, 28)
    inner = 2 * 4096
    assert g.state is not None and g.state.kind == "mamba1"
    assert g.state.bytes == ((4 - 1) * inner + inner * 16) * 2


def test_nemotron_h_pattern_counts_mamba_and_attention_blocks():
    cfg = {"num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "hidden_size": 4096, "hybrid_override_pattern": "M-M*-M-M",
           "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4}
    g = geometry_from_config(cfg, "nemotron-h-like")
    assert (g.num_full_layers, g.num_state_layers) == (1, 4)
    conv = 3 * (128 * 64 + 2 * 8 * 128)
    ssm = 128 * 64 * 128
    assert g.state_bytes_per_sequence(1) == 4 * (conv + ssm) * 2
    # state splits across ranks by heads: TP 4 holds a quarter per rank, same total
    assert g.state_bytes_per_sequence(4) == g.state_bytes_per_sequence(1)


def test_qwen3_4b_preset_matches_the_guide_41k_tokens_in_6_gb():
    # operator's guide § "Validating": "the worked Qwen3-4B cap (~41 K tokens for 6 GB)"
    g = find_preset("Qwen/Qwen3-4B").geometry()
    assert 40_000 < 6e9 // g.kv_bytes_per_token(1, 2) < 42_000


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_parses_and_has_positive_sizes(preset):
    g = preset.geometry()
    assert g.kv_bytes_per_token(1, 2) > 0
    assert preset.weights_gib > 0
    assert preset.source.startswith("https://huggingface.co/") and preset.source.endswith("/config.json")


@pytest.mark.parametrize(
    "cfg, field",
    [
        ({"num_attention_heads": 32, "hidden_size": 4096}, "num_hidden_layers"),
        ({"num_hidden_layers": 32, "hidden_size": 4096}, "num_attention_heads"),
        ({"num_hidden_layers": 32, "num_attention_heads": 32}, "hidden_size"),
        ({"num_hidden_layers": "32", "num_attention_heads": 32, "hidden_size": 4096}, "num_hidden_layers"),
    ],
)
def test_missing_or_malformed_fields_name_the_field(cfg, field):
    with pytest.raises(UserError, match=field):
        geometry_from_config(cfg, "broken")


def test_unknown_layer_type_is_refused():
    with pytest.raises(UserError, match="layer type"):
        geometry_from_config({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64,
                              "layer_types": ["full_attention", "quantum_attention"]}, "odd")


def test_llama4_chunked_local_layers_hold_only_their_chunk():
    # Llama 4: layers with RoPE attend within attention_chunk_size tokens (vLLM models/llama4.py,
    # ChunkedLocalAttention); no_rope_layers 0 marks the global (NoPE) ones; without the list,
    # transformers' Llama4TextConfig makes every 4th layer NoPE, and attention_chunk_size defaults to 8192
    base = {"model_type": "llama4_text", "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 64, "hidden_size": 512}
    g = geometry_from_config({**base, "attention_chunk_size": 256, "no_rope_layers": [1, 1, 1, 0] * 2}, "l4")
    assert (g.num_full_layers, g.num_swa_layers, g.sliding_window) == (2, 6, 256)
    assert g.bytes_per_sequence(4096, 1, 2) == 2 * 2 * 64 * 2 * (2 * 4096 + 6 * 256)
    g = geometry_from_config(base, "l4-defaults")
    assert (g.num_full_layers, g.num_swa_layers, g.sliding_window) == (2, 6, 8192)
    llama = geometry_from_config({**base, "model_type": "llama"}, "llama")
    assert (llama.num_full_layers, llama.num_swa_layers) == (8, 0)


def test_an_attention_free_model_is_refused_in_one_sentence_that_says_why():
    with pytest.raises(UserError, match="attention-free model.*no KV cache per token"):
        geometry_from_config({"model_type": "mamba", "num_hidden_layers": 2, "hidden_size": 128, "state_size": 16},
                             "mamba")
