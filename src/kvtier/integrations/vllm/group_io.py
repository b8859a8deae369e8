"""Worker side of every model: moves the pages of every KV cache group between the engine and
one rank's store (a dense model is one full-attention group whose pages are its chunks).

Each group has its own layers (:func:`~kvtier.integrations.vllm.layout.detect_group_layouts`)
and its own page shape: ``[group layers, slots, block bytes]`` with ``chunk_tokens /
block_size`` slots for a full-attention or sliding-window page and one slot for a state page
(the snapshot).  The store holds pages of one size, the largest group's; a smaller page uses
the front of its buffer.

Saves (engine thread, after the forward pass, :meth:`~kvtier.integrations.vllm.worker.WorkerSide.save`)
and loads (loader threads, :mod:`~kvtier.integrations.vllm.loader`) follow the store's two-phase
contract: ``prepare_*`` pins or reserves, the copy runs, ``complete_*`` runs on every path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

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
