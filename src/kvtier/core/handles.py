"""Result types of the store's two-phase operations."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from kvtier.core.context import NO_CONTEXT, EngineLoad, EngineSave, OpContext
from kvtier.core.keys import ChunkKey
from kvtier.core.tenant import TenantId

__all__ = ["EngineLoad", "EngineSave", "LoadHandle", "PendingLookup", "StoreHandle"]  # the engine events live in context


@dataclass
class LoadHandle:
    """Chunks pinned for one load, from :meth:`TieredStore.prepare_load`.

    Attributes:
        keys: the loaded prefix of the chain, ``num_chunks`` keys.
        buffers: uint8 arrays ``[chunk_bytes]`` holding each chunk's verified bytes; zero-copy
            views into the cpu tier where possible.  Valid until :meth:`TieredStore.complete_load`.
        tiers: the name of the tier each chunk was found in (``"cpu"``, ``"disk"``, ``"redis"``).
        ctx: the load's context (:mod:`kvtier.core.context`), its sink bound to the store's counters:
            events of the reads, on any thread, and of ``complete_load`` go there.
    """

    keys: list[ChunkKey]
    buffers: list[np.ndarray]
    tiers: list[str]
    pinned: list[ChunkKey] = field(default_factory=list, repr=False)
    done: bool = False
    pending: Future[None] | None = field(default=None, repr=False)
    """Reads still running for chunks ``ahead_from`` on (``prepare_load(read_ahead=True)``)."""
    ahead_from: int = 0
    reading_ahead: bool = field(default=False, repr=False)  # guarded by the store's lock
    release_after_read: bool | None = field(default=None, repr=False)  # released while reading: refresh?
    ctx: OpContext = field(default=NO_CONTEXT, repr=False)

    @property
    def num_chunks(self) -> int:
        """Chunks in the loaded prefix (final once :meth:`wait` returned True)."""
        return len(self.keys)

    def ready_chunks(self) -> int:
        """Leading chunks whose verified bytes are in ``buffers`` now (all once reads are done)."""
        if self.pending is None or self.pending.done():
            return self.num_chunks
        return self.ahead_from

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for chunks still being read ahead; True once every chunk is in
        place and ``num_chunks`` is final (a chunk that failed verification ends the prefix)."""
        if self.pending is None:
            return True
        try:
            self.pending.result(timeout=timeout_s)
        except TimeoutError:
            return False
        return True


@dataclass
class StoreHandle:
    """Pages reserved for one save, from :meth:`TieredStore.prepare_store`.

    Attributes:
        keys: chunks to be written, in chain order.
        indices: position of each key in the chain passed to ``prepare_store``.
        parents: the previous key in the chain for each key (``None`` for chunk 0).
        buffers: writable uint8 arrays ``[chunk_bytes]``; fill them, then call ``complete_store``.
        epoch: the store's reset epoch when the pages were reserved (a reset since: nothing is published).
        tenant: who the chunks are saved for (:mod:`kvtier.core.tenant`), written with them into
            the tiers that keep a tenant record; ``None``: unknown (the context's tenant).
        ctx: the save's context (:mod:`kvtier.core.context`), its sink bound to the store's counters.
    """

    keys: list[ChunkKey]
    indices: list[int]
    parents: list[ChunkKey | None]
    buffers: list[np.ndarray]
    done: bool = False
    epoch: int = 0
    tenant: TenantId | None = None
    ctx: OpContext = field(default=NO_CONTEXT, repr=False)

    @property
    def num_chunks(self) -> int:
        """Chunks reserved."""
        return len(self.keys)


class PendingLookup:
    """A lookup whose shared-tier part runs in the background, from :meth:`TieredStore.lookup_async`.

    ``poll()`` never blocks: ``None`` means "ask again later" (vLLM's
    ``get_num_new_matched_tokens`` may return ``(None, False)`` for that, see
    vllm/v1/core/sched/scheduler.py); otherwise the number of leading chunks available, local
    and shared together.  Once ``deadline`` (``time.monotonic()`` seconds) has passed without an
    answer, ``poll()`` returns the local count (the shared tier is then treated as a miss).

    Attributes:
        local_chunks: leading chunks found in local tiers when the lookup was submitted.
        chain_chunks: chunks in the chain asked about.
    """

    def __init__(self, local_chunks: int, chain_chunks: int, future: Future[int] | None = None,
                 deadline: float = 0.0) -> None:
        self.local_chunks = local_chunks
        self.chain_chunks = chain_chunks
        self.deadline = deadline
        self.timed_out = False
        self._future = future

    def poll(self) -> int | None:
        """Leading chunks available, or ``None`` while the shared tier has not answered."""
        future = self._future
        if future is None:
            return self.local_chunks
        if future.done():
            try:
                return self.local_chunks + future.result()
            except Exception:  # noqa: BLE001 - a fault in the shared tier is a miss
                return self.local_chunks
        if time.monotonic() >= self.deadline:
            self.timed_out = True
            return self.local_chunks
        return None

    def wait(self, timeout_s: float | None = None) -> int:
        """Block until the answer (at most until the deadline, or ``timeout_s``); for tests and tools."""
        end = self.deadline if timeout_s is None else min(self.deadline, time.monotonic() + timeout_s)
        while True:
            got = self.poll()
            if got is not None:
                return got
            if time.monotonic() >= end:
                return self.local_chunks
            time.sleep(0.001)
