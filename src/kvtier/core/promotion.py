"""Promotion: reading a load's chunks from lower tiers up into cpu pages (hot chunks move up).

:meth:`TieredStore.prepare_load <kvtier.core.store.TieredStore.prepare_load>` finds the prefix;
every chunk of it held below the cpu tier becomes one :class:`Promotion`: a reserved cpu page
(or, when the cpu tier has no free page, a private buffer) that the chunk's tier reads and
verifies into.  The :class:`Promoter` then reads them, one batch per tier, in tier order::

    chain     c0   c1   c2   c3   c4   c5
    found in  cpu  disk disk disk redis redis
    promotions     1    2    3    4     5      (pos = position in the chain = in the handle)

A chunk that is missing or fails verification **cuts** the prefix there: every later chunk of
the handle is dropped (its page given back, its pin released), because a chunk is only useful
if every chunk before it was delivered.  With read-ahead, the first ``io_threads`` promotions
are read before ``prepare_load`` returns and the rest on a background thread, ``io_threads``
at a time (a shared tier's chunks in one pipelined batch), advancing ``LoadHandle.ahead_from``
so that the caller copies the ready head while the tail is read.

A chunk read from a lower tier keeps its writer's tenant record: the tier puts the record of
each value or chunk file it verified into the dict the read passes (``records``,
:data:`kvtier.core.tenant.TenantRecords`), and the published page carries it (``TopTier.tenant``),
so a later write of the chunk to the disk tier writes the same record and ``kvtier purge
--salt``/``--lora`` finds it there (issue 22).  A chunk that failed
verification is never published, so its record is never used.

Locking: the store's lock guards pins, pages and the handle's lists; reads run outside it, on
pinned chunks (local tiers) or keys nobody else can publish yet (reserved pages).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from kvtier.core import tenant
from kvtier.core.context import ChunkMissed, ChunksRead, LoadCut, MissReason
from kvtier.core.handles import LoadHandle
from kvtier.core.keys import ChunkKey
from kvtier.core.lower import LowerTier
from kvtier.core.tiers.base import GetResult, NoRoom, Reservation, StagingTier
from kvtier.core.top import TopTier


class Promotion(NamedTuple):
    """One chunk of a load to read from a lower tier.

    Attributes:
        pos: its position in the chain, which is also its position in the load's handle (a prefix).
        key: the chunk's key.
        buffer: uint8 ``[chunk_bytes]`` the tier reads into: a reserved cpu page, or a private buffer.
        reserved: ``buffer`` is a reserved cpu page (published if the read succeeds, given back if not).
        tier: the lower tier holding the chunk (pinned there if local).
        epoch: the store's reset epoch when it was planned (a reset since: the chunk is dropped).
    """

    pos: int
    key: ChunkKey
    buffer: np.ndarray
    reserved: bool
    tier: LowerTier
    epoch: int = 0


class Promoter:
    """Reads :class:`Promotion` batches for the store (see the module docstring).

    Args:
        lock: the store's lock.
        cpu / top: the cpu tier (pages) and its bookkeeping (pins, publishing).
        chunk_bytes: bytes of one chunk.
        io_threads: chunks read before ``prepare_load`` returns with read-ahead, and per background batch.
        unpin_handle: the store's ``(handle, refresh)`` release, called when a handle released
            while its reads ran is finally free.
    """

    def __init__(self, lock: threading.RLock, cpu: StagingTier, top: TopTier, chunk_bytes: int, io_threads: int,
                 unpin_handle: Callable[[LoadHandle, bool], None]) -> None:
        self._lock = lock
        self.cpu = cpu
        self.top = top
        self.chunk_bytes = chunk_bytes
        self.io_threads = io_threads
        self._unpin_handle = unpin_handle
        self._ahead = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-read-ahead")

    def buffer_locked(self, key: ChunkKey, promotions: list[Promotion], pos: int, lt: LowerTier) -> np.ndarray:
        """Append the promotion of ``key`` (at chain position ``pos``, held by ``lt``) and return
        its buffer: a reserved cpu page if one is free, else a private buffer."""
        got = self.cpu.reserve(key) if self.top.free_page(lt.owner_locked(key)) else NoRoom.NO_ROOM
        reserved = isinstance(got, Reservation)
        buf = got.buffer if isinstance(got, Reservation) else np.empty(self.chunk_bytes, dtype=np.uint8)
        promotions.append(Promotion(pos, key, buf, reserved, lt, self.top.epoch))
        return buf

    def run(self, chain: Sequence[ChunkKey], handle: LoadHandle, promotions: list[Promotion],
            read_ahead: bool) -> None:
        """Read ``promotions`` now, or with ``read_ahead`` only the first ``io_threads`` of them and
        the rest in the background."""
        ahead = promotions[self.io_threads:] if read_ahead else []
        self.promote(chain, handle, promotions[:len(promotions) - len(ahead)])
        if ahead:
            self._read_ahead(chain, handle, ahead)

    def promote(self, chain: Sequence[ChunkKey], handle: LoadHandle, batch: list[Promotion]) -> None:
        """Read ``batch`` (one read per tier, in tier order), publish what arrived, cut the prefix
        at the first chunk that did not.  Reports to the load's context (``handle.ctx``): a
        :class:`~kvtier.core.context.ChunksRead` per tier read, a ``ChunkMissed`` per chunk that
        did not arrive and a ``LoadCut`` where the prefix now ends (the tiers' per-chunk results,
        translated here: a tier reports hit, miss or corrupt, :class:`GetResult`)."""
        sink = handle.ctx.sink
        results: list[GetResult] = []
        records: tenant.TenantRecords = {}  # verified values and chunk files name their writer
        for lt in dict.fromkeys(p.tier for p in batch):
            jobs = [p for p in batch if p.tier is lt]
            t0 = time.perf_counter()
            got = lt.read([p.key for p in jobs], [p.buffer for p in jobs], records)
            seconds = time.perf_counter() - t0
            results.extend(got)
            hits = sum(1 for r in got if r is GetResult.HIT)
            sink.emit(ChunksRead(lt.name, hits, hits * self.chunk_bytes, seconds))
        with self._lock:
            # a reset since the load was planned: what was read is pre-reset, never published or served
            missed = [ChunkMissed(p.pos, p.tier.name, _reason(res, p.epoch != self.top.epoch))
                      for p, res in zip(batch, results) if res is not GetResult.HIT or p.epoch != self.top.epoch]
            cut = min(m.index for m in missed) if missed else None
            planned = handle.num_chunks
            for p, res in zip(batch, results):
                if not p.tier.shared:
                    p.tier.unpin_locked(p.key)
                if res is GetResult.CORRUPT or (res is GetResult.MISS and not p.tier.shared
                                                and not p.tier.tier.indexed(p.key)):
                    # corrupt (counted by the tier, Tier.corrupt) or removed by another process:
                    p.tier.forget_locked(p.key)  # the policy and the change feed let go of it too
                if cut is not None and p.pos >= cut:
                    if p.reserved:
                        self.cpu.abort(p.key)
                    continue
                if p.reserved:
                    self.top.publish(p.key, chain[p.pos - 1] if p.pos > 0 else None, records.get(p.key),
                                     owner=p.tier.owner_locked(p.key))
                    self.top.pin(p.key)
                    handle.pinned.append(p.key)
            if cut is not None:  # everything from the first unusable chunk on is dropped
                for key in handle.keys[cut:]:
                    if key in handle.pinned:
                        handle.pinned.remove(key)
                        self.top.unpin(key)
                del handle.keys[cut:], handle.buffers[cut:], handle.tiers[cut:]
        for m in missed:
            sink.emit(m)
        if cut is not None and cut < planned:  # not cut before (by an earlier batch of this load)
            first = min(missed, key=lambda m: m.index)
            sink.emit(LoadCut(cut, first.tier, first.reason, planned - cut))

    def _read_ahead(self, chain: Sequence[ChunkKey], handle: LoadHandle, ahead: list[Promotion]) -> None:
        """Promote ``ahead`` in the background; if the prefix already ended before it, give back its pins and pages."""
        if handle.num_chunks > ahead[0].pos:
            handle.ahead_from = ahead[0].pos
            handle.reading_ahead = True
            try:
                handle.pending = self._ahead.submit(self._promote_ahead, chain, handle, ahead)
            except RuntimeError:  # closed: read here
                self._promote_ahead(chain, handle, ahead)
            return
        self.give_back(ahead)

    def give_back(self, promotions: list[Promotion]) -> None:
        """Promotions that will not be read: unpin their lower-tier chunks, release their reserved pages."""
        with self._lock:
            for p in promotions:
                if not p.tier.shared:
                    p.tier.unpin_locked(p.key)
                if p.reserved:
                    self.cpu.abort(p.key)

    def _promote_ahead(self, chain: Sequence[ChunkKey], handle: LoadHandle, ahead: list[Promotion]) -> None:
        """Read ``ahead`` in batches of ``io_threads`` chunks, advancing ``handle.ahead_from`` (what
        :meth:`LoadHandle.ready_chunks` reports) after each, so a caller copies while the rest is read.
        Chunks of a shared tier stay in one batch (one pipelined round trip)."""
        try:
            i = 0
            while i < len(ahead):
                if ahead[i].tier.shared:
                    end = next((j for j in range(i, len(ahead)) if not ahead[j].tier.shared), len(ahead))
                else:
                    end = min(i + self.io_threads, len(ahead))
                batch, i = ahead[i:end], end
                if handle.num_chunks > batch[0].pos:
                    self.promote(chain, handle, batch)
                else:  # the prefix ended in an earlier batch (a chunk failed): give this one's pins and pages back
                    self.give_back(batch)
                with self._lock:
                    handle.ahead_from = min(batch[-1].pos + 1, handle.num_chunks)
        finally:
            with self._lock:
                handle.reading_ahead = False
                refresh = handle.release_after_read
            if refresh is not None:  # released while the reads ran: unpin now
                self._unpin_handle(handle, refresh)

    def close(self) -> None:
        """Wait for background reads to end and stop their threads."""
        self._ahead.shutdown(wait=True)


def _reason(result: GetResult, stale: bool) -> MissReason:
    """Why a chunk read with ``result`` is not served (``stale``: a reset came since its plan)."""
    if stale:
        return "reset"
    return "corrupt" if result is GetResult.CORRUPT else "missing"
