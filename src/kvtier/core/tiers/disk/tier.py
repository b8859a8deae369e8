"""Disk tier: one verified chunk file per chunk under ``root/<namespace hex>/<key hex[:2]>/<key hex>.kvc``;
this module is its part on a request's path, in the order a hit meets it: the index's membership test
(``contains_many``), the mover's reads (``get_many``/``get_into``), each read's I/O (:func:`read_chunk`) and
the way a buffered read takes (:class:`ReadChooser`), the per-step ``usage``.  Its other parts:
:class:`~kvtier.core.tiers.disk.files.DiskFiles` (set-up, index, crash-safe writes, deletes, accounting),
:class:`~kvtier.core.tiers.disk.directory.DirectorySync` (the rescan of a shared directory, ``clear``),
:class:`~kvtier.core.tiers.disk.reads.DiskReads` (reads of any length, ranged reads),
:class:`~kvtier.core.tiers.disk.chunkio.ChunkIO` (the I/O settings, aligned buffers and writes).

- **Verified reads**: every file is a value envelope (:mod:`kvtier.core.envelope`, header padded to 4096
  bytes: :mod:`kvtier.core.tiers.disk.chunkfile`) whose XXH3-128 covers its header and payload; files of the
  release before (chunk file version 2) are still read.  A read checks the header, the file's size against
  it, and the digest, computed while the bytes move.  A torn, truncated, foreign-namespace, older-format or
  corrupt file is a miss: counted in ``corrupt``, logged, and removed (``CORRUPT`` from ``get_into``).
- **Buffered or O_DIRECT** (``io``), ``io_threads`` chunks at once in ``get_many``, in slices of
  ``slice_bytes``, the header block with the first slice in one call.  In direct mode (``pipeline``)
  helper threads keep ``read_depth`` slices in flight while the calling thread hashes the completed ones
  in order (``os.preadv`` and xxhash's ``update`` release the GIL).  Buffered reads are serial or split,
  as :class:`ReadChooser` measures faster now.
- **Shared directory**: ``contains`` answers from this process's index only (no filesystem access); a
  file another process deleted is a miss when read; files other processes wrote come in by the rescan.

Thread-safety: ``get_into`` and ``put`` do their I/O without a lock and may run concurrently on different
keys; the index is guarded by a lock.  A short read (the file is shorter than its header says) raises
:class:`~kvtier.core.tiers.disk.chunkfile.ChunkFormatError`, other failures ``OSError``: both ``CORRUPT``.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from kvtier.core import codecs, envelope
from kvtier.core.errors import length_problem
from kvtier.core.keys import ChunkKey
from kvtier.core.tenant import TenantRecords
from kvtier.core.tiers.base import GetResult, TierUsage
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES, ChunkFormatError, PayloadHasher
from kvtier.core.tiers.disk.chunkio import (
    ALIGN,
    CheckHeader,
    ChunkIO,
    aligned_buffer,
    read_direct,
    read_rest,
    usable_cpus,
)
from kvtier.core.tiers.disk.directory import DirectorySync
from kvtier.core.tiers.disk.files import DiskFiles
from kvtier.core.tiers.disk.reads import DiskReads
from kvtier.core.tiers.disk.recoded import Recoded
from kvtier.core.tiers.disk.scan import SUFFIX
from kvtier.core.tiers.valueread import check_room

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
SPLIT_HEAD_SHARE = 0.45
"""Share of a split read's payload read (and hashed) by the calling thread: with the hash at about a
third of the read's cost, reading 0.45 and hashing it takes about as long as reading the other 0.55."""


