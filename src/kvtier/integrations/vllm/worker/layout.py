"""Detect how vLLM lays out its paged KV cache, without assuming a backend.

Each registered per-layer tensor holds ``num_blocks`` engine blocks along one dimension, the
*block dimension*; which one, and what the other dimensions mean, depends on the attention
backend (vLLM 0.32's CPU backend: one tensor per layer with blocks outermost; FlashAttention:
K and V split along a leading dimension of 2 with blocks second; MLA: one latent tensor).
kvtier never interprets the other dimensions: it copies each block's bytes of each layer as
they are, and records the shape, dtype, block dimension and backend in the namespace so a
chunk written under one layout is never loaded under another.

A chunk page holds ``[num_layers][blocks_per_chunk][block_bytes]`` bytes, layers in registration
order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.core.errors import ConfigError


@dataclass(frozen=True)
class KVLayout:
    """The registered KV cache, as kvtier sees it.

    Attributes:
        layer_names: attention layers in registration order.
        block_dim: the dimension of each layer tensor indexed by engine block id.
        block_shape: shape of one block's slice of one layer (the tensor shape minus ``block_dim``).
        dtype: element type of the cache tensors.
        block_bytes: bytes of one block of one layer (``prod(block_shape) * itemsize``).
        num_blocks: engine blocks per layer.
        backend: attention backend name, e.g. ``"CPU_ATTN"``.
        device: ``"cpu"`` or ``"cuda:N"``.
    """

    layer_names: tuple[str, ...]
    block_dim: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    block_bytes: int
    num_blocks: int
    backend: str
    device: str

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def chunk_bytes(self, blocks_per_chunk: int) -> int:
        """Bytes of one chunk page: layers × blocks per chunk × block bytes."""
        return self.num_layers * blocks_per_chunk * self.block_bytes

    def describe(self) -> str:
        """Canonical layout string for the namespace, e.g. ``CPU_ATTN:B@0:[32,2,32,128]``."""
        dims = ",".join(str(d) for d in self.block_shape)
        return f"{self.backend}:B@{self.block_dim}:[{dims}]:{str(self.dtype).removeprefix('torch.')}"


def detect_layout(kv_caches: dict[str, torch.Tensor], num_blocks: int, backend: str) -> KVLayout:
    """Find the block dimension and per-block bytes of the registered caches.

    Args:
        kv_caches: vLLM's ``register_kv_caches`` argument, layer name → tensor.
        num_blocks: engine blocks per layer (``KVCacheConfig.num_blocks``).
        backend: attention backend name, recorded in the namespace.

    Raises:
        ConfigError: no layers, layers of different shapes or dtypes, or no dimension of size
            ``num_blocks`` (a layout kvtier cannot address block by block).
    """
    if not kv_caches:
        raise ConfigError("vLLM registered no KV cache tensors; kvtier needs an attention model with a KV cache")
    names = tuple(kv_caches)
    first = kv_caches[names[0]]
    for name in names[1:]:
        t = kv_caches[name]
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ConfigError(f"KV cache layer {name} has shape {tuple(t.shape)} {t.dtype} but {names[0]} has "
                              f"{tuple(first.shape)} {first.dtype}; kvtier supports one uniform KV cache group")
    candidates = [d for d, size in enumerate(first.shape) if size == num_blocks]
    if not candidates:
        raise ConfigError(f"no dimension of the KV cache tensor {tuple(first.shape)} has the engine's "
                          f"{num_blocks} blocks; this attention backend's layout is not supported by kvtier")
    # Several dimensions can equal num_blocks by coincidence; the block dimension is the
    # physically outermost of them (largest stride), as in every vLLM layout.
    block_dim = max(candidates, key=lambda d: first.stride(d))
    block_shape = tuple(s for d, s in enumerate(first.shape) if d != block_dim)
    block_bytes = math.prod(block_shape) * first.element_size()
    return KVLayout(names, block_dim, block_shape, first.dtype, block_bytes, num_blocks, backend, str(first.device))


def detect_group_layouts(kv_caches: dict[str, torch.Tensor], kv_cache_config: Any,
                         backend_of: Callable[[str], str]) -> dict[int, KVLayout]:
    """One :class:`KVLayout` per KV cache group of a hybrid model (index → layout).

    With the hybrid KV cache manager, vLLM gives every group its own block table but lays the
    groups' layers over shared memory: block id ``b`` of a state layer and block id ``b`` of an
    attention layer can be the same bytes, and a block id belongs to one group at a time.  So each
    group is copied through its own layers only, and a state layer's block is its view of the page
    (vLLM 0.32 CPU: ``int8 [num_blocks, 1, 1, state_bytes]``, only the state's bytes, not the
    padded page).

    Args:
        kv_caches: ``register_kv_caches``'s argument; kv_cache_config: vLLM's ``KVCacheConfig``.
        backend_of: layer name → attention backend name (recorded in the namespace).

    Raises:
        ConfigError: a group's layers are missing from ``kv_caches`` or differ in shape (as
            :func:`detect_layout`).
    """
    num_blocks = int(kv_cache_config.num_blocks)
    out: dict[int, KVLayout] = {}
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        names = [n for n in group.layer_names if n in kv_caches]
        if len(names) != len(group.layer_names):
            missing = sorted(set(group.layer_names) - set(names))
            raise ConfigError(f"vLLM registered no KV cache tensor for {', '.join(missing[:3])} of KV cache group "
                              f"{index}; kvtier cannot copy that group")
        out[index] = detect_layout({n: kv_caches[n] for n in names}, num_blocks, backend_of(names[0]))
    return out
