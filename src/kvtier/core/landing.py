"""Landing buffers: where a lower-tier read lands when the cpu tier has no page to give it.

A load's chunk found on disk or in a shared tier is read into a reserved cpu page when the index
can free one (a promotion: the next hit is a DRAM hit), and that page is the buffer the engine's
blocks are filled from.  Under pressure (every page pinned by loads, saves, queued writes or TTL
pins; the eviction gate closed) the index plans the read into a private buffer instead, and the
chunk is not promoted (:meth:`kvtier.core.index.Index.plan_load`).  That buffer used to be a fresh
``np.empty`` per chunk: pageable memory, mapped and faulted in by the read and unmapped after, and
on CUDA copied once more into a pinned bounce buffer before the DMA
(:mod:`kvtier.integrations.vllm.worker.batched`).

:class:`LandingPool` replaces it with a bounded pool of ``chunk_bytes`` buffers carved from one
anonymous ``mmap`` (page aligned, so ``O_DIRECT`` reads go straight in), allocated once and
reused, which the worker registers as pinned host memory when the KV cache is on a GPU (through
the cpu tier's :class:`~kvtier.core.tiers.base.RegistersMemory`): the engine's blocks are then
filled by DMA straight from the buffer the read landed in (issue 37 item 2, "device endpoint").

Bounds: :meth:`LandingPool.take` never waits; with every buffer out it returns ``None`` and the
read keeps the index's private buffer (correct, only slower).  A buffer goes back once the load
that took it is released *and* its reads have ended (:meth:`LandingPool.give_after`), so a read
ahead still running never writes into a buffer another load holds.

Thread safety: the free list is guarded by a lock.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

import numpy as np

DEFAULT_LANDING_BYTES = 64 << 20
"""Bytes of landing buffers per store (whole page-aligned buffers, at least :data:`MIN_LANDING_CHUNKS`,
at most :data:`MAX_LANDING_CHUNKS`): a few loads' worth of chunks read under pressure (a load takes
one per chunk it reads without a page, all at once); pinned with the cpu tier on a GPU host."""

MIN_LANDING_CHUNKS = 2
MAX_LANDING_CHUNKS = 1024


class Registrar(Protocol):
    """Whatever pins host memory for the GPU (the cpu tier: :class:`~kvtier.core.tiers.base.RegistersMemory`)."""

    def register_memory(self, region: np.ndarray) -> str | None: ...


class LandingPool:
    """A bounded pool of page-aligned ``chunk_bytes`` buffers (see the module docstring).

    Args:
        chunk_bytes: bytes of one buffer (the store's chunk).
        num_buffers: buffers in the pool (0: none; every read keeps its private buffer).

    Raises:
        ValueError: ``chunk_bytes`` not positive or ``num_buffers`` negative.
    """

    def __init__(self, chunk_bytes: int, num_buffers: int) -> None:
        if chunk_bytes <= 0 or num_buffers < 0:
            raise ValueError(f"a landing pool needs chunk_bytes > 0 and num_buffers >= 0, got {chunk_bytes}, "
                             f"{num_buffers}")
        self.chunk_bytes = chunk_bytes
        self.stride = -(-chunk_bytes // 4096) * 4096  # each buffer page aligned (O_DIRECT)
        nbytes = self.stride * num_buffers
        self.region = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8) if nbytes else np.empty(0, np.uint8)
        # mapped lazily: a buffer's pages are faulted in by its first read (or by pinning) and then reused
        self._free = [self.region[i * self.stride:i * self.stride + chunk_bytes] for i in range(num_buffers)]
        self.num_buffers = num_buffers
        self.pinned = False
        self._lock = threading.Lock()

    @classmethod
    def sized(cls, chunk_bytes: int, budget_bytes: int = DEFAULT_LANDING_BYTES) -> LandingPool:
        """A pool of about ``budget_bytes`` (see :data:`DEFAULT_LANDING_BYTES`)."""
        stride = -(-max(chunk_bytes, 1) // 4096) * 4096
        return cls(chunk_bytes, min(MAX_LANDING_CHUNKS, max(MIN_LANDING_CHUNKS, budget_bytes // stride)))

    def owns(self, buffer: np.ndarray) -> bool:
        """Whether ``buffer`` is one of this pool's buffers."""
        start = int(buffer.ctypes.data) - int(self.region.ctypes.data)
        return 0 <= start < self.region.nbytes and start % self.stride == 0 and buffer.nbytes == self.chunk_bytes

    def free(self) -> int:
        """Buffers in the pool now."""
        with self._lock:
            return len(self._free)

    def take(self) -> np.ndarray | None:
        """A free buffer, or ``None`` when every one is out (never waits)."""
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, buffers: Sequence[np.ndarray]) -> None:
        """Put ``buffers`` (taken from this pool) back.

        Raises:
            ValueError: a buffer is not this pool's (nothing is put back).
        """
        if any(not self.owns(b) for b in buffers):
            raise ValueError("a buffer given back to the landing pool is not one of its buffers")
        with self._lock:
            self._free.extend(buffers)

    def give_after(self, buffers: Sequence[np.ndarray], reads: Future[None] | None) -> None:
        """Put ``buffers`` back once ``reads`` (a load's read-ahead, ``None``: none) has ended;
        at once when it has."""
        if not buffers:
            return
        if reads is None:
            self.give(buffers)
        else:
            reads.add_done_callback(lambda _: self.give(buffers))

    def pin(self, registrar: Registrar) -> str | None:
        """Register the pool as pinned host memory (idempotent); ``None`` once pinned, else why not."""
        if self.pinned or self.region.nbytes == 0:
            return None
        why = registrar.register_memory(self.region)
        self.pinned = why is None
        return why