class DiskTier(DirectorySync, DiskReads, DiskFiles):
    """Chunk files in a directory, within ``capacity_bytes`` (headers included); the arguments are
    :class:`~kvtier.core.tiers.disk.files.DiskFiles`'."""

    name = "disk"

    def _file(self, key: ChunkKey) -> str:
        """File path of ``key`` as a string (a ``Path`` costs 8 µs to build, a string 0.4 µs)."""
        h = key.hex()
        return f"{self._root}{os.sep}{h[:2]}{os.sep}{h}{SUFFIX}"

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """:meth:`contains` of each of ``keys``, in one call (the index asks once per load)."""
        sizes, writing, bad = self._key_to_size, self._writing, self._bad
        return [k in sizes and k not in writing and k not in bad for k in keys]

    def usage(self) -> TierUsage:
        with self._lock:
            used = min(self._used, self.capacity_bytes)
            return TierUsage(used, self.capacity_bytes - used, self.capacity_bytes, len(self._key_to_size))

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview],
                 records: TenantRecords | None = None) -> list[GetResult]:
        """Batch :meth:`get_into`, ``io_threads`` chunks at a time (each notes its own key in ``records``)."""
        pool = self._pool()
        if pool is None or len(keys) < 2:
            return super().get_many(keys, dsts, records)
        return list(pool.map(self.get_into, keys, dsts, [records] * len(keys)))

    def _pool(self) -> ThreadPoolExecutor | None:
        if self.io_threads < 2 or self._closed:
            return None
        with self._lock:
            if self._workers is None:
                self._workers = ThreadPoolExecutor(self.io_threads, thread_name_prefix="kvtier-disk-io")
            return self._workers

    def get_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> GetResult:
        got = self._read(key, dst, records, True)
        return got if isinstance(got, GetResult) else GetResult.HIT

    def _read(self, key: ChunkKey, dst: memoryview | None, records: TenantRecords | None,
              exact: bool) -> GetResult | memoryview:
        """:meth:`_read_verified` with the fall-back to buffered I/O; ``MISS``/``CORRUPT`` or the payload."""
        path = self._file(key)
        if key in self._bad or key in self._sealed_away:  # counted once already, when it was found unusable
            return GetResult.MISS
        try:
            try:
                return self._read_verified(key, path, dst, records, exact)
            except OSError as exc:
                if not self._fall_back(exc):
                    raise
                return self._read_verified(key, path, dst, records, exact)
        except envelope.ForeignValue:  # another engine's master key: a miss, the file kept for it
            return self._sealed_by_another(key)
        except FileNotFoundError:  # removed by another process
            return self._vanished(key)
        except (ChunkFormatError, OSError) as exc:
            self._quarantine(key, Path(path), str(exc))
            return GetResult.CORRUPT

    def _read_verified(self, key: ChunkKey, path: str, dst: memoryview | None, records: TenantRecords | None,
                       exact: bool) -> memoryview:
        """Read ``key``'s payload into ``dst`` (``exact``: exactly its length; else at least it, or
        a new buffer for ``None``) and return it; raises ChunkFormatError unless every check passes.
        The file is an envelope (:mod:`kvtier.core.envelope`) or a legacy version-2 chunk file
        (:mod:`kvtier.core.legacyformats`).  Then its tenant record goes into ``records`` (only one
        that passes its own check: :meth:`~kvtier.core.envelope.Envelope.open_header` checked it).

        Raises:
            BufferTooSmall: not ``exact`` and ``dst`` is shorter than the file's payload.
        """
        io, blocks = self._io, self._io.read_headers
        tenant: envelope.RecordedTenant | None = None
        # O_NONBLOCK: a FIFO or device planted at a chunk's path must not hang the caller
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | io.open_flags)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ChunkFormatError("not a regular file")
            if not self.envelope.chain.passthrough or (exact and dst is not None and
                                                       st.st_size - HEADER_BYTES != dst.nbytes):
                return self._read_recoded(key, path, st.st_size, dst, records, exact)
            given = dst  # a file of another chain is decoded into the caller's buffer as given
            if not exact:  # a short file fails its header check below
                dst = check_room(max(st.st_size - HEADER_BYTES, 0), dst)

            def check(raw: memoryview, payload_bytes: int) -> tuple[bytes, envelope.Hasher]:
                nonlocal tenant
                # not a chunk file, another namespace or key, a layout or codec this kvtier does not read,
                # or another chunk size (config, geometry): never a partial fill (one call per read)
                header, hasher, tenant = self.envelope.open_header(raw, key, out.nbytes if exact else None,
                                                                   HEADER_BYTES)
                if payload_bytes != header.stored_bytes:  # the sentence only for a bad one: a hit runs this
                    raise ChunkFormatError(length_problem(payload_bytes + header.header_bytes, header.header_bytes,
                                                          header.stored_bytes, "the chunk file") or "")
                if header.stored_bytes != header.original_bytes or (
                        header.codecs != self.envelope.chain.ids and not codecs.chain_of(header.codecs).passthrough):
                    raise Recoded("its codec chain changes the payload")  # read whole, then decoded
                return header.digest, PayloadHasher() if hasher is None else hasher

            assert dst is not None
            out = memoryview(np.frombuffer(dst, dtype=np.uint8).data)
            try:
                block = blocks.pop()
            except IndexError:  # more reads at once than the blocks made at set-up: one more, kept after
                block = aligned_buffer(HEADER_BYTES)
            try:
                if not read_chunk(io, fd, block, out, st.st_size, check):
                    raise ChunkFormatError("payload checksum mismatch")
            except Recoded:  # written under another chain than this tier's (a config change)
                return self._read_recoded(key, path, st.st_size, given, records, exact)
            finally:
                blocks.append(block)
        finally:
            os.close(fd)
        if records is not None and tenant is not None:  # verified: the digest covers the record
            records[bytes(key)] = tenant
        return out[:st.st_size - HEADER_BYTES]


