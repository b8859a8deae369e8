"""Long-context knobs worth setting next to offload (each rule cites the vLLM config field it reads)."""

from __future__ import annotations

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule


@rule("fastsafetensor-env-does-not-exist", "error", "VLLM_USE_FASTSAFETENSOR does not exist",
      "Use the CLI flag --load-format fastsafetensors.", 'vLLM vllm/envs.py (no VLLM_USE_FASTSAFETENSOR) and '
      'vllm/model_executor/model_loader/__init__.py (--load-format fastsafetensors); '
      'vllm-project/vllm#38950',
      locate="VLLM_USE_FASTSAFETENSOR")
def fastsafetensor_env(c: ServeConfig) -> str | None:
    if "VLLM_USE_FASTSAFETENSOR" in c.env:
        return "VLLM_USE_FASTSAFETENSOR is not a vLLM variable; the fast loader is not enabled."
    return None


@rule("enforce-eager-on-transformer", "warning", "--enforce-eager on a pure transformer",
      "Drop --enforce-eager unless the architecture needs it (hybrid DeltaNet+attention models such as Qwen3.5).",
      'vLLM vllm/config/model.py enforce_eager ("always use eager-mode PyTorch": no CUDA '
      'graphs)',
      locate="--enforce-eager")
def enforce_eager(c: ServeConfig) -> str | None:
    if c.has("--enforce-eager") and not c.hybrid_model:
        return "--enforce-eager turns off CUDA graphs and costs more steady-state throughput than fragmentation."
    return None


@rule("long-context-block-size", "info", "very long context on 16-token blocks",
      "Try --block-size 32 past ~128k context.", 'vLLM vllm/config/cache.py block_size (tokens per KV block)',
      locate="--max-model-len")
def long_context_block_size(c: ServeConfig) -> str | None:
    length = c.number("--max-model-len")
    block = c.number("--block-size") or 16
    if length and length > 131072 and block < 32:
        return f"--max-model-len {length:g} with {block:g}-token blocks: larger blocks cut internal fragmentation."
    return None


@rule("long-context-no-batched-token-cap", "info", "offload + long context without --max-num-batched-tokens",
      "Set --max-num-batched-tokens 4096–8192 so long-prompt bursts do not starve decode.",
      'vLLM vllm/config/scheduler.py max_num_batched_tokens (prefill tokens per scheduler step)', locate="--max-model-len")
def no_batched_token_cap(c: ServeConfig) -> str | None:
    length = c.number("--max-model-len")
    if length and length >= 32768 and c.kv_offload_on and not c.has("--max-num-batched-tokens"):
        return f"--max-model-len {length:g} with KV offload and no prefill cap: tail TTFT can spike on bursts."
    return None
