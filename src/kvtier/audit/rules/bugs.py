"""Upstream vLLM bugs fixed at or below the security floor: upgrade rather than work around."""

from __future__ import annotations

from packaging.version import Version

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule


def _before(c: ServeConfig, version: str) -> bool:
    return c.version is not None and c.version < Version(version)


@rule("dcp-offload-segfault", "error", "decode context parallel + offload segfault (#40259)",
      "Upgrade to v0.21.0+ (≥ v0.22.0 for security).", 'vllm-project/vllm#40259 (fixed in v0.21.0)',
      locate="--decode-context-parallel-size")
def dcp_segfault(c: ServeConfig) -> str | None:
    dcp = c.number("--decode-context-parallel-size") or c.number("-dcp") or 1
    if dcp > 1 and c.kv_offload_on and _before(c, "0.21.0"):
        return f"--decode-context-parallel-size {dcp:g} with KV offload segfaults on vLLM {c.version}."
    return None


@rule("qwen35-native-offload-start-failure", "error", "Qwen3.5 native offload fails to start (#36463)",
      "Upgrade to v0.21.0+ (≥ v0.22.0 for security).", 'vllm-project/vllm#36463 (fixed in v0.21.0)',
      locate="--kv-offloading")
def qwen35_native(c: ServeConfig) -> str | None:
    if "qwen3.5" in c.model.lower() and c.uses("OffloadingConnector") and _before(c, "0.21.0"):
        return f"Native offload with {c.model} fails at start-up on vLLM {c.version}."
    return None


@rule("simple-cpu-offload-toctou", "error", "SimpleCPUOffloadScheduler TOCTOU assertion (#39702)",
      "Upgrade to v0.22.0+.", 'vllm-project/vllm#39702 (fixed in v0.22.0)', locate="SimpleCPUOffloadConnector")
def simple_cpu_toctou(c: ServeConfig) -> str | None:
    if c.uses("SimpleCPUOffloadConnector") and _before(c, "0.22.0"):
        return f"SimpleCPUOffloadConnector on vLLM {c.version} can fail with 'AssertionError: Expected N hit tokens'."
    return None
