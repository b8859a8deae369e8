"""The store's typed plans and handles: what the index (:mod:`kvtier.core.index`) decides and
the mover (:mod:`kvtier.core.mover`) carries out.

- :class:`LoadHandle` / :class:`StoreHandle`: what a caller of the store holds between
  ``prepare_*`` and ``complete_*`` (the chunks, their buffers, where each came from).
- :class:`Read`: one chunk of a load to read from a lower tier into a buffer (a promotion).
- :class:`WriteJob`: one chunk to write from the top tier (a page or a staged copy) into a lower tier.
- :class:`LoadPlan` / :class:`StorePlan`: a load's or save's handle and what the mover must do for it.
- :class:`StagedCopy`: a private copy of an evicted chunk, servable until its writes are done.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvtier.core.context import NO_CONTEXT, EngineLoad, EngineSave, LoadCut, MissReason, OpContext
from kvtier.core.keys import ChunkKey
from kvtier.core.tenant import TenantId, Writer

# the engine events live in kvtier.core.context (re-exported here)
__all__ = ["NO_BUFFER", "EngineLoad", "EngineSave", "Into", "LoadHandle", "LoadPlan", "Read", "StagedCopy",
           "StoreHandle", "WriteJob"]

Into = Callable[[int], object | None]
"""``prepare_load``'s ``into``: a chunk's position in the chain → where the shared tier reads it instead
of a cpu page (a destination that tier's ``get_many`` takes: the node tier's
:class:`~kvtier.core.tiers.node.readcopy.Scatter` over an engine's blocks), or ``None`` (a page).  Such a
chunk is not promoted: its ``LoadHandle.buffers`` entry is :data:`NO_BUFFER`, and its bytes are in
place once it is ready (a chunk that fails verification ends the prefix there, whatever its destination
then holds)."""
NO_BUFFER = np.empty(0, dtype=np.uint8)
"""The buffer of a chunk read into ``into``'s destination: none."""


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
    """Leading chunks in place while reads run ahead: set as they start (``Index.start_read_ahead``), then
    advanced by the one thread reading them (:mod:`kvtier.core.mover`); read without a lock."""
    reading_ahead: bool = field(default=False, repr=False)  # guarded by the store's lock
    release_after_read: bool | None = field(default=None, repr=False)  # released while reading: refresh?
    ctx: OpContext = field(default=NO_CONTEXT, repr=False)
    below: tuple[int, str, MissReason] | None = field(default=None, repr=False)
    """The first chunk planned from below the top tier: ``(pos, its tier, why the top tier lacked it)``."""
    landed: list[np.ndarray] = field(default_factory=list, repr=False)
    """Landing buffers (:mod:`kvtier.core.landing`) some of ``buffers`` are: reads that got no cpu page."""
    cut: LoadCut | None = field(default=None, repr=False)
    """Where the planned prefix ended and why (what ``prepare_load`` told the load's context), kept for a
    context bound later (a synchronous load's, on the finisher's thread: kvtier.integrations.vllm.worker.syncload);
    ``None``: every chunk asked for was found."""

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


class Read(NamedTuple):
    """One chunk of a load to read from a lower tier (a promotion into the top tier).

    Attributes:
        pos: its position in the chain, which is also its position in the load's handle (a prefix).
        key: the chunk's key.
        buffer: uint8 ``[chunk_bytes]`` the tier reads into: a reserved cpu page, or a private buffer.
        reserved: ``buffer`` is a reserved cpu page (published if the read succeeds, given back if not).
        tier: the name of the lower tier holding the chunk (pinned there if local).
        shared: that tier is shared (not pinned; read in one pipelined batch).
        epoch: the store's reset epoch when it was planned (a reset since: the chunk is dropped).
        into: where the shared tier reads it instead (:data:`Into`; ``buffer`` is then :data:`NO_BUFFER`).
    """

    pos: int
    key: ChunkKey
    buffer: np.ndarray
    reserved: bool
    tier: str
    shared: bool
    epoch: int = 0
    into: object = None


@dataclass
class LoadPlan:
    """A load as the index planned it: the caller's handle (every chunk, its buffer and source
    tier), the :class:`Read` s the mover must run before those buffers hold the chunks, and the
    writes the pages it took caused (victims spilled to a write-back tier); ``into``: the load's
    :data:`Into` (shared reads only)."""

    handle: LoadHandle
    reads: list[Read] = field(default_factory=list)
    writes: list[WriteJob] = field(default_factory=list)
    into: Into | None = None


@dataclass
class StorePlan:
    """A save as the index planned (or published) it: the caller's handle and the writes it
    caused (a page's victim spilled to a write-back tier; on publication, write-through copies
    and spills ahead), which the mover queues."""

    handle: StoreHandle
    writes: list[WriteJob] = field(default_factory=list)


@dataclass(slots=True)
class WriteJob:
    """One write of ``key`` into the lower tier ``tier`` (queued by the mover, planned by the index).

    Attributes:
        tier: the lower tier to write into.
        key / parent: the chunk and the previous chunk of its chain (``None`` for chunk 0).
        data: a private staged copy of the bytes, or ``None`` to read the pinned top-tier page.
        evict_after: drop the chunk from the top tier once written (spill ahead).
        epoch: the store's reset epoch when planned; a write planned before a reset of ``tier``
            is dropped, or its chunk deleted if it landed after the reset.
        tenant: who the chunk was saved for (:mod:`kvtier.core.tenant`), ``None`` when unknown.
    """

    tier: str
    key: ChunkKey
    parent: ChunkKey | None
    data: np.ndarray | None
    evict_after: bool
    epoch: int = 0
    tenant: Writer | None = None

    @property
    def from_top(self) -> bool:
        """Whether the bytes come from a pinned top-tier page."""
        return self.data is None


@dataclass(slots=True)
class StagedCopy:
    """A copy of an evicted chunk and the number of writes of it still queued."""

    data: np.ndarray
    pending: int = 0
