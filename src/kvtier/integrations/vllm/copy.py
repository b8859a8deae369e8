"""Copy engine blocks between vLLM's paged KV cache and kvtier chunk pages.

A page is a uint8 array ``[chunk_bytes]`` viewed as ``[num_layers, blocks_per_chunk, block_bytes]``
(see :mod:`kvtier.integrations.vllm.layout`).  A *span* names which engine blocks go to (or come
from) which slots of one page: ``Span(page, first_slot, block_ids)``.

Two strategies, picked from the cache tensors' device:

- CPU caches (vLLM's CPU backend): each block slice is copied straight into / out of the page
  with ``numpy.copyto`` on byte views of the cache tensors (strided source or destination is
  fine), one copy per byte.  numpy copies are single-threaded and release the GIL, so a load
  running on a connector thread never starts an OpenMP team next to the engine's pinned ones.
- CUDA caches: blocks are gathered on the device with ``index_select``, moved through a pinned
  host staging buffer with ``non_blocking`` copies on a side stream, and the side stream is
  synchronized before the call returns, so a save never outlives the step that owns its
  blocks and a load is complete before it is reported finished.  Saves (engine thread) and loads
  (loader threads) use separate streams and staging buffers; concurrent loads serialize on a
  lock.  (Written for CUDA, exercised only on CPU in this repository's tests.)

Thread safety: ``save`` runs on the engine's thread, ``load`` on the connector's loader threads;
they touch different engine blocks (a loading request's blocks belong to no running request).
"""

from __future__ import annotations

import threading
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
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._load_stream = torch.cuda.Stream(self.device) if cuda else None
        self._staging: dict[str, torch.Tensor] = {}
        self._load_lock = threading.Lock()
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
        return torch.from_numpy(page).view(self.layout.num_layers, self.blocks_per_chunk, self.layout.block_bytes)

    def _slot(self, page_view: torch.Tensor, layer: int, slot: int) -> torch.Tensor:
        return page_view[layer, slot].view(self.layout.dtype).view(self.layout.block_shape)

    # ---- engine -> pages (save) --------------------------------------------------------------
    def save(self, spans: Sequence[Span]) -> None:
        """Copy each span's blocks of every layer into its page; returns when the bytes are there."""
        if self._stream is not None:
            self._save_cuda(spans)
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
    def load(self, spans: Sequence[Span]) -> None:
        """Copy each span's page slots into its blocks of every layer; returns when they are there."""
        if self._stream is not None:
            with self._load_lock:
                self._load_cuda(spans)
            return
        if self._host is None:
            dim = self.layout.block_dim
            for span in spans:
                view = self._page_view(span.page)
                for layer, kv in enumerate(self.layers):
                    for j, block in enumerate(span.block_ids):
                        kv.select(dim, block).copy_(self._slot(view, layer, span.first_slot + j))
            return
        for span in spans:
            slots = self._page_slots(span.page)
            for layer in range(self.layout.num_layers):
                for j, block in enumerate(span.block_ids):
                    np.copyto(self._host_block(layer, block), slots[layer, span.first_slot + j])

    # ---- CUDA path ---------------------------------------------------------------------------
    def _staging_for(self, purpose: str, num_blocks: int) -> torch.Tensor:
        shape = (self.layout.num_layers, num_blocks, self.layout.block_bytes)
        staging = self._staging.get(purpose)
        if staging is None or staging.shape[1] < num_blocks:
            staging = self._staging[purpose] = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        return staging[:, :num_blocks]

    def _save_cuda(self, spans: Sequence[Span]) -> None:
        assert self._stream is not None
        blocks = [b for span in spans for b in span.block_ids]
        if not blocks:
            return
        staging = self._staging_for("save", len(blocks))
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
        assert self._load_stream is not None
        blocks = [b for span in spans for b in span.block_ids]
        if not blocks:
            return
        staging = self._staging_for("load", len(blocks))
        pos = 0
        for span in spans:
            n = len(span.block_ids)
            staging[:, pos:pos + n].copy_(self._page_view(span.page)[:, span.first_slot:span.first_slot + n])
            pos += n
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        dim = self.layout.block_dim
        with torch.cuda.stream(self._load_stream):
            for layer, kv in enumerate(self.layers):
                dev = staging[layer].to(self.device, non_blocking=True)
                src = dev.view(self.layout.dtype).view(len(blocks), *self.layout.block_shape).movedim(0, dim)
                kv.index_copy_(dim, idx, src)
        self._load_stream.synchronize()  # the staging buffer is reused and the forward reads these blocks
