"""Read a Hugging Face ``config.json`` into a :class:`KVGeometry`.

Understood layouts (field names as published in the models' ``config.json``):

- plain decoders: ``num_hidden_layers``, ``num_attention_heads``, ``hidden_size`` or the names that
  Hugging Face's ``attribute_map`` of each config class maps to them (:data:`_LAYER_KEYS`,
  :data:`_HEAD_KEYS`, :data:`_HIDDEN_KEYS`: GPT-2, GPT-J, GPTBigCode, Bloom, MPT, DBRX, ChatGLM);
  KV heads as vLLM counts them (:func:`kv_heads`); ``head_dim`` (absent or null means
  ``hidden_size // num_attention_heads``, vLLM's ``get_head_size``); multimodal wrappers nest these
  under ``text_config``;
- MLA (DeepSeek-V2/V3, Kimi-K2): ``kv_lora_rank`` and ``qk_rope_head_dim``;
- sliding windows: ``layer_types`` entries ``"sliding_attention"`` (gpt-oss, newer transformers),
  ``sliding_window_pattern`` N (Gemma 3: every N-th layer is global), ``model_type`` gemma2
  (alternate layers), or ``sliding_window`` alone (every layer, Mistral-7B-v0.1); Llama 4's
  ``attention_chunk_size`` (chunked local attention in the layers with RoPE, ``no_rope_layers``); Qwen2's
  ``use_sliding_window: false`` disables it;
- hybrids: ``layer_types`` entries ``"linear_attention"`` / ``"mamba"`` or ``full_attention_interval``
  (Qwen3-Next / Qwen3.5 gated DeltaNet), ``hybrid_override_pattern`` (Nemotron-H: ``M`` Mamba, ``*``
  attention), ``attn_layer_period`` / ``attn_layer_offset`` (Jamba, Mamba-1 layers), ``layer_types``
  entries ``"conv"`` (LFM2 short convolution: ``conv_L_cache``, ``conv_dim``).

Errors: :class:`UserError` naming the missing or bad field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtier.core.dtypes import DTYPE_BYTES
from kvtier.core.errors import UserError
from kvtier.size.geometry import KVGeometry, MLASpec, StateSpec

MAX_CONFIG_BYTES = 8 << 20
"""Largest config.json read (bytes): real ones are a few KiB; this keeps ``/dev/zero`` from filling RAM."""


def load_config_file(path: Path) -> dict[str, Any]:
    """Read ``path`` (a ``config.json`` or a directory holding one) as a dict.

    Raises:
        UserError: missing, not a regular file (device, FIFO), over :data:`MAX_CONFIG_BYTES`, or not JSON.
    """
    file = path / "config.json" if path.is_dir() else path
    try:
        if file.exists() and not file.is_file():
            raise UserError(f"{file} is not a regular file; pass a model directory or its config.json.")
        if file.exists() and file.stat().st_size > MAX_CONFIG_BYTES:
            raise UserError(f"{file} is larger than {MAX_CONFIG_BYTES >> 20} MiB, so it is not a config.json; "
                            "pass the model's config.json.")
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise UserError(f"{file} does not exist; pass a model directory or its config.json.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{file} is not a readable JSON config ({exc.__class__.__name__}).") from None
    except RecursionError:
        raise UserError(f"{file} is nested too deeply to be a config.json; pass the model's config.json.") from None
    if not isinstance(data, dict):
        raise UserError(f"{file} must hold a JSON object, like a Hugging Face config.json.")
    return data


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    inner = cfg.get("text_config")
    if isinstance(inner, dict):
        merged = {k: v for k, v in cfg.items() if k != "text_config"}
        merged.update(inner)
        return merged
    return cfg


MAX_LAYERS = 100_000
"""Most ``num_hidden_layers`` read (real models have at most a few hundred): one entry per layer is built."""
MAX_FIELD = 1 << 53
"""Most any other integer field read (the largest integer a float holds exactly)."""


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None, maximum: int = MAX_FIELD) -> int:
    value = cfg.get(key)
    value = default if value is None else value  # null reads as absent, as Hugging Face's configs do
    if value is None:
        raise UserError(f"{where} lacks the field {key!r}; use a complete config.json or a --model preset.")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"{where} field {key!r} must be a non-negative integer, got {value!r}.")
    if value > maximum:
        raise UserError(f"{where} field {key!r} is {value:,}, more than the {maximum:,} kvtier size reads; pass a "
                        "real model's config.json.")
    return value


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "n_embed", "d_model")
"""Names a config.json may give the layers, attention heads and hidden size under, the standard one first:
what Hugging Face's ``attribute_map`` of each config class maps ``num_hidden_layers`` /
``num_attention_heads`` / ``hidden_size`` to (GPT-2, GPT-J and GPTBigCode ``n_layer``, ``n_head``,
``n_embd``; Bloom and Falcon's RW configs ``n_layer``, ``n_head``, ``n_embed``; MPT and DBRX ``n_layers``,
``n_heads``, ``d_model``; ChatGLM ``num_layers``, vllm/transformers_utils/configs/chatglm.py), which vLLM's
getters (``get_num_layers``, ``get_head_size``) then read under the standard names."""


def _key(cfg: dict[str, Any], keys: tuple[str, ...]) -> str:
    """The first of ``keys`` that ``cfg`` sets (not null), else the standard name (``keys[0]``) for the error."""
    return next((k for k in keys if cfg.get(k) is not None), keys[0])


_FALCON_TYPES = ("falcon", "RefinedWeb", "RefinedWebModel")
_NO_ATTENTION_TYPES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "rwkv5", "rwkv6", "xlstm")
"""``model_type``s of attention-free models (transformers' and vLLM's model registries)."""
_KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")


def kv_heads(cfg: dict[str, Any], heads: int, where: str) -> int:
    """The model's KV heads (all ranks) as vLLM counts them: ``ModelConfig.get_total_num_kv_heads``
    (vllm/config/model.py, its rule in vllm/transformers_utils/model_arch_config_convertor.py):

    - Falcon (``falcon``, ``RefinedWeb*``): 1 when ``multi_query`` (default true) unless
      ``new_decoder_architecture`` (vLLM's RW config also sets it for ``hidden_size`` 8192, Falcon-40B);
    - DBRX / MPT: ``attn_config.kv_n_heads`` (DBRX's default 1, MPT's the attention heads);
    - GPTBigCode: 1 when ``multi_query`` (default true), as Hugging Face's config sets ``num_key_value_heads``;
    - ChatGLM: ``multi_query_group_num`` when ``multi_query_attention``, as its attention layer
      (vllm/model_executor/models/chatglm.py) allocates them;
    - else the first set of ``n_head_kv``, ``num_kv_heads``, ``num_key_value_heads``,
      ``multi_query_group_num``, ``num_attention_groups`` (null is unset), falling back to the attention
      heads (MHA).  A RW config's ``n_head_kv`` defaults to 1 (vllm/transformers_utils/configs/falcon.py).

    Raises:
        UserError: a count that is not a positive integer.
    """
    model_type = cfg.get("model_type")
    if model_type in _FALCON_TYPES:
        new_arch = bool(cfg.get("new_decoder_architecture")) or (model_type != "falcon" and cfg.get("hidden_size") == 8192)
        if not new_arch and cfg.get("multi_query", True):
            return 1
    if model_type == "gpt_bigcode":
        return 1 if cfg.get("multi_query", True) else heads
    if model_type == "chatglm" and not cfg.get("multi_query_attention"):
        return heads
    attn = cfg.get("attn_config")
    if model_type in ("dbrx", "mpt") and isinstance(attn, dict):
        key, count = "attn_config.kv_n_heads", _int(attn, "kv_n_heads", f"{where} attn_config",
                                                   default=1 if model_type == "dbrx" else heads)
    else:
        key = _key(cfg, _KV_HEAD_KEYS)
        count = _int(cfg, key, where, default=1 if model_type in _FALCON_TYPES[1:] else heads)
    if count == 0:
        raise UserError(f"{where} has {key} 0; it must be at least 1 (omit it for MHA).")
    return count


MODEL_DTYPES = ("bfloat16", "float16", "half", "float32", "float")
"""The model dtypes vLLM reads from a config (vllm/config/model.py ``_STR_DTYPE_TO_TORCH_DTYPE``)."""


def _dtype_bytes(cfg: dict[str, Any], key: str, where: str) -> int | None:
    """Bytes per element of the dtype in ``cfg[key]`` (``None`` when absent).  A ``torch.`` prefix
    (``torch.bfloat16``, as some configs write it) is read as the bare name.

    Raises:
        UserError: a dtype kvtier does not know (it was read as bf16 silently).
    """
    name = cfg.get(key)
    if name is None or name == "":
        return None
    known = DTYPE_BYTES.get(str(name).strip().lower().removeprefix("torch."))
    if known is None:
        raise UserError(f"{where} field {key!r} is {name!r}, a dtype kvtier size does not know; use one of "
                        f"{', '.join(MODEL_DTYPES)} (vLLM's names), or fix the config.")
    return known


def _model_dtype_name(cfg: dict[str, Any]) -> tuple[str, str] | None:
    """``(key, name)`` of the model's dtype as the config writes it (``torch_dtype``, newer configs
    ``dtype``), None when neither is set."""
    for key in ("torch_dtype", "dtype"):
        if cfg.get(key) not in (None, ""):
            return key, str(cfg[key])
    return None


_NO_FP16 = ("gemma2", "gemma3", "gemma3_text", "glm4")
"""Model types vLLM refuses to run in float16 (vllm/config/model.py ``_FLOAT16_NOT_SUPPORTED_MODELS``)."""


def auto_dtype(cfg: dict[str, Any]) -> str:
    """``"bf16"`` or ``"fp16"``: what vLLM's ``--dtype auto`` runs the model (and its KV cache) in on a GPU
    with bf16 (vllm/config/model.py ``_resolve_auto_dtype``): the config's float16 or bfloat16; float32,
    none or a storage dtype (int8, fp8) becomes the platform's preferred bf16; float16 on a model type
    that refuses it (:data:`_NO_FP16`) becomes bf16 too.  Both are 2 bytes (a GPU without bf16 runs fp16)."""
    cfg = _text_config(cfg)
    given = _model_dtype_name(cfg)
    name = given[1].strip().lower().removeprefix("torch.") if given is not None else ""
    return "fp16" if name in ("float16", "half") and cfg.get("model_type") not in _NO_FP16 else "bf16"


def _model_dtype_bytes(cfg: dict[str, Any], where: str) -> int:
    """Bytes per element of the dtype vLLM runs the model in (:func:`auto_dtype`: 2, float32 too).

    A dtype vLLM does not run a model in (``int8``, ``uint8``, ``float8_e4m3fn``: a quantized
    checkpoint's storage dtype) is read as bf16, as vLLM's ``dtype="auto"`` does: it falls back to the
    platform's preferred dtype, bf16 on GPUs that have it (vllm/config/model.py ``_resolve_auto_dtype``,
    "Your device ... doesn't support ... Falling back to"); :func:`dtype_note` says so.

    Raises:
        UserError: a dtype name no one knows (:func:`_dtype_bytes`).
    """
    given = _model_dtype_name(cfg)
    if given is not None:
        _dtype_bytes(cfg, given[0], where)  # refuses a name no one knows
    return DTYPE_BYTES[auto_dtype(cfg)]


def dtype_note(cfg: dict[str, Any]) -> str | None:
    """A note when the config's model dtype is one vLLM does not run in and reads as bf16, else None."""
    cfg = _text_config(cfg)
    given = _model_dtype_name(cfg)
    if given is None or given[1].strip().lower().removeprefix("torch.") in MODEL_DTYPES:
        return None
    return (f"The config's {given[0]} {given[1]!r} is a storage dtype vLLM does not run a model in: with --dtype auto "
            "vLLM falls back to bf16 (vllm/config/model.py _resolve_auto_dtype), so the KV cache and any state are "
            "sized at bf16; give --kv-dtype if you serve it with another.")


