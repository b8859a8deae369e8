"""Verified chunk-file I/O of the disk tier: buffered or ``O_DIRECT``, hashing overlapped with I/O.

:class:`ChunkIO` moves one payload between a file (payload at offset
:data:`~kvtier.core.tiers.disk.chunkfile.HEADER_BYTES`) and a memory buffer and returns the payload's
XXH3-128, computed over every payload byte:

- **Reads** go in slices of ``slice_bytes``; the header block comes with the first slice in one
  call.  In direct mode (``pipeline``) helper threads keep :data:`READ_DEPTH` slices in flight
  while the calling thread hashes the completed ones in order (``os.preadv`` releases the GIL and
  so does xxhash's ``update``, measured: another thread runs Python code meanwhile), so the device
  stays busy and the hash hides behind it.  Buffered reads are kernel copies from the page cache
  (CPU work, 9-17 GiB/s) and the hash adds about a third to them on one core; they are read
  either *serially* (each slice hashed right after it is read, while it is in the CPU cache) or
  *split* (a helper reads the payload's tail while the calling thread reads and hashes the head,
  then hashes the tail), whichever :class:`~kvtier.core.readchoice.ReadChooser` measures
  to be faster now: split wins only with a free core, and costs a hand-off when there is none
  (so it is never tried on 1-2 CPUs).
- **Writes**: a payload of at least :data:`OVERLAP_MIN_BYTES` (buffered) or
  :data:`DIRECT_OVERLAP_MIN_BYTES` (direct) is hashed on a helper thread while the calling thread
  writes it, and the header (which holds the digest) goes last, at offset 0.  Smaller payloads
  are hashed first and written with their header in one call: below 16 MiB one device request
  costs less than the hash plus a second, synchronous request for the header (interleaved A/B,
  docs/benchmarks.md "Session 4"); above it the hidden hash (~2 ms per 32 MiB) is worth more.
- **O_DIRECT** (``direct=True``): the page cache is bypassed, so the kernel does not copy the
  bytes and the host's page cache is not filled with chunks the cpu tier already holds.  I/O goes
  straight to and from the caller's buffer when it is 4096-byte aligned (the cpu tier's pages
  are); otherwise through per-thread aligned bounce buffers (anonymous ``mmap`` memory, which is
  page-aligned).  A payload whose length is not a multiple of 4096 has its last partial block
  read and written through a bounce block; the file is then truncated to its exact length.

Alignment rules are those of open(2), "O_DIRECT": buffer address, length and file offset must be
multiples of the logical block size (4096 covers every common device).

Errors: a short read (the file is shorter than its header says) raises
:class:`~kvtier.core.tiers.disk.chunkfile.ChunkFormatError`; other failures raise ``OSError``.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import numpy as np

from kvtier.core.envelope import Hasher
from kvtier.core.readchoice import CHOOSER
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES, ChunkFormatError, payload_digest

T = TypeVar("T")
CheckHeader = Callable[[memoryview, int], tuple[bytes, Hasher]]
"""``check_header(header block, payload bytes) -> (expected digest, hasher)``: checks a file's
header against what the reader expects (raising ChunkFormatError) and returns the digest the
payload must give and a streaming hasher already fed what the digest covers before the payload
(the envelope's header fields; nothing for a legacy file)."""
ALIGN = 4096
"""Alignment of O_DIRECT buffers, lengths and offsets, bytes."""
O_DIRECT = getattr(os, "O_DIRECT", 0)
DEFAULT_SLICE_BYTES = 2 << 20
READ_DEPTH = 4
"""Slices read ahead at once in a pipelined read (keeps the device busy with several requests)."""
OVERLAP_MIN_BYTES = 2 << 20
"""Buffered payloads at least this large are hashed on a helper thread while they are written."""
DIRECT_OVERLAP_MIN_BYTES = 16 << 20
"""``O_DIRECT`` payloads at least this large are hashed on a helper thread while they are written."""
SPLIT_HEAD_SHARE = 0.45
"""Share of a split read's payload read (and hashed) by the calling thread: with the hash at about a
third of the read's cost, reading 0.45 and hashing it takes about as long as reading the other 0.55."""


def aligned_buffer(nbytes: int) -> memoryview:
    """A writable, page-aligned, zero-filled buffer of ``nbytes`` (anonymous ``mmap``)."""
    return memoryview(mmap.mmap(-1, max(nbytes, ALIGN)))[:nbytes]


def address(buf: memoryview) -> int:
    """Memory address of ``buf``'s first byte."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if buf.nbytes else 0


def round_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


class _Buffers(threading.local):
    """Per-thread aligned buffers: a header block, a tail block and two bounce slices.  Only
    scratch memory for the I/O of the call running on the thread: no request or tenant state
    (those travel as arguments, issue 33)."""

    def __init__(self) -> None:
        self.header = aligned_buffer(HEADER_BYTES)
        self.tail = aligned_buffer(ALIGN)
        self.bounce: list[memoryview] = []

    def bounces(self, slice_bytes: int, count: int) -> list[memoryview]:
        if len(self.bounce) < count or self.bounce[0].nbytes < slice_bytes:
            self.bounce = [aligned_buffer(slice_bytes) for _ in range(count)]
        return self.bounce[:count]


class ChunkIO:
    """Reads and writes payloads of chunk files; see the module docstring.

    Args:
        direct: use ``O_DIRECT`` (the caller opens files with :attr:`open_flags`).
        slice_bytes: bytes per read slice, a positive multiple of 4096.
        helper_threads: threads of the helper pool that reads ahead and hashes writes.
        pipeline: read slice ``i + 1`` on a helper while slice ``i`` is hashed (default: in direct
            mode only, where the device, not the CPU, moves the bytes; buffered reads are serial
            or split, as :class:`~kvtier.core.readchoice.ReadChooser` measures best).

    Raises:
        ValueError: ``slice_bytes`` is not a positive multiple of 4096.
    """

    def __init__(self, direct: bool, slice_bytes: int = DEFAULT_SLICE_BYTES, helper_threads: int = 2,
                 pipeline: bool | None = None) -> None:
        if slice_bytes <= 0 or slice_bytes % ALIGN:
            raise ValueError(f"slice_bytes must be a positive multiple of {ALIGN}, got {slice_bytes}")
        self.direct = direct
        self.pipeline = direct if pipeline is None else pipeline
        # direct writes: below DIRECT_OVERLAP_MIN_BYTES one device request (header + payload) beats
        # hashing on a helper and a second request for the header (measured, docs/benchmarks.md)
        self.overlap_min_bytes = DIRECT_OVERLAP_MIN_BYTES if direct else OVERLAP_MIN_BYTES
        self.read_depth = READ_DEPTH
        self.slice_bytes = slice_bytes
        self.open_flags = O_DIRECT if direct else 0
        self._buffers = _Buffers()
        self.chooser = CHOOSER
        self._closed = False
        self._helpers = ThreadPoolExecutor(max(helper_threads, 1), thread_name_prefix="kvtier-disk-helper")

    def close(self) -> None:
        """Stop the helper threads; later calls run every step on the calling thread."""
        self._closed = True
        self._helpers.shutdown(wait=True)

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if not self._closed:
            try:
                return self._helpers.submit(fn, *args)
            except RuntimeError:  # shut down meanwhile
                pass
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            done.set_exception(exc)
        return done

    # ---- reads ---------------------------------------------------------------------------
    def read_chunk(self, fd: int, out: memoryview, file_bytes: int, check_header: CheckHeader) -> bool:
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
        header = self._buffers.header
        if length < 0:
            n_read = os.preadv(fd, [header], 0)
            check_header(header[:n_read], length)
            raise ChunkFormatError(f"header truncated ({n_read} of {HEADER_BYTES} bytes)")
        if length > out.nbytes:
            raise ChunkFormatError(f"payload of {length} bytes exceeds the {out.nbytes}-byte buffer")
        out = out[:length]
        bounced = self.direct and address(out) % ALIGN != 0
        bounce = self._buffers.bounces(self.slice_bytes, self.read_depth + 1) if bounced else []
        tail = self._buffers.tail
        offsets = range(0, length, self.slice_bytes) if length else range(1)

        def read(i: int) -> memoryview:
            """Read slice ``i`` (slice 0 with the header); return where its bytes are."""
            off = offsets[i]
            n = min(self.slice_bytes, length - off)
            iov = [header] if i == 0 else []
            if not self.direct:
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

        if not self.direct and not self.pipeline:
            return self._read_buffered(fd, out, length, check_header)
        if not self.pipeline or len(offsets) == 1:
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
        inflight = deque(self._submit(read, i) for i in range(min(self.read_depth, len(offsets))))
        following = len(inflight)
        try:
            for i, off in enumerate(offsets):
                got = inflight.popleft().result()
                if i == 0:
                    expected, hasher = check_header(header, length)
                if following < len(offsets):
                    inflight.append(self._submit(read, following))
                    following += 1
                hasher.update(got)
                if bounced:
                    out[off:off + got.nbytes] = got
        finally:
            wait(inflight)  # never leave a read into the caller's buffers running
        return hasher.digest() == expected

    def _read_buffered(self, fd: int, out: memoryview, length: int, check_header: CheckHeader) -> bool:
        """A buffered read, serial or split (:mod:`kvtier.core.readchoice`); see :meth:`read_chunk`."""
        chooser = self.chooser
        cls, split = chooser.begin(length)
        split = split and not self._closed
        t0 = time.perf_counter()
        cut = max(ALIGN, int(length * SPLIT_HEAD_SHARE) // ALIGN * ALIGN) if split else length
        tail: Future[None] | None = None
        try:
            if split:  # the tail on a helper, while this thread reads and hashes the head
                tail = self._submit(_pread_exact, fd, [out[cut:]], HEADER_BYTES + cut, length - cut)
            header = self._buffers.header
            for off in range(0, cut, self.slice_bytes) if cut else range(1):
                n = min(self.slice_bytes, cut - off)
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

    # ---- writes --------------------------------------------------------------------------
    def write_chunk(self, fd: int, payload: memoryview, make_header: Callable[[bytes], bytes],
                    digest_of: Callable[[memoryview], bytes] = payload_digest) -> None:
        """Write a chunk file: ``make_header(digest_of(payload))`` (a :data:`HEADER_BYTES` block)
        then ``payload``.

        A payload of at least ``overlap_min_bytes`` is hashed on a helper thread while it is
        written, and the header goes last; a smaller one is hashed first and written with its
        header in one call (a second I/O would cost more than the hash).  In direct mode a partial
        last block is padded and the file truncated to ``HEADER_BYTES + len(payload)``.

        Raises:
            OSError: the write failed.
        """
        length = payload.nbytes
        aligned = not self.direct or address(payload) % ALIGN == 0
        if length < self.overlap_min_bytes:
            self._write_header(fd, make_header(digest_of(payload)), with_payload=payload if aligned else None)
            if not aligned:
                self._write_payload(fd, payload)
        else:
            digest = self._submit(digest_of, payload)
            try:
                self._write_payload(fd, payload)
            finally:
                result = digest.result()
            self._write_header(fd, make_header(result), with_payload=None)
        if self.direct and length % ALIGN:
            os.ftruncate(fd, HEADER_BYTES + length)

    def _write_header(self, fd: int, header: bytes, with_payload: memoryview | None) -> None:
        buf = self._buffers.header
        buf[:] = header
        iov = [buf]
        if with_payload is not None and with_payload.nbytes:
            whole = with_payload.nbytes // ALIGN * ALIGN if self.direct else with_payload.nbytes
            if whole:
                iov.append(with_payload[:whole])
            if whole < with_payload.nbytes:
                iov.append(self._padded_tail(with_payload[whole:]))
        _pwritev_all(fd, iov, 0)

    def _write_payload(self, fd: int, payload: memoryview) -> None:
        length = payload.nbytes
        if not self.direct:
            _pwritev_all(fd, [payload], HEADER_BYTES)
        elif address(payload) % ALIGN == 0:
            whole = length // ALIGN * ALIGN
            iov = [payload[:whole]] if whole else []
            if length > whole:
                iov.append(self._padded_tail(payload[whole:]))
            _pwritev_all(fd, iov, HEADER_BYTES)
        else:
            bounce = self._buffers.bounces(self.slice_bytes, 1)[0]
            for off in range(0, length, self.slice_bytes):
                n = min(self.slice_bytes, length - off)
                bounce[:n] = payload[off:off + n]
                if n % ALIGN:
                    bounce[n:round_up(n)] = bytes(round_up(n) - n)
                _pwritev_all(fd, [bounce[:round_up(n)]], HEADER_BYTES + off)

    def _padded_tail(self, rest: memoryview) -> memoryview:
        tail = self._buffers.tail
        tail[:rest.nbytes] = rest
        tail[rest.nbytes:] = bytes(ALIGN - rest.nbytes)
        return tail


def _pread_exact(fd: int, iov: list[memoryview], offset: int, want: int) -> None:
    """Read until ``want`` bytes arrived (into ``iov`` in order) or the file ends (ChunkFormatError)."""
    got = os.preadv(fd, iov, offset)
    if got >= want:
        return
    total = got
    while total < want:  # short reads are legal before end of file; continue from where it stopped
        rest = _skip(iov, total)
        more = os.preadv(fd, rest, offset + total) if rest else 0
        if more <= 0:
            raise ChunkFormatError(f"payload truncated ({total} of {want} bytes of a slice)")
        total += more


def _skip(iov: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for buf in iov:
        if n >= buf.nbytes:
            n -= buf.nbytes
            continue
        out.append(buf[n:])
        n = 0
    return out


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    _pwritev_all(fd, [buf], offset)


def _pwritev_all(fd: int, iov: list[memoryview], offset: int) -> None:
    total = sum(b.nbytes for b in iov)
    done = os.pwritev(fd, iov, offset)
    while done < total:  # short writes are rare but legal
        done += os.pwritev(fd, _skip(iov, done), offset + done)


def helper_threads(io_threads: int) -> int:
    """Helper threads for ``io_threads`` concurrent chunk reads, each with :data:`READ_DEPTH` slices in flight."""
    return min(READ_DEPTH * max(io_threads, 1), 32)
