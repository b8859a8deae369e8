"""The KV cache groups of an engine as kvtier sees them: kind, block size, layers, page bytes.

vLLM gives every model one KV cache group per layer kind (a dense model: one full-attention
group; a hybrid model, vLLM's hybrid memory allocator (HMA): several), each with its own block
table (``KVCacheBlocks.get_block_ids()``: one list per group, null block ``0`` where a group
keeps nothing).  Both sides of the connector read the groups from the same ``KVCacheConfig``
(:func:`groups_from_kv_cache_config`, by class name and public fields): the scheduler plans
pages over them (:mod:`kvtier.integrations.vllm.scheduler.pages`), the workers copy pages of
each group's shape (:mod:`kvtier.integrations.vllm.worker.copy`).

- **full attention** (``FullAttentionSpec``, ``MLAAttentionSpec``): every chunk of the prefix.
- **sliding window** (``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``): the chunks of the
  window before a boundary.
- **state** (``MambaSpec`` in ``mamba_cache_mode="align"``, vLLM's mode with prefix caching):
  one engine block holding the state after a boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvtier.core.errors import ConfigError

NULL_BLOCK = 0
"""vLLM's null block id: a position the group holds nothing for."""


class GroupKind(str, Enum):
    FULL = "full"
    SLIDING = "sliding"
    STATE = "state"


_KIND_OF_SPEC = {
    "FullAttentionSpec": GroupKind.FULL,
    "MLAAttentionSpec": GroupKind.FULL,
    "SlidingWindowSpec": GroupKind.SLIDING,
    "SlidingWindowMLASpec": GroupKind.SLIDING,
    "ChunkedLocalAttentionSpec": GroupKind.SLIDING,
    "MambaSpec": GroupKind.STATE,
}


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group as kvtier plans for it.

    Attributes:
        index: the group's index in ``KVCacheConfig.kv_cache_groups`` (part of every key).
        kind: full attention, sliding window or state.
        block_size: tokens per engine block of this group.
        layer_names: the group's layers, in vLLM's order.
        window_tokens: SLIDING only: tokens before a position the layers attend to, plus vLLM's
            ``extra_retained_tokens`` (``sliding_window`` or ``attention_chunk_size``).
        page_bytes: bytes of one engine block of one layer (``spec.page_size_bytes``).
    """

    index: int
    kind: GroupKind
    block_size: int
    layer_names: tuple[str, ...]
    window_tokens: int = 0
    page_bytes: int = 0

    def window_chunks(self, chunk_tokens: int) -> int | None:
        """Chunks before a boundary this group needs; ``None`` = all (full attention).

        SLIDING: ``max(cdiv(W, C), cdiv(W - 1 + extra, C))`` as vLLM's offloading connector
        counts it (W the window, C ``chunk_tokens``); STATE: 1 (the snapshot's chunk).
        """
        if self.kind is GroupKind.FULL:
            return None
        if self.kind is GroupKind.STATE:
            return 1
        return max(1, -(-self.window_tokens // chunk_tokens))

    def chunk_bytes(self, chunk_tokens: int) -> int:
        """Bytes of one stored page of this group: layers × blocks kept per chunk × block bytes
        (a state page keeps one block: the snapshot)."""
        blocks = 1 if self.kind is GroupKind.STATE else chunk_tokens // self.block_size
        return len(self.layer_names) * blocks * self.page_bytes


def _spec_kind(spec: object) -> GroupKind | None:
    name = type(spec).__name__
    if name == "UniformTypeKVCacheSpecs":  # one group whose layers differ only in shape
        kinds = {_spec_kind(s) for s in getattr(spec, "kv_cache_specs", {}).values()}
        return kinds.pop() if len(kinds) == 1 else None
    return _KIND_OF_SPEC.get(name)


def groups_from_kv_cache_config(kv_cache_config: Any) -> tuple[GroupSpec, ...]:
    """The groups of a vLLM ``KVCacheConfig`` (``vllm/v1/kv_cache_interface.py``).

    Groups vLLM marks ``enable_kv_transfer=False`` are left out (they are rebuilt from another
    group after a load); the others keep their index.

    Raises:
        ConfigError: a group kind kvtier does not handle (cross attention, encoder-only, sink
            or circular-buffer attention, ...), or a state group not in ``align`` mode (vLLM
            keeps boundary states only with prefix caching on).
    """
    out = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue  # an engine-side replica vLLM rebuilds from its source group after a load
        spec = group.kv_cache_spec
        kind = _spec_kind(spec)
        if kind is None:
            raise ConfigError(f"KV cache group {index} is {type(spec).__name__}, which kvtier does not store; "
                              "drop the kvtier connector for this model")
        if kind is GroupKind.STATE and getattr(spec, "mamba_cache_mode", "align") != "align":
            raise ConfigError(f"KV cache group {index} keeps model state in mamba_cache_mode="
                              f"{spec.mamba_cache_mode!r}; kvtier needs 'align' (enable prefix caching)")
        window = 0
        if kind is GroupKind.SLIDING:
            window = int(getattr(spec, "sliding_window", None) or spec.attention_chunk_size)
            window += int(getattr(spec, "extra_retained_tokens", 0) or 0)
        out.append(GroupSpec(index=index, kind=kind, block_size=int(spec.block_size),
                             layer_names=tuple(group.layer_names), window_tokens=window,
                             page_bytes=int(spec.page_size_bytes)))
    return tuple(out)


def is_dense(groups: Sequence[GroupSpec]) -> bool:
    """One full-attention group: pages are chunks, named by the chunk key itself."""
    return len(groups) == 1 and groups[0].kind is GroupKind.FULL