def read_chunk(io: ChunkIO, fd: int, header: memoryview, out: memoryview, file_bytes: int,
               check_header: CheckHeader) -> bool:
    """Read a chunk file of ``file_bytes`` bytes into ``out``; True if its digest matches.

    The header block (into ``header``, a block of ``io.read_headers``) and the first payload slice come in
    one read; ``check_header(header, payload_bytes)`` (:data:`CheckHeader`) returns the expected digest and
    the hasher to feed the payload, or raises ChunkFormatError (namespace, key, length).  The payload,
    ``file_bytes - HEADER_BYTES`` bytes, lands in ``out`` (which may hold unverified bytes when this
    returns False or raises).

    Raises:
        ChunkFormatError: from ``check_header``, a payload larger than ``out``, or a file
            shorter than ``file_bytes`` by the time it is read.
        OSError: the read failed.
    """
    length = file_bytes - HEADER_BYTES
    if length < 0:
        n_read = os.preadv(fd, [header], 0)
        check_header(header[:n_read], length)
        raise ChunkFormatError(f"header truncated ({n_read} of {HEADER_BYTES} bytes)")
    if length > out.nbytes:
        raise ChunkFormatError(f"payload of {length} bytes exceeds the {out.nbytes}-byte buffer")
    out = out[:length]
    if not io.direct and not io.pipeline:
        return _read_buffered(io, fd, header, out, length, check_header)
    return read_direct(io, fd, header, out, length, check_header)


