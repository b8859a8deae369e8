"""Copy engine blocks between vLLM's paged KV cache and kvtier chunk pages.

A page is a uint8 array ``[chunk_bytes]`` viewed as ``[num_layers, blocks_per_chunk, block_bytes]``
(see :mod:`kvtier.integrations.vllm.worker.layout`).  A *span* names which engine blocks go to (or come
from) which slots of one page: ``Span(page, first_slot, block_ids)``.

Two strategies, picked from the cache tensors' device:

- CPU caches (vLLM's CPU backend): each block slice is copied straight into / out of the page
  with ``numpy.copyto`` on byte views of the cache tensors (strided source or destination is
  fine), one copy per byte.  numpy copies are single-threaded and release the GIL, so a load
  running on a connector thread never starts an OpenMP team next to the engine's pinned ones.
- CUDA caches: batched (:mod:`kvtier.integrations.vllm.worker.batched`).

Thread safety: ``save`` runs on the engine's thread, ``load`` on the connector's loader threads;
they touch different engine blocks (a loading request's blocks belong to no running request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier.integrations.vllm.cache_groups import GroupKind, GroupSpec
from kvtier.integrations.vllm.protocol import PageMove
from kvtier.integrations.vllm.worker.batched import MAX_BATCH_BYTES, Batched, Span, host_tensor
from kvtier.integrations.vllm.worker.layout import KVLayout

__all__ = ["BlockCopier", "GroupCopiers", "Span"]


class BlockCopier:
    """Moves blocks of all registered layers to and from chunk pages.

    Args:
        layout: the detected layout.
        kv_caches: vLLM's registered caches (same tensors the layout was detected from).
        blocks_per_chunk: ``chunk_tokens // block_size``.
        batched: use the batched path (default: when the caches are on a GPU); True on host
            tensors runs the same batched code without streams (tests of its mapping).
        max_batch_bytes: device buffer of one batch per direction, bytes (batched path).
    """

    def __init__(self, layout: KVLayout, kv_caches: dict[str, torch.Tensor], blocks_per_chunk: int,
                 batched: bool | None = None, max_batch_bytes: int = MAX_BATCH_BYTES) -> None:
        self.layout = layout
        self.layers = [kv_caches[name] for name in layout.layer_names]
        self.blocks_per_chunk = blocks_per_chunk
        self.device = self.layers[0].device
        cuda = self.device.type == "cuda"
        self.batched = Batched(layout, self.layers, blocks_per_chunk, max_batch_bytes) \
            if (cuda if batched is None else batched) else None
        # host path: byte views of every layer and the byte shape of one block
        self._host: list[np.ndarray] | None = None
        if not cuda:
            try:
                self._host = [kv.view(torch.uint8).numpy() for kv in self.layers]
            except RuntimeError:  # innermost dimension not contiguous: copy with torch instead
                self._host = None
        self._block_byte_shape = (*layout.block_shape[:-1], layout.block_shape[-1] * self.layers[0].element_size()) \
            if layout.block_shape else (self.layers[0].element_size(),)

    def _page_slots(self, page: np.ndarray) -> np.ndarray:
        """``page`` as ``[num_layers, blocks_per_chunk, *block byte shape]`` (a view)."""
        return page.reshape(self.layout.num_layers, self.blocks_per_chunk, *self._block_byte_shape)

    def _host_block(self, layer: int, block: int) -> np.ndarray:
        assert self._host is not None
        arr = self._host[layer]
        return arr[(slice(None),) * self.layout.block_dim + (block,)]

    def _page_view(self, page: np.ndarray) -> torch.Tensor:
        return host_tensor(page).view(self.layout.num_layers, self.blocks_per_chunk, self.layout.block_bytes)

    def _slot(self, page_view: torch.Tensor, layer: int, slot: int) -> torch.Tensor:
        return page_view[layer, slot].view(self.layout.dtype).view(self.layout.block_shape)

    # ---- engine -> pages (save) --------------------------------------------------------------
    def save(self, spans: Sequence[Span], after: Any = None) -> None:
        """Copy each span's blocks of every layer into its page; returns when the bytes are there.
        ``after``: the CUDA event the forward that wrote the blocks was followed by (:meth:`GroupCopiers.mark`)."""
        if self.batched is not None:
            self.batched.save(spans, after)
            return
        if self._host is None:
            dim = self.layout.block_dim
            for span in spans:
                view = self._page_view(span.page)
                for layer, kv in enumerate(self.layers):
                    for j, block in enumerate(span.block_ids):
                        self._slot(view, layer, span.first_slot + j).copy_(kv.select(dim, block))
            return
        for span in spans:
            slots = self._page_slots(span.page)
            for layer in range(self.layout.num_layers):
                for j, block in enumerate(span.block_ids):
                    np.copyto(slots[layer, span.first_slot + j], self._host_block(layer, block))

    # ---- pages -> engine (load) --------------------------------------------------------------
    def load(self, spans: Sequence[Span], wait: bool = True) -> Any:
        """Copy each span's page slots into its blocks of every layer; returns when they are there
        (``wait=False`` on CUDA: returns the event the copies end with instead; None otherwise)."""
        if self.batched is not None:
            return self.batched.load(spans, wait)
        if self._host is None:
            dim = self.layout.block_dim
            for span in spans:
                view = self._page_view(span.page)
                for layer, kv in enumerate(self.layers):
                    for j, block in enumerate(span.block_ids):
                        kv.select(dim, block).copy_(self._slot(view, layer, span.first_slot + j))
            return None
        for span in spans:
            slots = self._page_slots(span.page)
            for layer in range(self.layout.num_layers):
                for j, block in enumerate(span.block_ids):
                    np.copyto(self._host_block(layer, block), slots[layer, span.first_slot + j])
        return None


class GroupCopiers:
    """One :class:`BlockCopier` per KV cache group, over pages of :attr:`page_bytes` bytes.

    Each group has its own layers (:func:`~kvtier.integrations.vllm.worker.layout.detect_group_layouts`)
    and its own page shape: ``[group layers, slots, block bytes]`` with ``chunk_tokens /
    block_size`` slots for a full-attention or sliding-window page and one slot for a state page
    (the snapshot).  The store holds pages of one size, the largest group's; a smaller page uses
    the front of its buffer.

    Args:
        groups: the engine's KV cache groups.
        chunk_tokens: tokens per chunk.
        layouts: group index → layout of that group's layers.
        kv_caches: vLLM's registered caches.
    """

    def __init__(self, groups: Sequence[GroupSpec], chunk_tokens: int, layouts: dict[int, KVLayout],
                 kv_caches: dict[str, Any]) -> None:
        self.copiers: dict[int, BlockCopier] = {}
        self.group_page_bytes: dict[int, int] = {}
        for group in groups:
            layout = layouts[group.index]
            slots = 1 if group.kind is GroupKind.STATE else chunk_tokens // group.block_size
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

    def save(self, moves: Sequence[tuple[PageMove, np.ndarray]], after: Any = None) -> None:
        """Copy each page's engine blocks into its buffer (``after``: :meth:`mark`'s event; ``None``:
        ordered after the calling thread's current stream)."""
        for group, spans in self._spans(moves).items():
            self.copiers[group].save(spans, after)

    def mark(self) -> Any:
        """On CUDA, an event recorded now on the calling (engine) thread's current stream, after the
        forward it queued: a copy made later from another thread waits for it on the device, never
        on a host (a few microseconds to record); on the host ``None`` (the forward is done when
        ``wait_for_save`` is called)."""
        device = next(iter(self.copiers.values())).device
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def load(self, moves: Sequence[tuple[PageMove, np.ndarray]]) -> None:
        """Copy each buffer into its page's engine blocks."""
        for group, spans in self._spans(moves).items():
            self.copiers[group].load(spans)

    def moved_bytes(self, pages: Sequence[PageMove]) -> int:
        """Engine bytes the pages cover (all layers of their groups)."""
        return sum(len(p.block_ids) * self.block_bytes[p.group] for p in pages)

