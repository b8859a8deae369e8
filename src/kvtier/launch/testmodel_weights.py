"""Seeded random weights of the test models (:mod:`kvtier.launch.testmodel`), written as
``model.safetensors``: large enough that tokens and logprobs depend on every cached key and value,
so a broken KV load shows."""

from __future__ import annotations

from pathlib import Path

from kvtier.launch.testmodel_geometry import Geometry


def write_weights(out: Path, g: Geometry, seed: int) -> None:
    """Seeded normal weights in HF Llama naming.

    The standard deviation (1/sqrt(hidden)) is larger than a trained model's init (0.02) so that
    attention is far from uniform: outputs then depend strongly on every cached key and value.
    """
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, g.dtype)
    std = g.hidden_size ** -0.5

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    h, q, kv = g.hidden_size, g.num_heads * g.head_size, g.num_kv_heads * g.head_size
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(g.vocab_size, h) * 8,
                                        "model.norm.weight": torch.ones(h, dtype=dtype),
                                        "lm_head.weight": rand(g.vocab_size, h)}
    for i in range(g.num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(q, h) * 2,
            p + "self_attn.k_proj.weight": rand(kv, h) * 2,
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(g.intermediate_size, h),
            p + "mlp.up_proj.weight": rand(g.intermediate_size, h),
            p + "mlp.down_proj.weight": rand(h, g.intermediate_size),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        })
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def write_weights_generic(out: Path, g: Geometry, seed: int) -> None:
    """Seeded weights for any architecture transformers knows: tensor names and shapes come from
    the model built on the ``meta`` device from ``config.json``; matrices are normal with
    standard deviation ``fan_in ** -0.5``, norm weights one, biases zero; a tied ``lm_head`` is
    not written (the embedding serves as both, so logits have a standard deviation near 1)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(out))
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, g.dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:
            fill = torch.ones if "norm" in name else torch.zeros
            tensors[name] = fill(shape, dtype=dtype)
            continue
        fan_in = 1
        for d in shape[1:]:
            fan_in *= d
        tensors[name] = (torch.randn(*shape, generator=gen) * fan_in ** -0.5).to(dtype)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
