"""Gates and pitfalls of vLLM 0.33 and 0.34, read from their source (the wheels of
``scripts/vllm_compat.py``: ``vllm/engine/arg_utils.py``, ``vllm/config/*.py``, ``vllm/envs.py``,
the connector base class) diffed against 0.32's.  Each rule cites the file and release."""

from __future__ import annotations

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule
from kvtier.audit.rules.settings import kvtier_setting

NEW_FLAGS: dict[str, str] = {
    "--monokernel": "0.33.0",
    "--sleep-mode-backend": "0.33.0",
    "--watchdog-config": "0.33.0",
    "--max-num-inflight-kv-loads": "0.34.0",
    "--enable-extensible-kv-cache": "0.34.0",
    "--no-enable-extensible-kv-cache": "0.34.0",
    "--cache-aware-admission-window": "0.34.0",
    "--cache-aware-admission-threshold": "0.34.0",
    "--checkpoint-prepare-on-startup": "0.34.0",
    "--shuffle-safetensors-files": "0.34.0",
}
"""``vllm serve`` flags that first exist in a release: ``EngineArgs`` fields of
vllm/engine/arg_utils.py at v0.33.0 and v0.34.0 that v0.32.0 and v0.33.0 lack."""

BLOCK_SIZE_DEFAULT_034 = 64
"""vLLM 0.34's ``CacheConfig.DEFAULT_BLOCK_SIZE`` (vllm/config/cache.py; 16 through 0.33), tokens."""




@rule("flag-newer-than-vllm", "error", "flag not in this vLLM release",
      "Delete the flag, or upgrade vLLM to the release that added it.",
      "vllm/engine/arg_utils.py EngineArgs at v0.33.0 and v0.34.0 against v0.32.0 (--monokernel, "
      "--sleep-mode-backend, --watchdog-config in 0.33.0; --max-num-inflight-kv-loads, "
      "--enable-extensible-kv-cache, --cache-aware-admission-*, --checkpoint-prepare-on-startup, "
      "--shuffle-safetensors-files in 0.34.0)")
def flag_newer_than_vllm(c: ServeConfig) -> str | None:
    if c.version is None:
        return None
    late = [f"{flag} (added in {added})" for flag, added in NEW_FLAGS.items()
            if c.has(flag) and c.at_least(added) is False]
    if late:
        return f"vLLM {c.version} does not know {', '.join(late)}, so `vllm serve` exits with 'unrecognized arguments'."
    return None


@rule("v2-model-runner-env-removed", "warning", "VLLM_USE_V2_MODEL_RUNNER is not read from v0.34.0",
      "Delete VLLM_USE_V2_MODEL_RUNNER; on v0.34.0+ Model Runner V2 is the only GPU model runner.",
      "vllm/envs.py at v0.34.0 (VLLM_USE_V2_MODEL_RUNNER removed) and vllm/v1/worker/gpu_worker.py "
      "(imports only vllm/v1/worker/gpu/model_runner.py; vllm/v1/worker/gpu_model_runner.py is gone)",
      locate="VLLM_USE_V2_MODEL_RUNNER")
def v2_model_runner_env_removed(c: ServeConfig) -> str | None:
    if "VLLM_USE_V2_MODEL_RUNNER" not in c.env or not c.at_least("0.34.0"):
        return None
    if c.env_true("VLLM_USE_V2_MODEL_RUNNER"):
        return f"VLLM_USE_V2_MODEL_RUNNER is ignored by vLLM {c.version}: Model Runner V2 runs anyway."
    return (f"VLLM_USE_V2_MODEL_RUNNER={c.env['VLLM_USE_V2_MODEL_RUNNER']} no longer selects the V1 model runner: "
            f"vLLM {c.version} has only Model Runner V2.")


@rule("kvtier-sleep-mode", "error", "KVTierConnector with --enable-sleep-mode",
      "Drop --enable-sleep-mode, or run this engine without KVTierConnector.",
      "vllm/config/vllm.py at v0.33.0 (refuses a connector whose supports_sleep_mode() is False); "
      "kvtier src/kvtier/integrations/vllm/connector.py supports_sleep_mode",
      locate="--enable-sleep-mode")
