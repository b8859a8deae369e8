"""Bytes per element of each dtype name kvtier reads: the one table for size, simulate and the tools.

Names accepted: vLLM's ``--kv-cache-dtype`` values (``float16``, ``bfloat16``, ``fp8``, ``fp8_e4m3``,
``fp8_e5m2``; ``CacheDType`` in vllm/config/cache.py, element types in
vllm/utils/torch_utils.py ``STR_DTYPE_TO_TORCH_DTYPE``), Hugging Face ``config.json``
``torch_dtype``/``dtype`` values (``bfloat16``, ``float16``, ``float32``), torch names
(``float8_e4m3fn``, ``half``) and the short forms operators type (``bf16``, ``fp16``, ``fp8``, ``fp32``).
:data:`SHORT_NAME` maps every name to its short form, which is what reports print.
"""

from __future__ import annotations

SHORT_NAME: dict[str, str] = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "int8": "int8", "uint8": "int8",
}
"""Every known dtype name → its short form (``bf16``, ``fp16``, ``fp8``, ``fp32``, ``int8``)."""

_SHORT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}

DTYPE_BYTES: dict[str, int] = {name: _SHORT_BYTES[short] for name, short in SHORT_NAME.items()}
"""Bytes per element of every known dtype name (2 for fp16/bf16, 1 for an fp8 KV cache)."""


def short_name(name: str) -> str | None:
    """The short form of ``name`` (case-insensitive), or ``None`` if kvtier does not know it."""
    return SHORT_NAME.get(name.strip().lower())


KV_CACHE_SHORT_NAMES = ("bf16", "fp16", "fp8")
"""Short forms a KV cache runs in under vLLM (``--kv-cache-dtype`` auto = the model's 16-bit dtype, or
fp8): ``int8`` and ``fp32`` are checkpoint storage dtypes, not KV cache ones (``CacheDType`` in
vllm/config/cache.py has neither, and vLLM downcasts a float32 model)."""


def kv_cache_short_name(name: str) -> str | None:
    """The short form of a KV cache dtype ``name`` (:data:`KV_CACHE_SHORT_NAMES`), or ``None`` when
    vLLM has no such KV cache dtype (``int8``, ``float32``, an unknown name)."""
    short = short_name(name)
    return short if short in KV_CACHE_SHORT_NAMES else None
