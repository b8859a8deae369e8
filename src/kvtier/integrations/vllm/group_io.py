"""Worker side of hybrid models: moves the pages of every KV cache group between the engine and
one rank's store.

Each group has its own layers (:func:`~kvtier.integrations.vllm.layout.detect_group_layouts`)
and its own page shape: ``[group layers, slots, block bytes]`` with ``chunk_tokens /
block_size`` slots for a full-attention or sliding-window page and one slot for a state page
(the snapshot).  The store holds pages of one size, the largest group's; a smaller page uses
the front of its buffer.

Saves (engine thread, after the forward pass) and loads (loader threads) follow the store's
two-phase contract: ``prepare_*`` pins or reserves, the copy runs, ``complete_*`` runs on every
path.  A hybrid load is all or nothing: vLLM takes no block-level load errors when a model has
several KV cache groups (vllm/v1/core/sched/scheduler.py ``_handle_invalid_blocks``), so a load
that cannot deliver every page is reported as a failed request and recomputed whole.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.core.keys import ChunkKey
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.copy import BlockCopier, Span
from kvtier.integrations.vllm.groups import GroupKind, HybridPlan
from kvtier.integrations.vllm.layout import KVLayout
from kvtier.integrations.vllm.protocol import PageMove

log = logging.getLogger(__name__)


class GroupCopiers:
    """One :class:`BlockCopier` per KV cache group, over pages of :attr:`page_bytes` bytes.

    Args:
        plan: the engine's per-group plan.
        layouts: group index → layout of that group's layers.
        kv_caches: vLLM's registered caches.
    """

    def __init__(self, plan: HybridPlan, layouts: dict[int, KVLayout], kv_caches: dict[str, Any]) -> None:
        self.copiers: dict[int, BlockCopier] = {}
        self.group_page_bytes: dict[int, int] = {}
        for group in plan.groups:
            layout = layouts[group.index]
            slots = 1 if group.kind is GroupKind.STATE else plan.chunk_tokens // group.block_size
            self.copiers[group.index] = BlockCopier(layout, kv_caches, slots)
            self.group_page_bytes[group.index] = layout.chunk_bytes(slots)
        self.page_bytes = max(self.group_page_bytes.values())
        self.block_bytes = {g: layouts[g].block_bytes * layouts[g].num_layers for g in layouts}

    def _spans(self, moves: Sequence[tuple[PageMove, np.ndarray]]) -> dict[int, list[Span]]:
        out: dict[int, list[Span]] = {}
        for page, buffer in moves:
            front = buffer[:self.group_page_bytes[page.group]]
            out.setdefault(page.group, []).append(Span(front, page.first_slot, page.block_ids))
        return out

    def save(self, moves: Sequence[tuple[PageMove, np.ndarray]]) -> None:
        """Copy each page's engine blocks into its buffer."""
        for group, spans in self._spans(moves).items():
            self.copiers[group].save(spans)

    def load(self, moves: Sequence[tuple[PageMove, np.ndarray]]) -> None:
        """Copy each buffer into its page's engine blocks."""
        for group, spans in self._spans(moves).items():
            self.copiers[group].load(spans)

    def moved_bytes(self, pages: Sequence[PageMove]) -> int:
        """Engine bytes the pages cover (all layers of their groups)."""
        return sum(len(p.block_ids) * self.block_bytes[p.group] for p in pages)


def save_pages(store: TieredStore, copiers: GroupCopiers, pages: Sequence[PageMove]) -> int:
    """Store the pages not stored yet; returns how many were stored.

    Pages go to the store as one chain in the order given (the scheduler lists each group's
    pages in chunk order), so the eviction policy sees each page's predecessor as its parent.
    """
    handle = store.prepare_store([ChunkKey(p.key) for p in pages])
    if not handle.num_chunks:
        return 0
    ok = False
    try:
        copiers.save([(pages[i], buffer) for i, buffer in zip(handle.indices, handle.buffers)])
        ok = True
    finally:
        store.complete_store(handle, ok)
    return handle.num_chunks


def load_pages(store: TieredStore, copiers: GroupCopiers, pages: Sequence[PageMove]) -> list[str] | None:
    """Copy every page into the engine; the tier of each page, or ``None`` when the store no
    longer holds them all (nothing is then counted as a hit)."""
    handle = store.prepare_load([ChunkKey(p.key) for p in pages])
    if handle.num_chunks < len(pages):
        store.cancel_load(handle)
        return None
    ok = False
    try:
        copiers.load(list(zip(pages, handle.buffers)))
        ok = True
    finally:
        store.complete_load(handle, ok)
    return list(handle.tiers)