def kvtier_sleep_mode(c: ServeConfig) -> str | None:
    if not (c.uses("KVTierConnector") and c.has("--enable-sleep-mode")):
        return None
    if c.at_least("0.33.0") is False:
        return (f"vLLM {c.version} lets sleep mode unmap the KV cache under kvtier's copy threads; kvtier does not "
                "support sleep mode, and vLLM 0.33+ refuses to start with both.")
    return "vLLM refuses to start: 'KVTierConnector does not support sleep mode.'"


@rule("kvtier-extensible-kv-cache-headroom", "warning",
      "KVTierConnector on v0.34+ with the KV cache sized from all free GPU memory",
      "Set --gpu-memory-utilization 0.92 (the default before v0.34.0) so kvtier's device buffers have room, "
      "or pass --no-enable-extensible-kv-cache.",
      "vllm/config/cache.py at v0.34.0 (gpu_memory_utilization: 1.0 with the extensible KV cache, the "
      "default on CUDA and ROCm; 'KV connectors that allocate their own device buffers' should set it); "
      "kvtier src/kvtier/integrations/vllm/copy.py (device staging buffers)",
      locate="KVTierConnector")
def kvtier_extensible_kv_cache_headroom(c: ServeConfig) -> str | None:
    if not c.uses("KVTierConnector") or not c.at_least("0.34.0"):
        return None
    if any(c.has(f) for f in ("--gpu-memory-utilization", "--kv-cache-memory-bytes",
                              "--no-enable-extensible-kv-cache")):
        return None
    return (f"vLLM {c.version} gives the KV cache all GPU memory it measures free after start-up, and kvtier's "
            "CUDA copy path allocates its staging buffers on the GPU later: a large load or save can run out of memory.")


@rule("kvtier-chunk-tokens-block-size-64", "warning", "chunk_tokens not a multiple of v0.34's 64-token blocks",
      "Use chunk_tokens auto (the default) or a multiple of 64, or set --block-size to a size that divides it.",
      "vllm/config/cache.py at v0.34.0 (CacheConfig.DEFAULT_BLOCK_SIZE 64, 16 through v0.33.x); kvtier "
      "src/kvtier/integrations/vllm/engine_config.py resolved_config",
      locate="chunk_tokens")
def kvtier_chunk_tokens_block_size(c: ServeConfig) -> str | None:
    if not c.uses("KVTierConnector") or not c.at_least("0.34.0") or c.has("--block-size"):
        return None
    raw = kvtier_setting(c, "chunk_tokens")
    try:
        tokens = int(raw) if raw is not None and str(raw).strip().lower() != "auto" else None
    except ValueError:
        return None  # not a number: kvtier's own config rule reports it
    if tokens is None or tokens <= 0 or tokens % BLOCK_SIZE_DEFAULT_034 == 0:
        return None
    return (f"chunk_tokens {tokens} is not a multiple of vLLM {c.version}'s default {BLOCK_SIZE_DEFAULT_034}-token "
            "KV block: unless the attention backend picks a block size that divides it, the connector refuses to start.")


@rule("kvtier-inflight-kv-loads-cap-only", "info", "--max-num-inflight-kv-loads only caps kvtier's loads",
      "Nothing to change; kvtier's loads start when a running slot is free, as on v0.32.",
      "vllm/config/scheduler.py at v0.34.0 (max_num_inflight_kv_loads) and "
      "vllm/distributed/kv_transfer/kv_connector/v1/base.py may_load_async (default: P/D remote prefill only)",
      locate="--max-num-inflight-kv-loads")
def kvtier_inflight_kv_loads(c: ServeConfig) -> str | None:
    if c.uses("KVTierConnector") and c.has("--max-num-inflight-kv-loads") and c.at_least("0.34.0") is not False:
        return ("KVTierConnector keeps vLLM's default may_load_async, so --max-num-inflight-kv-loads caps its loads "
                "but does not start them while the running batch is full.")
    return None
