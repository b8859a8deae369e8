"""KV bytes per token from a Hugging Face ``config.json`` (just enough for the simulator).

Standard attention stores a K and a V vector per layer and KV head::

    bytes/token = attention layers × 2 × num_key_value_heads × head_dim × dtype_bytes

(e.g. 32 × 2 × 8 × 128 × 2 = 131,072 bytes = 128 KiB for Llama-3.1-8B in bf16).  Multi-head
latent attention (DeepSeek-V2/V3, fields ``kv_lora_rank`` and ``qk_rope_head_dim``) stores one
compressed latent per layer instead: ``layers × (kv_lora_rank + qk_rope_head_dim) × dtype_bytes``
(DeepSeek-V2 paper, arXiv:2405.04434, section 2.1; vLLM's MLA backend caches the same).

``kvtier size`` (another module) does the full sizing; this helper only feeds tier capacities.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtier.core.dtypes import DTYPE_BYTES
from kvtier.core.errors import GeometryError, UserError
from kvtier.size.hf_config import attention_layers


def kv_bytes_per_token(config: dict[str, Any], kv_dtype: str | None = None) -> int:
    """KV cache bytes per token for the whole model (all layers, all KV heads, K and V).

    Args:
        config: a parsed HF ``config.json``; a nested ``text_config`` (multimodal models) is used
            when present.
        kv_dtype: KV cache dtype; default the config's ``torch_dtype``/``dtype`` as vLLM's ``--dtype
            auto`` runs it (a float32 checkpoint in 16 bits), else bfloat16.

    Returns:
        bytes per token (> 0).  Divide by the tensor-parallel size for one rank's share.

    Raises:
        GeometryError: a needed field is missing or not positive, the dtype is unknown, or the heads
            do not fit (KV heads not dividing the attention heads; a ``hidden_size`` the attention
            heads do not divide, without ``head_dim``), as ``kvtier size`` refuses them.
    """
    cfg = config.get("text_config") or config
    dtype = kv_dtype or cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if kv_dtype is None and dtype in ("float32", "float", "fp32"):
        # vLLM's --dtype auto downcasts a float32 checkpoint to 16 bits (vllm/config/model.py,
        # "Downcast for float32 models"), and the KV cache follows the model dtype; kvtier size does the same
        dtype = "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise GeometryError(f"unknown KV dtype {dtype!r}; use one of {', '.join(sorted(DTYPE_BYTES))}")
    _positive(cfg, "num_hidden_layers")
    try:  # hybrid models: only the attention layers keep KV per token (Jamba: 4 of 32), as kvtier size counts
        layers = attention_layers(config, "model")
    except UserError as exc:
        raise GeometryError(str(exc).rstrip(".")) from None
    if layers == 0:
        raise GeometryError("model config has no attention layers (every layer is Mamba, linear attention or "
                            "convolution), so it has no per-token KV to simulate")
    if "kv_lora_rank" in cfg:
        latent = _positive(cfg, "kv_lora_rank") + _positive(cfg, "qk_rope_head_dim")
        return layers * latent * DTYPE_BYTES[dtype]
    heads = _positive(cfg, "num_attention_heads")
    kv_heads = _positive(cfg, "num_key_value_heads") if "num_key_value_heads" in cfg else heads
    if heads % kv_heads:  # vLLM's Attention asserts it (vllm/model_executor/layers/attention/attention.py)
        raise GeometryError(f"model config has num_attention_heads {heads} not divisible by num_key_value_heads "
                            f"{kv_heads}; vLLM refuses such a model: check both (the same rule as kvtier size)")
    if cfg.get("head_dim"):
        head_dim = _positive(cfg, "head_dim")
    else:
        hidden = _positive(cfg, "hidden_size")
        if hidden % heads:  # a floor here sized a head that does not exist
            raise GeometryError(f"model config has hidden_size {hidden} not divisible by num_attention_heads "
                                f"{heads}; add the model's 'head_dim' to the config")
        head_dim = hidden // heads
    return layers * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]


def kv_bytes_per_token_from_file(path: str | Path) -> int:
    """:func:`kv_bytes_per_token` of a ``config.json`` file, or of the one in model directory ``path``
    (as ``kvtier size --model`` reads a directory).

    Raises:
        GeometryError: unreadable file, a directory without config.json, not JSON, or a field missing.
    """
    if Path(path).is_dir():
        if not (Path(path) / "config.json").is_file():
            raise GeometryError(f"model directory {path} holds no config.json; pass a model directory or its "
                                "config.json to --model")
        path = Path(path) / "config.json"
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GeometryError(f"model config {path} does not exist; pass a HF config.json to --model") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GeometryError(f"cannot read model config {path} ({exc})") from None
    except json.JSONDecodeError as exc:
        raise GeometryError(f"model config {path} is not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise GeometryError(f"model config {path} is nested too deeply to be a config.json; pass a HF "
                            "config.json") from None
    if not isinstance(config, dict):
        raise GeometryError(f"model config {path} is not a JSON object; pass a HF config.json")
    return kv_bytes_per_token(config)


def _positive(cfg: dict[str, Any], name: str) -> int:
    value = cfg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise GeometryError(f"model config field {name!r} must be a positive integer, got {value!r}")
    return value
