"""Values vLLM or LMCache refuse (or misread): the engine would not start, or would run with a
setting the operator did not write.  Each rule names the field's type and bound in its source."""

from __future__ import annotations

import math

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule

LMCACHE_NUMBERS: dict[str, tuple[type, float]] = {
    "LMCACHE_CHUNK_SIZE": (int, 1),
    "LMCACHE_MAX_LOCAL_CPU_SIZE": (float, 0),
    "LMCACHE_MAX_LOCAL_DISK_SIZE": (float, 0),
}
"""LMCache variables that hold a number: ``(type, lowest allowed)`` (chunk_size: a whole
number of tokens ≥ 1; the sizes: GB ≥ 0; LMCache configuration reference,
docs.lmcache.ai/api_reference/configurations.html: chunk_size int, max_local_cpu_size and
max_local_disk_size float)."""


def _bad_number(raw: str | None, kind: type, lowest: float) -> bool:
    """Whether ``raw`` is not a finite ``kind`` (int: a whole number) of at least ``lowest``."""
    if raw is None:
        return True
    try:
        value = float(int(raw, 10)) if kind is int else float(raw)
    except ValueError:
        return True
    if not math.isfinite(value):
        return True
    return value < lowest


@rule("gpu-memory-utilization-invalid", "error", "--gpu-memory-utilization is not a fraction above 0 and at most 1",
      "Give the fraction of each GPU's memory vLLM may use, above 0 and at most 1, e.g. --gpu-memory-utilization "
      "0.9, or drop the flag for vLLM's default.",
      "vLLM vllm/config/cache.py CacheConfig.gpu_memory_utilization (float, gt=0, le=1)",
      locate="--gpu-memory-utilization")
def gpu_memory_utilization_invalid(c: ServeConfig) -> str | None:
    if not c.has("--gpu-memory-utilization"):
        return None
    raw = c.value("--gpu-memory-utilization")
    value = c.number("--gpu-memory-utilization")
    if value is not None and 0 < value <= 1:
        return None
    said = "has no value" if raw is None else f"is {raw!r}, not a fraction above 0 and at most 1"
    return f"--gpu-memory-utilization {said}; vLLM refuses it at startup."


@rule("shutdown-timeout-invalid", "error", "--shutdown-timeout is not a whole number of seconds of at least 0",
      "Give the seconds vLLM waits for requests (and kvtier's flush) on SIGTERM as a whole number, e.g. "
      "--shutdown-timeout 30.",
      "vLLM vllm/config/vllm.py VllmConfig.shutdown_timeout (int, ge=0) and vllm/engine/arg_utils.py",
      locate="--shutdown-timeout")
def shutdown_timeout_invalid(c: ServeConfig) -> str | None:
    if not c.has("--shutdown-timeout"):
        return None
    raw = c.value("--shutdown-timeout")
    if not _bad_number(raw, int, 0):
        return None
    said = "has no value" if raw is None else f"is {raw!r}, not a whole number of seconds of at least 0"
    return f"--shutdown-timeout {said}; vLLM refuses it at startup."


@rule("lmcache-env-invalid", "error", "an LMCache size or chunk variable that is not a number in range",
      "Give LMCACHE_CHUNK_SIZE as a whole number of tokens of at least 1 (256 by default) and "
      "LMCACHE_MAX_LOCAL_CPU_SIZE / LMCACHE_MAX_LOCAL_DISK_SIZE as GB of at least 0 (kvtier size prints them).",
      "LMCache configuration reference (docs.lmcache.ai/api_reference/configurations.html: chunk_size int, "
      "max_local_cpu_size and max_local_disk_size float, GB)", locate="LMCACHE_")
def lmcache_env_invalid(c: ServeConfig) -> str | None:
    bad = [f"{name}={c.env[name]!r}" for name, (kind, lowest) in LMCACHE_NUMBERS.items()
           if name in c.env and _bad_number(c.env[name], kind, lowest)]
    if not bad:
        return None
    return f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a number in range; LMCache fails to start or " \
           "misreads it."


@rule("max-model-len-beyond-model-window", "error", "--max-model-len longer than the model's context window",
      "Give --max-model-len at most the window the message names (or drop it: vLLM then takes the window), or set "
      "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 if you mean to serve past it.",
      "vLLM vllm/config/model.py _get_and_verify_max_len (the smallest length key of config.json, times a linear "
      "or dynamic RoPE factor; refused above it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN); read from a local "
      "config.json only (kvtier src/kvtier/size/context.py)", locate="--max-model-len")
def max_model_len_beyond_model_window(c: ServeConfig) -> str | None:
    from kvtier.core.errors import UserError
    from kvtier.size.context import long_allowed
    from kvtier.size.models import resolve_model

    length = c.number("--max-model-len")
    if length is None or not c.model or long_allowed(c.env):
        return None
    try:
        window = resolve_model(c.model, hub=False).max_context
    except UserError:
        return None  # not a local model (a hub id, a path on another host): the audit cannot tell
    if window is None or length <= window[0]:
        return None
    return (f"--max-model-len {length:g} is longer than {c.model}'s context window, {window[0]} tokens ({window[1]} in "
            "its config.json): vLLM refuses to start.")
