"""Write a small Llama-architecture model directory that vLLM can serve with no download.

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

Usage::

    python -m kvtier.integrations.vllm.testmodel --geometry tiny --out models/tiny --weights random

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
FORMAT_VERSION = 1


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


GEOMETRIES: dict[str, Geometry] = {
    "tiny": Geometry(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_size=64,
                     intermediate_size=256, vocab_size=2048, max_position=4096, dtype="float32"),
    "mid": Geometry(num_layers=24, hidden_size=896, num_heads=14, num_kv_heads=2, head_size=64,
                    intermediate_size=4864, vocab_size=8192, max_position=8192, dtype="bfloat16"),
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


def _config(g: Geometry) -> dict[str, object]:
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
    want = {"version": FORMAT_VERSION, "geometry": asdict(g), "weights": weights, "seed": seed}
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
    if weights == "random":
        _write_weights(path, g, seed)
    else:
        (path / "model.safetensors").unlink(missing_ok=True)
    stamp.write_text(json.dumps(want, indent=2))  # last: marks the directory complete
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.integrations.vllm.testmodel",
                                     description="Write a small Llama-architecture model directory for vLLM.")
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
