"""A model's context window, read from its config.json as vLLM derives ``max_model_len``.

vLLM takes the smallest of the length keys of the (text) config, scales it by the RoPE ``factor``
unless the RoPE type already counts it (``llama3``, ``yarn``, ``longrope``, ...), and refuses a
``--max-model-len`` above the result (vllm/config/model.py ``_get_and_verify_max_len``,
vllm/transformers_utils/model_arch_config_convertor.py ``derive_max_model_len_and_key``).  A session
longer than that cannot exist, so ``kvtier size --context`` is checked against it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvtier.core.errors import UserError

LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
"""vLLM's ``possible_keys``, in its order: the smallest present is the model's length."""
SCALED_ALREADY = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
"""RoPE types whose length key already counts the scaling: vLLM applies no ``factor`` to them."""


def _rope_factor(cfg: dict[str, Any]) -> float:
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not isinstance(rope, dict) or "gemma3" in str(cfg.get("model_type", "")):
        return 1.0
    kind = rope.get("rope_type", rope.get("type", "default"))
    factor = rope.get("factor")
    if kind in SCALED_ALREADY or not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        return 1.0
    return float(factor)


def max_context(cfg: dict[str, Any]) -> tuple[int, str] | None:
    """``(tokens, key)``: the longest sequence vLLM serves for this config and the key it comes from, or
    None when the config names no length (vLLM then assumes one; kvtier checks nothing)."""
    text = cfg.get("text_config")
    merged = {**cfg, **text} if isinstance(text, dict) else cfg
    lengths = [(value, key) for key in LENGTH_KEYS
               if isinstance(value := merged.get(key), int) and not isinstance(value, bool) and value > 0]
    if not lengths:
        return None
    if isinstance(merged.get("model_max_length"), int) and merged["model_max_length"] > 0:  # Command-R: it wins
        tokens, key = merged["model_max_length"], "model_max_length"
    else:
        tokens, key = min(lengths)
    factor = _rope_factor(merged)
    return int(tokens * factor), (key if factor == 1.0 else f"{key} × rope factor {factor:g}")


ALLOW_LONG = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
"""vLLM's override: set to 1 (or true), it serves a ``--max-model-len`` past the config's window."""


def long_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`ALLOW_LONG` lets vLLM past the window (vllm/envs.py reads ``1`` or ``true``)."""
    return (os.environ if environ is None else environ).get(ALLOW_LONG, "").strip().lower() in ("1", "true")


def check_context(context: int | None, window: tuple[int, str] | None, model: str) -> None:
    """Refuse ``--context`` longer than the model's context window (unless :data:`ALLOW_LONG` is set).

    Raises:
        UserError: one sentence naming the window, where it comes from and the fix.
    """
    if context is None or window is None or context <= window[0] or long_allowed():
        return
    tokens, key = window
    raise UserError(f"--context {context:,} is longer than {model}'s context window, {tokens:,} tokens ({key} in its "
                    f"config.json): no session can be that long and vLLM refuses a --max-model-len above it; give "
                    f"--context {tokens} or less (or serve it with {ALLOW_LONG}=1, if you mean to).")