def _layer_kinds(cfg: dict[str, Any], num_layers: int, where: str) -> list[str]:
    """One of ``"full"``, ``"swa"``, ``"state"``, ``"none"`` per layer."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) != num_layers:
            raise UserError(f"{where} has {len(types)} layer_types for {num_layers} layers.")
        kinds = []
        for t in types:
            t = str(t)
            if t in ("sliding_attention", "chunked_attention"):
                kinds.append("swa")
            elif t in ("full_attention", "attention"):
                kinds.append("full")
            elif t in ("linear_attention", "mamba", "mamba2", "conv"):
                kinds.append("state")
            else:
                raise UserError(f"{where} has a layer type {t!r} that kvtier size does not know.")
        return kinds
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        # Nemotron-H: one character per block; M = Mamba-2, * = attention, - / E = MLP / MoE.
        return [{"M": "state", "*": "full"}.get(ch, "none") for ch in pattern]
    interval = cfg.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        return ["full" if (i + 1) % interval == 0 else "state" for i in range(num_layers)]
    period = cfg.get("attn_layer_period")
    if isinstance(period, int) and period > 0:
        offset = int(cfg.get("attn_layer_offset", 0))
        return ["full" if i % period == offset else "state" for i in range(num_layers)]
    if _chunked_window(cfg):  # Llama 4: layers with RoPE attend within chunks (vLLM models/llama4.py)
        ropes = cfg.get("no_rope_layers")
        if not (isinstance(ropes, list) and len(ropes) == num_layers):  # transformers' default: NoPE every N-th
            every = int(cfg.get("no_rope_layer_interval") or 4)
            ropes = [int((i + 1) % every != 0) for i in range(num_layers)]
        return ["swa" if rope else "full" for rope in ropes]
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or window <= 0 or cfg.get("use_sliding_window") is False:
        return ["full"] * num_layers
    swa_pattern = cfg.get("sliding_window_pattern")
    if isinstance(swa_pattern, int) and swa_pattern > 0:  # Gemma 3: layer i is global iff (i+1) % N == 0
        return ["full" if (i + 1) % swa_pattern == 0 else "swa" for i in range(num_layers)]
    if cfg.get("model_type") == "gemma2":  # Gemma 2: even layers slide, odd layers are global
        return ["swa" if i % 2 == 0 else "full" for i in range(num_layers)]
    return ["swa"] * num_layers


def _chunked_window(cfg: dict[str, Any]) -> int | None:
    """Llama 4's ``attention_chunk_size`` (transformers' Llama4TextConfig default 8192): a layer with
    RoPE attends within chunks of that many tokens (vLLM ``ChunkedLocalAttention``), so it keeps at
    most that many tokens of KV and is sized as a sliding window of that length; ``None`` otherwise."""
    chunk = cfg.get("attention_chunk_size", 8192 if str(cfg.get("model_type", "")).startswith("llama4") else None)
    return chunk if isinstance(chunk, int) and chunk > 0 else None


def _state_spec(cfg: dict[str, Any], where: str) -> StateSpec:
    """Per-layer state of a Mamba / linear-attention layer (shapes as vLLM's state allocators hold them)."""
    model_bytes = _model_dtype_bytes(cfg, where)
    ssm_bytes = _dtype_bytes(cfg, "mamba_ssm_dtype", where) or model_bytes
    if "linear_num_value_heads" in cfg:  # gated DeltaNet (Qwen3-Next, Qwen3.5)
        nk = _int(cfg, "linear_num_key_heads", where)
        nv = _int(cfg, "linear_num_value_heads", where)
        dk = _int(cfg, "linear_key_head_dim", where)
        dv = _int(cfg, "linear_value_head_dim", where)
        kernel = _int(cfg, "linear_conv_kernel_dim", where, default=4)
        conv = (kernel - 1) * (2 * nk * dk + nv * dv)
        return StateSpec("gated_deltanet", conv, nv * dk * dv, model_bytes, ssm_bytes, nv)
    if "conv_L_cache" in cfg:  # LFM2 short convolution: (L_cache - 1) × conv_dim, split over TP like a width
        width = _int(cfg, "conv_dim", where, default=cfg.get("hidden_size"))
        kernel = _int(cfg, "conv_L_cache", where)
        return StateSpec("short_conv", (kernel - 1) * width, 0, model_bytes, ssm_bytes, width)
    heads = cfg.get("mamba_num_heads", cfg.get("mamba_n_heads"))
    if heads is not None:  # Mamba-2 (Nemotron-H, Granite-4.0-H, Falcon-H1)
        heads = _int(cfg, "mamba_num_heads" if "mamba_num_heads" in cfg else "mamba_n_heads", where)
        head_dim = cfg.get("mamba_head_dim", cfg.get("mamba_d_head"))
        if not isinstance(head_dim, int):
            raise UserError(f"{where} lacks the field 'mamba_head_dim' of its Mamba-2 layers.")
        state = _int(cfg, "ssm_state_size" if "ssm_state_size" in cfg else "mamba_d_state", where)
        groups = _int(cfg, "n_groups" if "n_groups" in cfg else "mamba_n_groups", where, default=1)
        kernel = _int(cfg, "conv_kernel" if "conv_kernel" in cfg else "mamba_d_conv", where, default=4)
        inner = heads * head_dim
        conv = (kernel - 1) * (inner + 2 * groups * state)
        return StateSpec("mamba2", conv, heads * head_dim * state, model_bytes, ssm_bytes, heads)
    if "mamba_d_state" in cfg:  # Mamba-1 (Jamba): inner = expand × hidden
        hidden = _int(cfg, "hidden_size", where)
        inner = int(cfg.get("mamba_expand", 2)) * hidden
        state = _int(cfg, "mamba_d_state", where)
        kernel = _int(cfg, "mamba_d_conv", where, default=4)
        return StateSpec("mamba1", (kernel - 1) * inner, inner * state, model_bytes, ssm_bytes, inner)
    raise UserError(f"{where} has Mamba / linear-attention layers of a kind kvtier size does not know.")


def attention_layers(cfg: dict[str, Any], name: str) -> int:
    """Layers of the model ``cfg`` describes that keep KV per token: full and sliding-window attention,
    not Mamba / linear-attention / short-convolution layers nor MLP-only blocks (the layer kinds
    :func:`geometry_from_config` reads: ``layer_types``, ``hybrid_override_pattern``,
    ``full_attention_interval``, ``attn_layer_period``).

    Raises:
        UserError: ``num_hidden_layers`` missing or malformed, or a layer type not known.
    """
    where = f"config of {name}"
    cfg = _text_config(cfg)
    _model_dtype_bytes(cfg, where)  # an unknown dtype is refused for every model, not only hybrid ones
    num_layers = _int(cfg, _key(cfg, _LAYER_KEYS), where, maximum=MAX_LAYERS)
    return sum(kind in ("full", "swa") for kind in _layer_kinds(cfg, num_layers, where))


def geometry_from_config(cfg: dict[str, Any], name: str, source: str = "") -> KVGeometry:
    """Build the KV geometry of the model described by ``cfg`` (a parsed config.json).

    Raises:
        UserError: a required field is missing or malformed (message names the field).
    """
    where = f"config of {name}"
    cfg = _text_config(cfg)
    _model_dtype_bytes(cfg, where)  # an unknown dtype is refused for every model, not only hybrid ones
    num_layers = _int(cfg, _key(cfg, _LAYER_KEYS), where, maximum=MAX_LAYERS)
    if all(cfg.get(k) is None for k in _HEAD_KEYS) and str(cfg.get("model_type", "")) in _NO_ATTENTION_TYPES:
        raise UserError(f"{where} describes an attention-free model (model_type {cfg['model_type']!r}): it keeps "
                        "no KV cache per token, only a fixed state per sequence, so there is nothing for kvtier size "
                        "to size (kvtier keeps such states only beside attention layers, in hybrid models).")
    heads = _int(cfg, _key(cfg, _HEAD_KEYS), where)
    if heads == 0:
        raise UserError(f"{where} has num_attention_heads 0; it must be at least 1.")
    num_kv = kv_heads(cfg, heads, where)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        hidden = _int(cfg, _key(cfg, _HIDDEN_KEYS), where)
        if hidden == 0:  # 0 % heads passed the test below and sized 0 bytes per token
            raise UserError(f"{where} has hidden_size 0; it must be at least 1 (or give the model's 'head_dim').")
        if hidden % heads:
            raise UserError(f"{where} has hidden_size {hidden} not divisible by num_attention_heads {heads}; "
                            "add the model's 'head_dim' to the config.")
        head_dim = hidden // heads
    elif not isinstance(head_dim, int) or head_dim <= 0:
        raise UserError(f"{where} field 'head_dim' must be a positive integer, got {head_dim!r}.")
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = MLASpec(_int(cfg, "kv_lora_rank", where), _int(cfg, "qk_rope_head_dim", where))
    elif heads % num_kv:  # vLLM's Attention layer asserts it (vllm/model_executor/layers/attention/attention.py)
        raise UserError(f"{where} has num_attention_heads {heads} not divisible by num_key_value_heads {num_kv}; "
                        "vLLM refuses such a model (each KV head serves a whole group of query heads): check both.")
    kinds = _layer_kinds(cfg, num_layers, where)
    num_state = kinds.count("state")
    window = (_chunked_window(cfg) or cfg.get("sliding_window")) if "swa" in kinds else None
    if "swa" in kinds and (not isinstance(window, int) or window <= 0):
        raise UserError(f"{where} has sliding-window layers but no positive 'sliding_window'.")
    if kinds.count("full") + kinds.count("swa") == 0:
        raise UserError(f"{where} has no attention layers, so it has no KV cache to size.")
    return KVGeometry(
        name=name,
        num_full_layers=kinds.count("full"),
        num_swa_layers=kinds.count("swa"),
        sliding_window=window,
        num_attention_heads=heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        mla=mla,
        num_state_layers=num_state,
        state=_state_spec(cfg, where) if num_state else None,
        source=source,
    )


__all__ = ["DTYPE_BYTES", "auto_dtype", "geometry_from_config", "kv_heads", "load_config_file"]
