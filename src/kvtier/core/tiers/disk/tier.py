"""Disk tier: one verified chunk file per chunk under ``root/<namespace hex>/<key hex[:2]>/<key hex>.kvc``;
this module is its part on a request's path (a disk hit runs it, and the envelope's header check).

:class:`DiskTier` is put together from its parts: here what a hit runs (``contains_many``: the
index asks once per load; ``get_many``/``get_into``: the mover's reads; ``usage``: the per-step
stats); :class:`~kvtier.core.tiers.disk.files.DiskFiles` its set-up, index, crash-safe writes,
deletes and accounting; :class:`~kvtier.core.tiers.disk.directory.DirectorySync` the rescan of a
directory other processes share, ``clear`` and a vanished directory;
:class:`~kvtier.core.tiers.disk.reads.DiskReads` the reads of any length and the ranged reads.

- **Verified reads**: every file is a value envelope (:mod:`kvtier.core.envelope`, header padded
  to 4096 bytes: :mod:`kvtier.core.tiers.disk.chunkfile`) whose XXH3-128 covers its header and
  payload; files of the release before (chunk file version 2) are still read.  A whole read
  checks the header, the file's size against it, and the digest over header fields and payload,
  computed while the bytes move.  A torn, truncated, foreign-namespace, older-format or corrupt
  file is a miss: it is counted in ``corrupt``, logged, and removed (``CORRUPT`` from ``get_into``).
- **Buffered or O_DIRECT** I/O (``io``), and ``io_threads`` chunks at once in ``get_many`` /
  ``put_many``.  How a read moves the bytes (:func:`read_chunk`, over the tier's
  :class:`~kvtier.core.tiers.disk.chunkio.ChunkIO` settings; its writes are there): in slices of
  ``slice_bytes``, the header block with the first slice in one call.  In direct mode
  (``pipeline``) helper threads keep ``read_depth`` slices in flight while the calling thread
  hashes the completed ones in order (``os.preadv`` and xxhash's ``update`` release the GIL), so
  the device stays busy and the hash hides behind it.  Buffered reads are kernel copies from the
  page cache (CPU work, 9-17 GiB/s) and the hash adds about a third to them on one core; they are
  read either *serially* (each slice hashed right after it is read, while it is in the CPU cache)
  or *split* (a helper reads the payload's tail while the calling thread reads and hashes the
  head, then hashes the tail), whichever :class:`~kvtier.core.readchoice.ReadChooser` measures to
  be faster now: split wins only with a free core (so it is never tried on 1-2 CPUs).
- **Shared directory**: several processes may point at the same directory.  ``contains`` answers
  from this process's index only (no filesystem access, no side effect); a file another process
  deleted is a miss when read; files other processes wrote are taken in by the rescan.

Thread-safety: ``get_into`` and ``put`` do their I/O without a lock and may run concurrently on
different keys; the index is guarded by a lock.  Errors inside a read: a short read (the file is
shorter than its header says) raises :class:`~kvtier.core.tiers.disk.chunkfile.ChunkFormatError`;
other failures raise ``OSError``; both become ``CORRUPT``.
"""

from __future__ import annotations

import os
import stat
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from kvtier.core import codecs, envelope
from kvtier.core.errors import length_problem
from kvtier.core.keys import ChunkKey
from kvtier.core.readchoice import ALIGN, address, round_up, skip_iov
from kvtier.core.tenant import TenantRecords
from kvtier.core.tiers.base import GetResult, TierUsage
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES, ChunkFormatError, PayloadHasher
from kvtier.core.tiers.disk.chunkio import ChunkIO
from kvtier.core.tiers.disk.directory import DirectorySync
from kvtier.core.tiers.disk.files import DiskFiles
from kvtier.core.tiers.disk.reads import DiskReads
from kvtier.core.tiers.disk.recoded import Recoded
from kvtier.core.tiers.disk.scan import SUFFIX
from kvtier.core.tiers.valueread import check_room

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CheckHeader = Callable[[memoryview, int], tuple[bytes, envelope.Hasher]]
"""``check_header(header block, payload bytes) -> (expected digest, hasher)``: checks a file's
header against what the reader expects (raising ChunkFormatError) and returns the digest the
payload must give and a streaming hasher already fed what the digest covers before the payload
(the envelope's header fields; nothing for a legacy file)."""
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
        except envelope.ForeignValue:  # another engine's master key (counted by the envelope): a miss,
            with self._lock:           # the file kept for it, no longer indexed nor offered
                self._forget(key)
                self._sealed_away.add(key)
            return GetResult.MISS
        except FileNotFoundError:
            with self._lock:
                if key not in self._writing:  # removed by another process (a write in flight is not)
                    self._forget(key)
            return GetResult.MISS
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
        io = self._io
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
                if not read_chunk(io, fd, out, st.st_size, check):
                    raise ChunkFormatError("payload checksum mismatch")
            except Recoded:  # written under another chain than this tier's (a config change)
                return self._read_recoded(key, path, st.st_size, given, records, exact)
        finally:
            os.close(fd)
        if records is not None and tenant is not None:  # verified: the digest covers the record
            records[bytes(key)] = tenant
        return out[:st.st_size - HEADER_BYTES]


