"""Hybrid memory allocator (HMA) and hybrid-model rules per connector."""

from __future__ import annotations

from packaging.version import Version

from kvtier.audit.model import HMA_CONNECTORS, ServeConfig
from kvtier.audit.rules.base import rule

_FLAG = "--disable-hybrid-kv-cache-manager"


def _moriio_write_on_hybrid(c: ServeConfig) -> bool:
    read_mode = str(c.connector_extra.get("read_mode", "")).lower() == "true"
    return c.uses("MoRIIOConnector") and c.hybrid_model and not read_mode


@rule("disable-hma-by-reflex", "warning", "--disable-hybrid-kv-cache-manager with HMA-capable connectors",
      "Remove --disable-hybrid-kv-cache-manager; from v0.23.0 vLLM disables HMA itself only for connectors "
      "that lack SupportsHMA.",
      'vllm-project/vllm#41847 (v0.23.0: HMA is disabled automatically only for connectors '
      'without SupportsHMA, vllm/distributed/kv_transfer/kv_connector/v1/base.py)', locate=_FLAG)
def disable_hma_by_reflex(c: ServeConfig) -> str | None:
    if not c.has(_FLAG) or c.at_least("0.23.0") is False or _moriio_write_on_hybrid(c):
        return None
    connectors = c.connectors
    if all(name in HMA_CONNECTORS for name in connectors):
        which = ", ".join(connectors) or "no KV connector"
        return (f"{_FLAG} with {which}: it costs hybrid-model support and sliding-window performance for "
                "nothing on v0.23.0+.")
    return None


@rule("hma-flag-required-before-0.23", "error", "OffloadingConnector needs the HMA flag before v0.23.0",
      f"Add {_FLAG} on this release, or upgrade to v0.23.0+ where HMA stays on with native offload.",
      'vllm-project/vllm#41847 (before v0.23.0 OffloadingConnector needed '
      '--disable-hybrid-kv-cache-manager)',
      locate="--kv-offloading")
def hma_flag_required(c: ServeConfig) -> str | None:
    if c.uses("OffloadingConnector") and not c.has(_FLAG) and c.version is not None \
            and c.version < Version("0.23.0"):
        return (f"vLLM {c.version} refuses OffloadingConnector with HMA on: \"Connector OffloadingConnector does "
                "not support HMA but HMA is enabled\".")
    return None


@rule("lmcache-inprocess-on-hybrid", "error", "LMCacheConnectorV1 on a hybrid-attention model",
      "Use native offload (--kv-offloading-size) or LMCache MP mode (LMCacheMPConnector, lmcache ≥ 0.5.0).",
      'LMCache/LMCache#3106 (open: LMCacheConnectorV1 has no SupportsHMA and fails on mixed '
      'attention groups)', locate="LMCache")
def lmcache_inprocess_hybrid(c: ServeConfig) -> str | None:
    if c.uses("LMCacheConnectorV1") and c.hybrid_model:
        return (f"{c.model} mixes attention kinds; LMCacheConnectorV1 has no SupportsHMA and its single-shape "
                "MemoryObj.tensor fails on mixed attention groups (LMCache#3106).")
    return None


@rule("multiconnector-non-hma-child", "warning", "MultiConnector with a child that lacks HMA",
      "Replace the non-HMA child (e.g. LMCacheConnectorV1 → OffloadingConnector or LMCacheMPConnector).",
      'vLLM vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py (HMA only when '
      'every child supports it); vllm-project/vllm#39571',
      locate="MultiConnector")
def multiconnector_non_hma(c: ServeConfig) -> str | None:
    if not c.uses("MultiConnector"):
        return None
    children = [n for n in c.connectors if n != "MultiConnector"]
    missing = [n for n in children if n not in HMA_CONNECTORS]
    if missing:
        return f"MultiConnector child {', '.join(missing)} lacks SupportsHMA, which disables HMA for the whole composition."
    return None


@rule("moriio-write-on-hybrid", "error", "MoRIIO WRITE mode on a hybrid model",
      "Set kv_connector_extra_config.read_mode=true (READ mode), or pass --disable-hybrid-kv-cache-manager "
      "with WRITE on sliding-window hybrids.",
      'vLLM vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py ("MoRIIO '
      'WRITE mode does not support hybrid KV cache groups")',
      locate="MoRIIOConnector")
def moriio_write(c: ServeConfig) -> str | None:
    if _moriio_write_on_hybrid(c) and not c.has(_FLAG):
        return "MoRIIOConnector in WRITE mode does not support hybrid KV cache groups and fails at start-up."
    return None


@rule("hybrid-retention-interval-default", "info", "hybrid model on the default retention interval 0",
      "For agentic multi-turn traffic without spec-decode, set --prefix-cache-retention-interval N (a multiple "
      "of the SWA group's tokens_per_chunk) and re-measure the hit rate.",
      'vLLM vllm/config/cache.py prefix_cache_retention_interval (default 0 from v0.29.0, vLLM '
      'v0.29.0 release notes (github.com/vllm-project/vllm/releases/tag/v0.29.0))')
def hybrid_retention(c: ServeConfig) -> str | None:
    if (c.hybrid_model and c.at_least("0.29.0") and not c.has("--prefix-cache-retention-interval")
            and not c.has("--speculative-config")):
        return (f"{c.model} keeps only the latest replayable prompt boundary (interval 0); agentic multi-turn "
                "prefix hits can drop.")
    return None


def _state_block_floor(c: ServeConfig) -> int | None:
    """The least state block size vLLM can give the model, tokens: its state page (one layer's state
    on one rank) over one attention layer's bytes per token at bf16, since vLLM raises the attention
    block size until an attention page holds a state page and gives the state group that block size
    (vllm/platforms/interface.py update_block_size_for_backend, vllm/v1/kv_cache_interface.py
    MambaSpec); None when the model is unknown offline or keeps no state."""
    from kvtier.core.errors import UserError
    from kvtier.size.models import resolve_model

    try:
        resolved = resolve_model(c.model, hub=False) if c.model else None
    except UserError:
        return None
    geometry = resolved.geometry if resolved is not None else None
    if geometry is None or not geometry.num_state_layers or geometry.state is None \
            or not geometry.num_attention_layers:
        return None
    per_token = geometry.layer_token_bytes_per_rank(c.tp, 2)
    return -(-geometry.state.bytes_per_rank(c.tp) // per_token) if per_token else None


@rule("kvtier-chunk-tokens-below-state-block", "error", "kvtier chunk_tokens shorter than a state model's block",
      'Set "chunk_tokens":"auto" (the connector\'s default: the least multiple of every KV cache group\'s block '
      "size that is at least 128), or leave the key out.",
      "kvtier src/kvtier/integrations/vllm/engine_config.py resolve_chunk_tokens (a multiple of every group's "
      "block size); vLLM vllm/platforms/interface.py update_block_size_for_backend (a state group's block holds "
      "one state page)", locate="chunk_tokens")
def kvtier_chunk_tokens_below_state_block(c: ServeConfig) -> str | None:
    chunk = c.connector_extra.get("chunk_tokens") if c.uses("KVTierConnector") else None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        return None  # auto, absent, or a bad value kvtier-config-invalid reports
    floor = _state_block_floor(c)
    if floor is None or chunk >= floor:
        return None
    return (f"chunk_tokens {chunk} is shorter than the state block of {c.model} (at least {floor} tokens at TP "
            f"{c.tp}: one Mamba/linear-attention state page), so it cannot be a multiple of it and the connector "
            "refuses to start.")
