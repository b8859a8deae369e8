"""Copy engine blocks between vLLM's paged KV cache and kvtier chunk pages.

A page is a uint8 array ``[chunk_bytes]`` viewed as ``[num_layers, blocks_per_chunk, block_bytes]``
(see :mod:`kvtier.integrations.vllm.worker.layout`).  A *span* names which engine blocks go to (or come
from) which slots of one page: ``Span(page, first_slot, block_ids)``.

Two strategies, picked from the cache tensors' device:

- CPU caches (vLLM's CPU backend): each block slice is copied straight into / out of the page.
  A load computes every copy's source and destination address from each layer's, block's and
  run's offsets (:class:`HostRuns`, made here at set-up) and moves each contiguous run with one
  ``ctypes.memmove``, as vLLM's native CPU offload moves its ``(source, destination, size)``
  descriptors (vllm/v1/kv_offload/cpu/gpu_worker.py; on the CPU build, kvtier's benchmark shim
  :func:`kvtier.bench.native_cpu.host_swap_blocks_batch`): no per-block array views.  That load is
  :func:`kvtier.integrations.vllm.worker.loader.load_pages` / ``load_runs``, on the path of every
  load (where a block of a layer is one run and block ``b + 1`` follows block ``b``, vLLM's CPU
  backend, consecutive block ids of a span are one run per layer, as consecutive slots of a page
  are); a layout of several runs a block, or blocks apart, is moved run by run here
  (:func:`load_run_by_run`).  A save, and a load over a layout whose block slices are not a few
  contiguous runs, use ``numpy.copyto`` on byte views of the cache tensors (strided source or
  destination is fine).  Both are single-threaded and release the GIL, so a load running on a
  connector thread never starts an OpenMP team next to the engine's pinned ones.  A load on the
  engine's own thread (a synchronous one, ``hold_gil``) moves each run with a slice assignment
  between flat byte ``memoryview`` s of the layer and the page instead: the same bytes,
  bounds-checked, without a ctypes call's set-up (~0.25 µs less per run); it keeps the GIL, which
  that thread holds anyway.
- CUDA caches: batched (:mod:`kvtier.integrations.vllm.worker.batched`).

Thread safety: ``save`` runs on the engine's thread, ``load`` on the connector's loader threads;
they touch different engine blocks (a loading request's blocks belong to no running request).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier.integrations.vllm.cache_groups import GroupKind, GroupSpec
from kvtier.integrations.vllm.protocol import PageMove
from kvtier.integrations.vllm.worker.batched import MAX_BATCH_BYTES, Batched, Span, host_tensor
from kvtier.integrations.vllm.worker.layout import KVLayout

__all__ = ["BlockCopier", "GroupCopiers", "HostRuns", "Span", "load_run_by_run"]

MAX_HOST_RUNS = 8
"""A layout whose block slice of one layer is more than this many contiguous runs is copied with
``numpy.copyto`` instead of one ``memmove`` per run (a run that small costs more in calls than in bytes)."""

_memmove = ctypes.memmove


class HostRuns:
    """Where each block of each layer of a host KV cache lies, as contiguous byte runs.

    Args:
        host: byte views (``uint8``) of the layers' tensors, all of one shape and strides.
        block_dim: the dimension indexed by engine block id.
        num_blocks: engine blocks per layer.

    Raises:
        ValueError: the layers differ in shape or strides, or a block is more than
            :data:`MAX_HOST_RUNS` runs (the caller copies with ``numpy.copyto`` then).

    Attributes:
        layer_addresses: int64 ``[num_layers]``, each layer's first byte.
        block_stride: bytes from one block to the next within a layer.
        cache_offsets / page_offsets: int64 ``[runs]``, each run's offset from its block's first
            byte in the cache, and from its slot's first byte in a page (a slot holds the block's
            bytes in C order).
        run_bytes: bytes of one run.
        layer_list / offset_pairs: ``layer_addresses`` and ``(cache offset, page offset)`` per run,
            as Python ints (the memmove loop's).
        layer_views: each layer's bytes as one flat ``memoryview`` (the loop of a load that holds the
            GIL); ``None`` for a layout with a negative stride.
    """

    def __init__(self, host: Sequence[np.ndarray], block_dim: int, num_blocks: int) -> None:
        first = host[0]
        if any(a.shape != first.shape or a.strides != first.strides for a in host):
            raise ValueError("the layers' byte views differ in shape or strides")
        self.num_blocks = num_blocks
        self.layer_addresses = np.array([a.ctypes.data for a in host], dtype=np.int64)
        self.block_stride = first.strides[block_dim]
        shape = [n for d, n in enumerate(first.shape) if d != block_dim]
        strides = [st for d, st in enumerate(first.strides) if d != block_dim]
        inner = len(shape)  # the trailing dims [inner:] are one C-contiguous run
        run = 1
        while inner > 0 and strides[inner - 1] == run:
            inner -= 1
            run *= shape[inner]
        self.run_bytes = run
        outer = shape[:inner]
        if math.prod(outer) > MAX_HOST_RUNS:
            raise ValueError(f"a block is {math.prod(outer)} runs of {run} bytes")
        index = np.indices(outer).reshape(len(outer), -1) if outer else np.zeros((0, 1), dtype=np.int64)
        self.cache_offsets = (np.array(strides[:inner], dtype=np.int64)[:, None] * index).sum(axis=0).astype(np.int64)
        self.page_offsets = np.arange(math.prod(outer), dtype=np.int64) * run
        # the same as Python ints, for the memmove loop (loader.load_runs)
        self.layer_list: list[int] = self.layer_addresses.tolist()
        self.offset_pairs: list[tuple[int, int]] = list(zip(self.cache_offsets.tolist(), self.page_offsets.tolist()))
        extent = 1 + sum((d - 1) * st for d, st in zip(first.shape, first.strides))  # a layer's first to last byte
        self.layer_views = [memoryview((ctypes.c_ubyte * extent).from_address(a)).cast("B") for a in self.layer_list] \
            if min(first.strides, default=0) >= 0 and first.size else None


class BlockCopier:
    """Moves blocks of all registered layers to and from chunk pages.

    Args:
        layout: the detected layout.
        kv_caches: vLLM's registered caches (same tensors the layout was detected from).
        blocks_per_chunk: ``chunk_tokens // block_size``.
        batched: use the batched path (default: when the caches are on a GPU); True on host
            tensors runs the same batched code without streams (tests of its mapping).
        max_batch_bytes: device buffer of one batch per direction, bytes (batched path).

    Attributes:
        runs: where each block lies as a few contiguous runs (:class:`HostRuns`), on host caches
            whose block slice is at most :data:`MAX_HOST_RUNS` runs; ``None`` otherwise (CUDA,
            strided layouts: :meth:`load`).
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
        self.runs: HostRuns | None = None  # the memmove load path (loader.load_runs)
        if self._host is not None:
            try:
                runs = HostRuns(self._host, layout.block_dim, layout.num_blocks)
            except ValueError:
                runs = None
            if runs is not None and len(runs.page_offsets) * runs.run_bytes == layout.block_bytes:
                self.runs = runs

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
        (``wait=False`` on CUDA: returns the event the copies end with instead; None otherwise).

        The batched path on CUDA; on host caches ``numpy.copyto`` per block and layer (or torch's
        copy where the layers have no byte view).  A copier with :attr:`runs` (host caches of a few
        runs a block: vLLM's CPU backend) is loaded with one ``memmove`` per run by
        :func:`~kvtier.integrations.vllm.worker.loader.load_runs`, what a load runs.

        Raises:
            IndexError: on host caches, a block id or slot out of range (the blocks before it are copied).
        """
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


def load_run_by_run(copier: BlockCopier, todo: Sequence[tuple[Any, int, Sequence[int]]],
                    views: list[memoryview] | None) -> None:
    """:func:`~kvtier.integrations.vllm.worker.loader.load_runs` where a block of a layer is several
    runs, or block ``b + 1`` does not follow block ``b``: one ``memmove`` per run of :attr:`HostRuns.offset_pairs`
    (``views``, on the engine's thread: one slice assignment of flat memoryviews), block by block, each
    layer by layer.  ``todo``: per span (its page's address, or with ``views`` its flat ``memoryview``;
    the first slot; the block ids), every address already checked by the caller."""
    runs = copier.runs
    assert runs is not None
    # [block][layer][run]: a block's slot in each layer of its page, then the next block (layer by layer,
    # each page front to back, measured slower: 5.2-5.4 ms against 4.7-4.8 for a 4,000-token hit, 2026-12-06)
    block_bytes, stride, offsets, n = copier.layout.block_bytes, runs.block_stride, runs.offset_pairs, runs.run_bytes
    slot_bytes = copier.blocks_per_chunk * block_bytes
    if views is not None:  # the same runs in the same order, each a slice assignment (no ctypes call)
        for page_view, first_slot, block_ids in todo:
            for j, block in enumerate(block_ids):
                src, dst = (first_slot + j) * block_bytes, block * stride
                for view in views:
                    for cache_offset, page_offset in offsets:
                        to, at = dst + cache_offset, src + page_offset
                        view[to:to + n] = page_view[at:at + n]
                    src += slot_bytes
        return
    for address, first_slot, block_ids in todo:
        for j, block in enumerate(block_ids):
            src = address + (first_slot + j) * block_bytes
            dst = block * stride
            for layer_address in runs.layer_list:
                for cache_offset, page_offset in offsets:
                    _memmove(layer_address + dst + cache_offset, src + page_offset, n)
                src += slot_bytes


class GroupCopiers:
    """One :class:`BlockCopier` per KV cache group, over pages of :attr:`page_bytes` bytes.

    Each group has its own layers (:func:`~kvtier.integrations.vllm.worker.layout.detect_group_layouts`)
    and its own page shape: ``[group layers, slots, block bytes]`` with ``chunk_tokens /
    block_size`` slots for a full-attention or sliding-window page and one slot for a state page
    (the snapshot).  The store holds pages of one size, the largest group's; a smaller page uses
    the front of its buffer.  A load of pages into their blocks is
    :func:`~kvtier.integrations.vllm.worker.loader.load_pages`'s (the loader's path).

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

    def spans(self, moves: Sequence[tuple[PageMove, np.ndarray]]) -> dict[int, list[Span]]:
        """``(page, buffer)`` pairs as spans by group, each over the front of its buffer its group's page uses."""
        out: dict[int, list[Span]] = {}
        for page, buffer in moves:
            front = buffer[:self.group_page_bytes[page.group]]
            out.setdefault(page.group, []).append(Span(front, page.first_slot, page.block_ids))
        return out

    def save(self, moves: Sequence[tuple[PageMove, np.ndarray]], after: Any = None) -> None:
        """Copy each page's engine blocks into its buffer (``after``: :meth:`mark`'s event; ``None``:
        ordered after the calling thread's current stream)."""
        for group, spans in self.spans(moves).items():
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
