"""Write a small model directory (Llama, or a hybrid) that vLLM can serve with no download.

The directory holds ``config.json`` (``LlamaForCausalLM``), a byte-level BPE tokenizer trained
here with the ``tokenizers`` library on text generated from a seeded list of made-up words, and,
with ``weights="random"``, seeded random weights in ``model.safetensors``.  Random weights matter
for correctness tests: with ``--load-format dummy`` a model's output can be insensitive to its KV,
so a broken KV load would go unnoticed; with these weights tokens and logprobs depend on the KV.

Geometries: ``tiny``, ``mid``, ``small8`` (Llama) and the hybrids ``tiny-swa``, ``tiny-conv``,
``tiny-next``, described in :mod:`~kvtier.launch.testmodel_geometry` (:data:`GEOMETRIES`); the
tokenizer and prompts in :mod:`~kvtier.launch.testmodel_words`, the weights in
:mod:`~kvtier.launch.testmodel_weights`.  This module writes the directory and names the public
parts of the others.

Usage::

    python -m kvtier.launch.testmodel --geometry tiny --out models/tiny --weights random

Idempotent: a directory that already holds a complete model of the same geometry, weights and
seed is left as it is (``.kvtier-testmodel.json`` records what was written).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from kvtier.launch.testmodel_geometry import GEOMETRIES, Geometry, config_json, engine_kwargs, geometry_config
from kvtier.launch.testmodel_weights import write_weights, write_weights_generic
from kvtier.launch.testmodel_words import random_prompt, random_prompt_ids, write_tokenizer

__all__ = ["GEOMETRIES", "STAMP", "Geometry", "config_json", "engine_kwargs", "main", "random_prompt",
           "random_prompt_ids", "write_model"]

STAMP = ".kvtier-testmodel.json"
FORMAT_VERSION = 2  # 2: hybrid geometries (stamp lists them)


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
    trained = write_tokenizer(path, min(g.vocab_size, 2048), seed)
    assert trained <= g.vocab_size
    (path / "config.json").write_text(json.dumps(geometry_config(g), indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}, indent=2))
    if weights == "random" and g.architecture == "llama":
        write_weights(path, g, seed)
    elif weights == "random":
        write_weights_generic(path, g, seed)
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
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return _refuse(f"--out {out} is a file, not a directory; give a directory to write the model into (it is "
                       "created if missing)")
    try:
        path = write_model(out, args.geometry, args.weights, args.seed)
    except OSError as exc:
        where = f" at {exc.filename}" if exc.filename and str(exc.filename) != str(out) else ""
        return _refuse(f"cannot write the model to --out {out} ({exc.strerror or exc}{where}); give a directory this "
                       "user can write")
    print(path)
    return 0


def _refuse(message: str) -> int:
    """One ``error:`` sentence on stderr, exit status 2 (as the kvtier CLI's ``cli.errors.fail``,
    which a launch module does not import)."""
    print(f"error: {message}.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