def read_chunk(io: ChunkIO, fd: int, out: memoryview, file_bytes: int, check_header: CheckHeader) -> bool:
    """Read a chunk file of ``file_bytes`` bytes into ``out``; True if its digest matches.

    The header block and the first payload slice come in one read; ``check_header(header,
    payload_bytes)`` (:data:`CheckHeader`) returns the expected digest and the hasher to feed
    the payload, or raises ChunkFormatError (namespace, key, length).  The payload, ``file_bytes - HEADER_BYTES`` bytes, lands in ``out`` (which may
    hold unverified bytes when this returns False or raises).

    Raises:
        ChunkFormatError: from ``check_header``, a payload larger than ``out``, or a file
            shorter than ``file_bytes`` by the time it is read.
        OSError: the read failed.
    """
    length = file_bytes - HEADER_BYTES
    header = io.buffers.header
    if length < 0:
        n_read = os.preadv(fd, [header], 0)
        check_header(header[:n_read], length)
        raise ChunkFormatError(f"header truncated ({n_read} of {HEADER_BYTES} bytes)")
    if length > out.nbytes:
        raise ChunkFormatError(f"payload of {length} bytes exceeds the {out.nbytes}-byte buffer")
    out = out[:length]
    bounced = io.direct and address(out) % ALIGN != 0
    bounce = io.buffers.bounces(io.slice_bytes, io.read_depth + 1) if bounced else []
    tail = io.buffers.tail
    offsets = range(0, length, io.slice_bytes) if length else range(1)

    def read(i: int) -> memoryview:
        """Read slice ``i`` (slice 0 with the header); return where its bytes are."""
        off = offsets[i]
        n = min(io.slice_bytes, length - off)
        iov = [header] if i == 0 else []
        if not io.direct:
            iov.append(out[off:off + n])
            _pread_exact(fd, iov, HEADER_BYTES * (i != 0) + off, n + HEADER_BYTES * (i == 0))
            return out[off:off + n]
        if bounced:
            iov.append(bounce[i % len(bounce)][:round_up(n)])
        else:
            whole = n // ALIGN * ALIGN
            if whole:
                iov.append(out[off:off + whole])
            if n > whole:
                iov.append(tail)
        _pread_exact(fd, [b for b in iov if b.nbytes], HEADER_BYTES * (i != 0) + off,
                     n + HEADER_BYTES * (i == 0))
        if bounced:
            return bounce[i % len(bounce)][:n]
        if n % ALIGN:
            out[off + n // ALIGN * ALIGN:off + n] = tail[:n % ALIGN]
        return out[off:off + n]

    if not io.direct and not io.pipeline:
        return _read_buffered(io, fd, out, length, check_header)
    if not io.pipeline or len(offsets) == 1:
        got = read(0)
        expected, hasher = check_header(header, length)
        for i, off in enumerate(offsets):  # each slice hashed right after it is read
            if i:
                got = read(i)
            hasher.update(got)
            if bounced:
                out[off:off + got.nbytes] = got
        return hasher.digest() == expected
    # up to read_depth slices in flight on the helpers while this thread hashes them in order
    inflight = deque(io.submit(read, i) for i in range(min(io.read_depth, len(offsets))))
    following = len(inflight)
    try:
        for i, off in enumerate(offsets):
            got = inflight.popleft().result()
            if i == 0:
                expected, hasher = check_header(header, length)
            if following < len(offsets):
                inflight.append(io.submit(read, following))
                following += 1
            hasher.update(got)
            if bounced:
                out[off:off + got.nbytes] = got
    finally:
        wait(inflight)  # never leave a read into the caller's buffers running
    return hasher.digest() == expected

def _read_buffered(io: ChunkIO, fd: int, out: memoryview, length: int, check_header: CheckHeader) -> bool:
    """A buffered read, serial or split (:mod:`kvtier.core.readchoice`); see :meth:`read_chunk`."""
    chooser = io.chooser
    cls, split = chooser.begin(length)
    split = split and not io.closed
    t0 = time.perf_counter()
    cut = max(ALIGN, int(length * SPLIT_HEAD_SHARE) // ALIGN * ALIGN) if split else length
    tail: Future[None] | None = None
    try:
        if split:  # the tail on a helper, while this thread reads and hashes the head
            tail = io.submit(_pread_exact, fd, [out[cut:]], HEADER_BYTES + cut, length - cut)
        header = io.buffers.header
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
    """Read until ``want`` bytes arrived (into ``iov`` in order) or the file ends (ChunkFormatError)."""
    got = os.preadv(fd, iov, offset)
    if got >= want:
        return
    total = got
    while total < want:  # short reads are legal before end of file; continue from where it stopped
        rest = skip_iov(iov, total)
        more = os.preadv(fd, rest, offset + total) if rest else 0
        if more <= 0:
            raise ChunkFormatError(f"payload truncated ({total} of {want} bytes of a slice)")
        total += more