def _read_buffered(io: ChunkIO, fd: int, header: memoryview, out: memoryview, length: int,
                   check_header: CheckHeader) -> bool:
    """A buffered read, serial or split (:data:`CHOOSER`); see :meth:`read_chunk`."""
    chooser = CHOOSER
    cls, split = chooser.begin(length)
    split = split and not io.closed
    t0 = time.perf_counter()
    cut = max(ALIGN, int(length * SPLIT_HEAD_SHARE) // ALIGN * ALIGN) if split else length
    tail: Future[None] | None = None
    try:
        if split:  # the tail on a helper, while this thread reads and hashes the head
            tail = io.submit(_pread_exact, fd, [out[cut:]], HEADER_BYTES + cut, length - cut)
        for off in range(0, cut, io.slice_bytes) if cut else range(1):
            n = min(io.slice_bytes, cut - off)
            if off == 0:
                _pread_exact(fd, [header, out[:n]], 0, HEADER_BYTES + n)
                expected, hasher = check_header(header, length)
            else:
                _pread_exact(fd, [out[off:off + n]], HEADER_BYTES + off, n)
            hasher.update(out[off:off + n])  # right after its read, while in the CPU cache
        if tail is not None:
            tail.result()
            hasher.update(out[cut:])
    finally:
        if tail is not None:
            wait([tail])  # never leave a read into the caller's buffer running
        chooser.end(cls, split, length, time.perf_counter() - t0)
    return hasher.digest() == expected


def _pread_exact(fd: int, iov: list[memoryview], offset: int, want: int) -> None:
    """Read until ``want`` bytes arrived (into ``iov`` in order) or the file ends (ChunkFormatError):
    one ``preadv``, and a short one (legal before the end of a file; rare) goes on in :func:`read_rest`."""
    got = os.preadv(fd, iov, offset)
    if got < want:
        read_rest(fd, iov, offset, got, want)


# ---- the way of a buffered read: serial or split, whichever is measured faster now ----------------
SPLIT_MIN_BYTES = 256 << 10
"""Buffered payloads at least this large may be read split over two threads (:class:`ReadChooser`)."""


def _median(samples: deque[float]) -> float:
    """Median of a non-empty window (``statistics.median``'s result at a third of its cost)."""
    ordered = sorted(samples)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class _Samples:
    """Recent wall seconds per byte of each way, for one class of reads."""

    __slots__ = ("gap", "prefer_split", "serial", "split", "until_explore")

    def __init__(self, window: int, gap: int) -> None:
        self.serial: deque[float] = deque(maxlen=window)
        self.split: deque[float] = deque(maxlen=window)
        self.prefer_split = False
        self.gap = gap  # reads between two exploring reads
        self.until_explore = gap


class ReadChooser:
    """Serial or split reads, whichever is measured faster now: :func:`read_chunk`'s buffered reads ask
    :data:`CHOOSER` around each read (:meth:`begin` / :meth:`end`), the node tier's verified copies
    (:mod:`kvtier.core.tiers.node.readcopy`) their own instance around each batch.

    A buffered read is a kernel copy from the page cache (CPU work, 9-17 GiB/s) and the hash adds about a
    third to it on one core: *serial* (each slice hashed right after its read, while in the CPU cache)
    costs R + H; *split* (a helper reads the payload's tail while this thread reads and hashes the head)
    about R/2 + H plus a hand-off with a free core, R + H + a hand-off without one.  For each class of
    reads (payload size by its power of two; reads at once: 1, 2, 3-4, more) the chooser keeps the last
    :attr:`window` wall times per byte of each way and compares their medians (one preempted read must not
    swing it): split when its median is below :attr:`split_margin` × serial's.  The other way is taken on
    an *exploring* read, every :attr:`explore_every` reads at first; each that loses (is not faster by the
    margin than every read of the chosen way in the window) doubles the gap up to :attr:`explore_max`, one
    that wins brings it back.  Split is never tried while twice the reads at once reach the usable CPUs
    (so never on 1-2 CPUs: measured there, docs/benchmarks.md sessions 3-4, split never beat serial, and
    under load single reads swing 10x).  Samples are not locked; a race loses a sample, never a read.
    """

    explore_every = 8
    """Reads between two exploring reads at first, and after an exploring read won."""
    explore_max = 256
    """Reads between two exploring reads at most (after exploring reads kept losing)."""
    window = 8
    """Samples of each way kept per class."""
    warmup = 3
    """Samples of each way taken (alternating) before the medians decide."""
    split_margin = 0.85
    """Split must be this much faster than serial to be used (ties, and noise, go to the cheaper,
    serial way; with a free core split is expected at ~0.6-0.7 of serial's time)."""

    def __init__(self, cpus: int | None = None) -> None:
        self.cpus = usable_cpus() if cpus is None else cpus
        self.force: str | None = None
        """``"serial"`` or ``"split"`` to fix the choice (tests, benchmarks); ``None`` to measure."""
        self.running = 0
        self._lock = threading.Lock()
        self._classes: dict[tuple[int, int], _Samples] = {}
        self.splits = 0
        self.serials = 0

    def begin(self, length: int) -> tuple[tuple[int, int], bool]:
        """Start a read of ``length`` payload bytes: (its class, whether to split it)."""
        with self._lock:
            self.running += 1
            running = self.running
        cls = (length.bit_length(), running if running < 3 else (3 if running < 5 else 4))
        if self.force is not None:
            return cls, self.force == "split" and length >= ALIGN * 2
        if length < SPLIT_MIN_BYTES or 2 * running >= self.cpus:
            return cls, False
        st = self._classes.get(cls)
        if st is None:
            st = self._classes[cls] = _Samples(self.window, self.explore_every)
        if len(st.serial) < self.warmup or len(st.split) < self.warmup:
            return cls, len(st.split) < len(st.serial)  # alternate until each way has its samples
        st.until_explore -= 1
        if st.until_explore <= 0:
            st.until_explore = st.gap
            return cls, not st.prefer_split
        return cls, st.prefer_split

    def end(self, cls: tuple[int, int], split: bool, length: int, seconds: float) -> None:
        """Record a finished read of ``length`` bytes that took ``seconds``."""
        with self._lock:
            self.running -= 1
            if split:
                self.splits += 1
            else:
                self.serials += 1
        st = self._classes.get(cls)
        if st is None or length <= 0 or self.force is not None:
            return
        per_byte = seconds / length
        warm = len(st.serial) >= self.warmup and len(st.split) >= self.warmup
        if warm and split != st.prefer_split:  # an exploring read: did the other way win this time?
            # won: faster than every recent read of the chosen way (one lucky read on a noisy host
            # should not bring exploration back to 1 in 8)
            chosen = min(st.split if st.prefer_split else st.serial)
            won = per_byte < self.split_margin * chosen if split else per_byte * self.split_margin < chosen
            st.gap = self.explore_every if won else min(2 * st.gap, self.explore_max)
            st.until_explore = st.gap
        (st.split if split else st.serial).append(per_byte)
        if len(st.serial) >= self.warmup and len(st.split) >= self.warmup:
            st.prefer_split = _median(st.split) < self.split_margin * _median(st.serial)

CHOOSER = ReadChooser()
"""The process's chooser of buffered read strategies (the load is the machine's: one serves every disk tier)."""
