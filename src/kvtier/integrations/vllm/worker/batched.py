"""The batched copy path between engine blocks and pages: CUDA caches, or host tensors when asked (tests).

The spans of one call are planned (:func:`plan_batches`) into batches of at most
``max_batch_bytes``; each batch has a device buffer laid out page by page
(``[span][layer][slot]``), so every span's bytes are one contiguous run on the device and in its
page (a full page: one copy of ``chunk_bytes``; a partial span: one copy per layer).  A save
gathers the blocks of every layer into the buffer on the device (one ``index_select`` and one
``index_copy_`` per layer and batch, whatever the page size) and copies each span's run straight
into its tier page; a load copies each page's run into the buffer and scatters it into the
blocks.  Host copies go straight to the page when it lies in pinned memory (the cpu tier's pool,
registered by :meth:`~kvtier.core.tiers.cpu.tier.CpuTier.pin_host_memory`, and the landing buffers of
:mod:`kvtier.core.landing`); other pages (a private buffer once those are out, a pool whose registration
failed) bounce through a pinned buffer, logged once per copier.  So a copy's cost does not collapse
with small engine pages (vLLM#57555: per-block DMAs at 16 KiB), and no host memcpy sits on the pinned path.

Ordering (CUDA streams; every wait is on the device, the host waits only for kvtier's own copies):

* save (engine thread, after the forward): the save kernel stream waits for the engine's current
  stream (the forward wrote these blocks), the host copies wait for the gathers; the call returns
  once they are done (an event on the copy stream), because the store publishes the pages when it
  returns and another reader may then read them.
* load (loader threads): the load kernel stream waits for the engine's compute stream (captured
  when the copier is built, on the engine thread): vLLM zeroes newly allocated blocks on it and a
  load must land after that zeroing (vllm/v1/kv_offload/cpu/gpu_worker.py ``transfer_async``); the
  scatters wait for the host copies, and the call returns once the scatters are done (an event on
  the kernel stream), so the request is reported finished only when its blocks hold the bytes, and
  the page's pin outlives the DMA.

Each direction has a kernel stream and a host-copy stream with two device buffers used in turn,
so one batch's gather (or scatter) overlaps the previous batch's transfer; events order each
buffer's uses.  Saves and loads have their own streams, buffers and locks; concurrent loads
serialize on theirs.
The same batched code runs on CPU tensors when asked (``batched=True``, no streams), which is how
its block/page mapping is tested without a GPU.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.core.pinned import is_pinned
from kvtier.integrations.vllm.worker.layout import KVLayout

log = logging.getLogger(__name__)

MAX_BATCH_BYTES = 64 << 20
"""Default largest batch, bytes: each direction holds two device buffers of it (memory outside vLLM's
KV cache budget, so small; large enough that enqueuing a batch's kernels takes less time than its transfer)."""


@dataclass(frozen=True)
class Span:
    """Blocks ``block_ids`` occupy page slots ``first_slot .. first_slot + len(block_ids) - 1``."""

    page: np.ndarray
    first_slot: int
    block_ids: Sequence[int]


@dataclass(frozen=True)
class HostRun:
    """One contiguous host copy of a batch: ``nbytes`` at ``page_offset`` of span ``span``'s page
    and at ``buffer_offset`` of the batch's device buffer (bytes)."""

    span: int
    page_offset: int
    buffer_offset: int
    nbytes: int


@dataclass(frozen=True)
class BatchPlan:
    """One batch of a call's spans (see :func:`plan_batches`).

    Attributes:
        blocks: int64 ``[n]``, the engine block ids of the batch, span by span.
        rows: int64 ``[num_layers, n]``: the buffer row (of ``block_bytes``) that block ``j`` of
            layer ``l`` occupies; the buffer is ``[span][layer][slot]``, so a span's bytes are contiguous.
        runs: the host copies, one per span holding a whole page, else one per layer.
        buffer_bytes: bytes of the batch's device buffer (``n * num_layers * block_bytes``).
    """

    blocks: np.ndarray
    rows: np.ndarray
    runs: tuple[HostRun, ...]
    buffer_bytes: int


def plan_batches(spans: Sequence[tuple[int, int]], num_layers: int, blocks_per_chunk: int, block_bytes: int,
                 max_batch_bytes: int = MAX_BATCH_BYTES) -> list[BatchPlan]:
    """Plan the batched copy of spans given as ``(first_slot, num_blocks)``: which buffer rows each
    layer's blocks take and which contiguous host copies move them (device independent).

    A batch takes whole spans while its buffer stays within ``max_batch_bytes`` (a span larger than
    that is a batch of its own).  Spans of no blocks are skipped.

    Returns:
        the batches in order; :attr:`BatchPlan.blocks` holds positions into the spans' block ids
        concatenated in span order (``0 .. total - 1``), which the caller maps to engine block ids.

    Raises:
        ValueError: a span reaching past its page's ``blocks_per_chunk`` slots, or a non-positive size.
    """
    if num_layers <= 0 or blocks_per_chunk <= 0 or block_bytes <= 0:
        raise ValueError(f"layers {num_layers}, slots {blocks_per_chunk} and block bytes {block_bytes} must be positive")
    span_bytes = num_layers * block_bytes
    batches: list[list[tuple[int, int, int, int]]] = []  # (span index, first slot, blocks, first position)
    current: list[tuple[int, int, int, int]] = []
    used = position = 0
    for index, (first_slot, n) in enumerate(spans):
        if first_slot < 0 or n < 0 or first_slot + n > blocks_per_chunk:
            raise ValueError(f"span {index}: slots {first_slot}..{first_slot + n - 1} do not fit a page of "
                             f"{blocks_per_chunk} slots")
        if n == 0:
            continue
        need = n * span_bytes
        if current and used + need > max_batch_bytes:
            batches.append(current)
            current, used = [], 0
        current.append((index, first_slot, n, position))
        used += need
        position += n
    if current:
        batches.append(current)
    plans = []
    for batch in batches:
        total = sum(n for _i, _f, n, _p in batch)
        blocks = np.concatenate([np.arange(p, p + n, dtype=np.int64) for _i, _f, n, p in batch])
        rows = np.empty((num_layers, total), dtype=np.int64)
        runs: list[HostRun] = []
        row = col = 0
        for index, first_slot, n, _p in batch:
            # layer l's n blocks are rows row + l*n .. row + l*n + n - 1 of this span's region
            rows[:, col:col + n] = row + np.arange(num_layers, dtype=np.int64)[:, None] * n + np.arange(n)
            if n == blocks_per_chunk:  # the whole page: one run (page layout == region layout)
                runs.append(HostRun(index, 0, row * block_bytes, n * span_bytes))
            else:
                runs += [HostRun(index, (layer * blocks_per_chunk + first_slot) * block_bytes,
                                 (row + layer * n) * block_bytes, n * block_bytes) for layer in range(num_layers)]
            row += num_layers * n
            col += n
        plans.append(BatchPlan(blocks, rows, tuple(runs), row * block_bytes))
    return plans


def host_tensor(array: np.ndarray) -> torch.Tensor:
    """A zero-copy uint8 tensor over a contiguous host array (a read-only array too: it is only read)."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable": the copy only reads it
        return torch.from_numpy(array)


def direct_host_copy(on_cuda: bool, page_pinned: bool) -> bool:
    """Whether a host run goes straight between the device buffer and the page (True) or through the
    pinned staging buffer (False): on CUDA only a pinned page may be a DMA's host side without the
    driver blocking the host on a bounce of its own (CUDA Programming Guide, "Page-Locked Host
    Memory"); on the host everything is direct."""
    return page_pinned or not on_cuda


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each element size: what the batched path views every cache as."""


def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event marking ``stream``'s work so far (None on the host)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _after(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
    """Make ``stream``'s later work wait for ``event`` (on the device; nothing on the host)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def _wait(stream: torch.cuda.Stream | None) -> None:
    """Block the calling thread until ``stream``'s work so far is done (not the whole device)."""
    event = _record(stream)
    if event is not None:
        event.synchronize()


@contextmanager
def _on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        yield


class Batched:
    """The batched copy path (see the module docstring): CUDA, or the host when asked (tests).

    Each direction has two streams, one for the device kernels (gather / scatter) and one for the
    host copies, and two device buffers used in turn, so batch ``k + 1``'s kernels run while batch
    ``k``'s bytes cross the link; events order every use of a buffer after the previous one's.
    Buffers are sized once per call before any work, so none is freed while a stream uses it.
    """

    def __init__(self, layout: KVLayout, layers: list[torch.Tensor], blocks_per_chunk: int,
                 max_batch_bytes: int) -> None:
        self.layout = layout
        # bytes are moved, never values: every layer seen as integers of its element size, so the
        # gathers and scatters work for any cache dtype (fp8 too) and never touch a value
        self.word = _WORDS[layers[0].element_size()]
        self.layers = [kv.view(self.word) for kv in layers]
        self.blocks_per_chunk = blocks_per_chunk
        self.max_batch_bytes = max_batch_bytes
        self.device = layers[0].device
        self.cuda = self.device.type == "cuda"
        # the engine's compute stream: loads wait for it (block zeroing); captured on the engine thread
        self.compute = torch.cuda.current_stream(self.device) if self.cuda else None
        self.streams: dict[str, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {
            d: (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) for d in ("save", "load")} \
            if self.cuda else {}
        self.locks = {d: threading.Lock() for d in ("save", "load")}
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._staging: dict[tuple[str, int], torch.Tensor] = {}
        self._index_host: dict[tuple[str, int], torch.Tensor] = {}
        self.staged_runs = 0  # host runs bounced through the staging buffer (pages outside pinned memory)
        self._noted = False

    # ---- buffers (grown only at the start of a call, when no stream uses them) ---------------
    def _grow(self, store: dict[tuple[str, int], torch.Tensor], key: tuple[str, int], nbytes: int,
              **kwargs: Any) -> torch.Tensor:
        have = store.get(key)
        if have is None or have.numel() < nbytes:
            have = store[key] = torch.empty(nbytes, **kwargs)
        return have

    def _streams_of(self, purpose: str) -> tuple[torch.cuda.Stream | None, torch.cuda.Stream | None]:
        """(kernel stream, host-copy stream) of a direction; (None, None) on the host."""
        pair = self.streams.get(purpose)
        return (pair[0], pair[1]) if pair is not None else (None, None)

    def _indices(self, purpose: str, plans: Sequence[BatchPlan], block_ids: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each batch's (engine block ids ``[n]``, buffer rows ``[layers, n]``) on the device, from one
        pinned host array (one small DMA per batch on the current stream: no host sync)."""
        flat = np.concatenate([np.concatenate([block_ids[p.blocks], p.rows.ravel()]) for p in plans])
        if not self.cuda:
            host = torch.from_numpy(flat)
        else:
            host = self._grow(self._index_host, (purpose, 0), flat.size, dtype=torch.int64, pin_memory=True)
            host.numpy()[:flat.size] = flat
        out, pos = [], 0
        for p in plans:
            n = p.blocks.size
            part = host[pos:pos + n * (1 + self.layout.num_layers)].to(self.device, non_blocking=self.cuda)
            out.append((part[:n], part[n:].view(self.layout.num_layers, n)))
            pos += n * (1 + self.layout.num_layers)
        return out

    def _typed(self, buffer: torch.Tensor) -> torch.Tensor:
        """The buffer as rows of one block: ``[rows, *block_shape]`` of the layers' integer word."""
        return buffer.view(self.word).view(-1, *self.layout.block_shape)

    def _note_staged(self, runs: int) -> None:
        self.staged_runs += runs
        if runs and self.cuda and not self._noted:
            self._noted = True
            log.info("kvtier: GPU copies of pages outside pinned memory go through a pinned staging buffer "
                     "(the cpu tier's pool is not pinned, or a page is a private buffer)")

    def _prepare(self, purpose: str, spans: Sequence[Span]) -> tuple[list[BatchPlan], np.ndarray, list[torch.Tensor]]:
        """The call's batches, its block ids and the two device buffers, sized for its largest batch."""
        block_ids = np.asarray([b for span in spans for b in span.block_ids], dtype=np.int64)
        plans = plan_batches([(s.first_slot, len(s.block_ids)) for s in spans], self.layout.num_layers,
                             self.blocks_per_chunk, self.layout.block_bytes, self.max_batch_bytes)
        biggest = max((p.buffer_bytes for p in plans), default=0)
        buffers = [self._grow(self._buffers, (purpose, i), biggest, dtype=torch.uint8, device=self.device)
                   for i in range(min(2, len(plans)))]
        return plans, block_ids, buffers

    def _bounce(self, purpose: str, spans: Sequence[Span], plans: Sequence[BatchPlan]) -> torch.Tensor | None:
        """The pinned staging buffer, if a run of this call needs one (sized before any work)."""
        if not self.cuda:
            return None
        need = max((p.buffer_bytes for p in plans if any(not is_pinned(spans[r.span].page) for r in p.runs)),
                   default=0)
        return self._grow(self._staging, (purpose, 0), need, dtype=torch.uint8, pin_memory=True) if need else None

    # ---- engine -> pages ---------------------------------------------------------------------
    def save(self, spans: Sequence[Span], after: torch.cuda.Event | None = None) -> None:
        """Copy the spans' blocks into their pages; ``after``: an event the engine recorded after the
        forward that wrote them (a deferred save, called from the saver thread); None: the calling
        thread's current stream is the one that wrote them."""
        dim = self.layout.block_dim
        with self.locks["save"]:
            plans, block_ids, buffers = self._prepare("save", spans)
            if not plans:
                return
            bounce = self._bounce("save", spans, plans)
            kernels, copies = self._streams_of("save")
            if kernels is not None and after is not None:
                kernels.wait_event(after)  # the forward wrote these blocks (recorded on the engine's thread)
            elif kernels is not None:
                kernels.wait_stream(torch.cuda.current_stream(self.device))  # the forward wrote these blocks
            with _on(kernels):
                indices = self._indices("save", plans, block_ids)
            released: list[torch.cuda.Event | None] = [None, None]  # the copy stream is done with buffer i
            for k, (plan, (idx, rows)) in enumerate(zip(plans, indices)):
                buffer = buffers[k % 2][:plan.buffer_bytes]
                with _on(kernels):
                    _after(kernels, released[k % 2])
                    typed = self._typed(buffer)
                    for layer, kv in enumerate(self.layers):
                        blocks = kv.index_select(dim, idx)
                        typed.index_copy_(0, rows[layer], blocks.movedim(dim, 0) if dim else blocks)
                    gathered = _record(kernels)
                staged = []
                with _on(copies):
                    _after(copies, gathered)
                    for run in plan.runs:
                        page_array = spans[run.span].page
                        page = host_tensor(page_array[run.page_offset:run.page_offset + run.nbytes])
                        src = buffer[run.buffer_offset:run.buffer_offset + run.nbytes]
                        if direct_host_copy(self.cuda, is_pinned(page_array)):
                            page.copy_(src, non_blocking=self.cuda)
                        else:
                            assert bounce is not None
                            through = bounce[run.buffer_offset:run.buffer_offset + run.nbytes]
                            through.copy_(src, non_blocking=True)
                            staged.append((page, through))
                    released[k % 2] = _record(copies)
                if staged:  # the bounce buffer is free again before the next batch uses it
                    _wait(copies)
                    for page, through in staged:
                        page.copy_(through)
                    self._note_staged(len(staged))
            _wait(copies)  # the pages hold the bytes before the store publishes them (after every gather)

    # ---- pages -> engine ---------------------------------------------------------------------
    def load(self, spans: Sequence[Span], wait: bool = True) -> torch.cuda.Event | None:
        """Copy the spans' page slots into their blocks; ``wait``: return once they are there (None),
        else return the event the copies end with (CUDA; a layer-wise load's consumer waits for it)."""
        dim = self.layout.block_dim
        with self.locks["load"]:
            plans, block_ids, buffers = self._prepare("load", spans)
            if not plans:
                return None
            bounce = self._bounce("load", spans, plans)
            kernels, copies = self._streams_of("load")
            if kernels is not None and self.compute is not None:
                kernels.wait_stream(self.compute)  # vLLM zeroes newly allocated blocks on the compute stream
            with _on(kernels):
                indices = self._indices("load", plans, block_ids)
            released: list[torch.cuda.Event | None] = [None, None]  # the kernel stream is done with buffer i
            bounce_in_flight = False
            for k, (plan, (idx, rows)) in enumerate(zip(plans, indices)):
                buffer = buffers[k % 2][:plan.buffer_bytes]
                staged = 0
                with _on(copies):
                    _after(copies, released[k % 2])
                    for run in plan.runs:
                        page_array = spans[run.span].page
                        page = host_tensor(page_array[run.page_offset:run.page_offset + run.nbytes])
                        dst = buffer[run.buffer_offset:run.buffer_offset + run.nbytes]
                        if direct_host_copy(self.cuda, is_pinned(page_array)):
                            dst.copy_(page, non_blocking=self.cuda)
                            continue
                        assert bounce is not None
                        if bounce_in_flight:  # an earlier batch's bounce may still be crossing the link
                            _wait(copies)
                            bounce_in_flight = False
                        through = bounce[run.buffer_offset:run.buffer_offset + run.nbytes]
                        through.copy_(page)
                        dst.copy_(through, non_blocking=True)
                        staged += 1
                    copied = _record(copies)
                bounce_in_flight = bounce_in_flight or staged > 0
                self._note_staged(staged)
                with _on(kernels):
                    _after(kernels, copied)
                    typed = self._typed(buffer)
                    for layer, kv in enumerate(self.layers):
                        src = typed.index_select(0, rows[layer])
                        kv.index_copy_(dim, idx, src.movedim(0, dim) if dim else src)
                    released[k % 2] = _record(kernels)
            if not wait:  # the caller orders its readers after the event (layer-wise loads)
                return _record(kernels)
            _wait(kernels)  # the blocks hold the bytes before the load is reported finished
            return None
