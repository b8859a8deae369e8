"""The plan arithmetic: which pages of which KV cache group a request's hit, loads and saves move.

Every model takes this path: a dense model is a one-group plan (one full-attention group) whose
pages are its chunks, named by the chunk key; a hybrid model's page is named by
``group_key(chunk key, group)``: the prefix up to and including that chunk, and the group.  The
groups are :mod:`kvtier.integrations.vllm.cache_groups`'.  To resume a request at a chunk boundary ``b`` (a multiple of ``chunk_tokens``), each
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
boundaries of sliding-window and state groups vLLM keeps: ``0`` only the prompt's last replay boundary
(``num_prompt_tokens - 1`` rounded down), ``R > 0`` also every multiple of ``R``, ``None``
(``--prefix-cache-retention-interval None``) every block.  kvtier follows the same rule for its
sliding-window chunks, so with the default a later request can resume a sliding-window or state group
only at the end of an earlier prompt; a multi-turn conversation still hits (each turn extends the
previous prompt), a request sharing only half a prompt does not.  Full-attention groups are stored
densely whatever the setting.

Two layers, both from memory only:

- :class:`HybridPlan` (here): engine-independent arithmetic over plain :class:`GroupSpec` values and
  block tables (which boundary every group can resume at, which chunks are worth storing, which
  slots a load fills);
- :class:`~kvtier.integrations.vllm.scheduler.steps.PagePlanner` (with the mirror it reads, so that
  a dense hit runs this module not at all): the same over a request's chunk keys and the scheduler's
  mirror of the ranks' indexes, giving the :class:`~kvtier.integrations.vllm.protocol.PageMove` s of
  load and save jobs::

    lookup(chain, local, n)   hit = largest chunk boundary every group can resume at (HybridPlan.hit_tokens
                              over the mirror; a dense model: its leading chunks the mirror holds)
    load_pages(...)           per group, the pages resuming it at the hit, into the blocks vLLM allocated
    save_pages(...)           full / sliding pages of the chunks this step completes (sliding: only
                              reachable ones), state pages from this step's hand-offs
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import blake3

from kvtier.core.errors import ConfigError
from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.integrations.vllm.cache_groups import (
    NULL_BLOCK,
    GroupKind,
    GroupSpec,
    groups_from_kv_cache_config,
    is_dense,
)
from kvtier.integrations.vllm.engine_config import resolve_chunk_tokens


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
        return not is_dense(self.groups)

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
        window = None if group.kind is GroupKind.FULL else group.window_chunks(C)  # (FULL: no call on the hit path)
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


def engine_plan(vllm_config: Any, kv_cache_config: Any, chunk_tokens: int) -> HybridPlan:
    """The :class:`HybridPlan` of a running engine: its groups and its resolved
    ``prefix_cache_retention_interval`` (``KVCacheConfig``, else ``CacheConfig``)."""
    retention = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
    if retention is None and not hasattr(kv_cache_config, "prefix_cache_retention_interval"):
        retention = getattr(vllm_config.cache_config, "prefix_cache_retention_interval", 0)
    return HybridPlan(groups_from_kv_cache_config(kv_cache_config), chunk_tokens, retention)


def handoffs_of(scheduler_output: Any, req_id: str) -> list[tuple[int, int, int]]:
    """vLLM's boundary-state hand-offs of ``req_id`` this step (``SchedulerOutput.kv_connector_block_state``)."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    offloads = getattr(state, "boundary_state_offloads", None) or {}
    return [tuple(h) for h in offloads.get(req_id, ())]  # type: ignore[misc]
