"""Copy engine blocks between vLLM's paged KV cache and kvtier chunk pages.

A page is a uint8 array ``[chunk_bytes]`` viewed as ``[num_layers, blocks_per_chunk, block_bytes]``
(see :mod:`kvtier.integrations.vllm.layout`).  A *span* names which engine blocks go to (or come
from) which slots of one page: ``Span(page, first_slot, block_ids)``.

Two strategies, picked from the cache tensors' device:

- CPU caches (vLLM's CPU backend): each block slice is copied straight into / out of the page
  with ``Tensor.copy_`` (strided source or destination is fine), one copy per byte.
- CUDA caches: blocks are gathered on the device with ``index_select``, moved through a pinned
  host staging buffer with ``non_blocking`` copies on a side stream, and the side stream is
  synchronized before the call returns, so a save never outlives the step that owns its
  blocks and a load is complete before the forward pass reads it.  (Written for CUDA, exercised
  only on CPU in this repository's tests: the test machines have no GPU.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.integrations.vllm.layout import KVLayout


@dataclass(frozen=True)
class Span:
    """Blocks ``block_ids`` occupy page slots ``first_slot .. first_slot + len(block_ids) - 1``."""

    page: np.ndarray
    first_slot: int
    block_ids: Sequence[int]


class BlockCopier:
    """Moves blocks of all registered layers to and from chunk pages.

    Args:
        layout: the detected layout.
        kv_caches: vLLM's registered caches (same tensors the layout was detected from).
        blocks_per_chunk: ``chunk_tokens // block_size``.
    """

    def __init__(self, layout: KVLayout, kv_caches: dict[str, torch.Tensor], blocks_per_chunk: int) -> None:
        self.layout = layout
        self.layers = [kv_caches[name] for name in layout.layer_names]
        self.blocks_per_chunk = blocks_per_chunk
        self.device = self.layers[0].device
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._staging: torch.Tensor | None = None

    def _page_view(self, page: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(page).view(self.layout.num_layers, self.blocks_per_chunk, self.layout.block_bytes)

    def _slot(self, page_view: torch.Tensor, layer: int, slot: int) -> torch.Tensor:
        return page_view[layer, slot].view(self.layout.dtype).view(self.layout.block_shape)

    # ---- engine -> pages (save) --------------------------------------------------------------
    def save(self, spans: Sequence[Span]) -> None:
        """Copy each span's blocks of every layer into its page; returns when the bytes are there."""
        if self._stream is not None:
            self._save_cuda(spans)
            return
        dim = self.layout.block_dim
        for span in spans:
            view = self._page_view(span.page)
            for layer, kv in enumerate(self.layers):
                for j, block in enumerate(span.block_ids):
                    self._slot(view, layer, span.first_slot + j).copy_(kv.select(dim, block))

    # ---- pages -> engine (load) --------------------------------------------------------------
    def load(self, spans: Sequence[Span]) -> None:
        """Copy each span's page slots into its blocks of every layer; returns when they are there."""
        if self._stream is not None:
            self._load_cuda(spans)
            return
        dim = self.layout.block_dim
        for span in spans:
            view = self._page_view(span.page)
            for layer, kv in enumerate(self.layers):
                for j, block in enumerate(span.block_ids):
                    kv.select(dim, block).copy_(self._slot(view, layer, span.first_slot + j))

    # ---- CUDA path ---------------------------------------------------------------------------
    def _staging_for(self, num_blocks: int) -> torch.Tensor:
        shape = (self.layout.num_layers, num_blocks, self.layout.block_bytes)
        if self._staging is None or self._staging.shape[1] < num_blocks:
            self._staging = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        return self._staging[:, :num_blocks]

    def _save_cuda(self, spans: Sequence[Span]) -> None:
        assert self._stream is not None
        blocks = [b for span in spans for b in span.block_ids]
        if not blocks:
            return
        staging = self._staging_for(len(blocks))
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        dim = self.layout.block_dim
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward wrote these blocks
        with torch.cuda.stream(self._stream):
            for layer, kv in enumerate(self.layers):
                gathered = kv.index_select(dim, idx).movedim(dim, 0).contiguous()
                staging[layer].copy_(gathered.view(len(blocks), -1).view(torch.uint8), non_blocking=True)
        self._stream.synchronize()
        pos = 0
        for span in spans:
            n = len(span.block_ids)
            view = self._page_view(span.page)
            view[:, span.first_slot:span.first_slot + n].copy_(staging[:, pos:pos + n])
            pos += n

    def _load_cuda(self, spans: Sequence[Span]) -> None:
        assert self._stream is not None
        blocks = [b for span in spans for b in span.block_ids]
        if not blocks:
            return
        staging = self._staging_for(len(blocks))
        pos = 0
        for span in spans:
            n = len(span.block_ids)
            staging[:, pos:pos + n].copy_(self._page_view(span.page)[:, span.first_slot:span.first_slot + n])
            pos += n
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        dim = self.layout.block_dim
        with torch.cuda.stream(self._stream):
            for layer, kv in enumerate(self.layers):
                dev = staging[layer].to(self.device, non_blocking=True)
                src = dev.view(self.layout.dtype).view(len(blocks), *self.layout.block_shape).movedim(0, dim)
                kv.index_copy_(dim, idx, src)
        self._stream.synchronize()  # the staging buffer is reused and the forward reads these blocks
