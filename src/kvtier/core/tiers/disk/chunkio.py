"""Verified chunk-file I/O of the disk tier: buffered or ``O_DIRECT``, hashing overlapped with I/O.

:class:`ChunkIO` holds how one disk tier moves payloads between files (payload at offset
:data:`~kvtier.core.tiers.disk.chunkfile.HEADER_BYTES`) and memory buffers: direct or buffered,
the slice size, the helper threads, the aligned buffers (:func:`aligned_buffer`, :class:`IOBuffers`, the
reads' header blocks, made at set-up).  It writes them here, and reads them in direct mode
(:func:`read_direct`); a read starts in :func:`kvtier.core.tiers.disk.tier.read_chunk`, on a hit's path,
where the buffered read (serial or split) runs:

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

Errors: failures raise ``OSError``.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import numpy as np

from kvtier.core.envelopedigest import Hasher
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES, ChunkFormatError, payload_digest

T = TypeVar("T")
ALIGN = 4096
"""Alignment of O_DIRECT buffers, lengths and offsets, bytes."""
CheckHeader = Callable[[memoryview, int], tuple[bytes, Hasher]]
"""``check_header(header block, payload bytes) -> (expected digest, hasher)``: checks a file's
header against what the reader expects (raising ChunkFormatError) and returns the digest the
payload must give and a streaming hasher already fed what the digest covers before the payload
(the envelope's header fields; nothing for a legacy file)."""
O_DIRECT = getattr(os, "O_DIRECT", 0)
DEFAULT_SLICE_BYTES = 2 << 20
READ_DEPTH = 4
"""Slices read ahead at once in a pipelined read (keeps the device busy with several requests)."""
OVERLAP_MIN_BYTES = 2 << 20
"""Buffered payloads at least this large are hashed on a helper thread while they are written."""
DIRECT_OVERLAP_MIN_BYTES = 16 << 20
"""``O_DIRECT`` payloads at least this large are hashed on a helper thread while they are written."""


def aligned_buffer(nbytes: int) -> memoryview:
    """A writable, page-aligned, zero-filled buffer of ``nbytes`` (anonymous ``mmap``)."""
    return memoryview(mmap.mmap(-1, max(nbytes, ALIGN)))[:nbytes]


def address(buf: memoryview) -> int:
    """Memory address of ``buf``'s first byte."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if buf.nbytes else 0


def round_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def skip_iov(iov: list[memoryview], n: int) -> list[memoryview]:
    """What is left of the I/O vector ``iov`` after its first ``n`` bytes (a short read or write)."""
    out = []
    for buf in iov:
        if n >= buf.nbytes:
            n -= buf.nbytes
            continue
        out.append(buf[n:])
        n = 0
    return out


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class IOBuffers(threading.local):
    """Per-thread aligned buffers of the writes and the ``O_DIRECT`` reads: a header block of
    ``header_bytes``, a tail block and the bounce slices.  Only scratch memory for the I/O of the
    call running on the thread: no request or tenant state (those travel as arguments, issue 33)."""

    def __init__(self, header_bytes: int) -> None:
        self.header = aligned_buffer(header_bytes)
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
        readers: reads at once the header blocks are made for at set-up (more take a new block).
        pipeline: read slice ``i + 1`` on a helper while slice ``i`` is hashed (default: in direct
            mode only, where the device, not the CPU, moves the bytes; buffered reads are serial
            or split, as :class:`~kvtier.core.tiers.disk.tier.ReadChooser` measures best).

    Raises:
        ValueError: ``slice_bytes`` is not a positive multiple of 4096.
    """

    def __init__(self, direct: bool, slice_bytes: int = DEFAULT_SLICE_BYTES, helper_threads: int = 2,
                 pipeline: bool | None = None, readers: int = 2) -> None:
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
        self.buffers = IOBuffers(HEADER_BYTES)
        block = aligned_buffer(max(readers, 1) * HEADER_BYTES)
        self.read_headers = [block[i:i + HEADER_BYTES] for i in range(0, block.nbytes, HEADER_BYTES)]
        """Free header blocks of reads: a read takes one and gives it back (list ``pop``/``append``,
        atomic), so a read on a new thread sets nothing up; made here, at set-up, in one block."""
        self.closed = False
        self._helpers = ThreadPoolExecutor(max(helper_threads, 1), thread_name_prefix="kvtier-disk-helper")

    def close(self) -> None:
        """Stop the helper threads; later calls run every step on the calling thread."""
        self.closed = True
        self._helpers.shutdown(wait=True)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if not self.closed:
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
            digest = self.submit(digest_of, payload)
            try:
                self._write_payload(fd, payload)
            finally:
                result = digest.result()
            self._write_header(fd, make_header(result), with_payload=None)
        if self.direct and length % ALIGN:
            os.ftruncate(fd, HEADER_BYTES + length)

    def _write_header(self, fd: int, header: bytes, with_payload: memoryview | None) -> None:
        buf = self.buffers.header
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
            bounce = self.buffers.bounces(self.slice_bytes, 1)[0]
            for off in range(0, length, self.slice_bytes):
                n = min(self.slice_bytes, length - off)
                bounce[:n] = payload[off:off + n]
                if n % ALIGN:
                    bounce[n:round_up(n)] = bytes(round_up(n) - n)
                _pwritev_all(fd, [bounce[:round_up(n)]], HEADER_BYTES + off)

    def _padded_tail(self, rest: memoryview) -> memoryview:
        tail = self.buffers.tail
        tail[:rest.nbytes] = rest
        tail[rest.nbytes:] = bytes(ALIGN - rest.nbytes)
        return tail


# ---- direct reads (the buffered read, serial or split, is kvtier.core.tiers.disk.tier's) ----------------------
def read_direct(io: ChunkIO, fd: int, header: memoryview, out: memoryview, length: int,
                check_header: CheckHeader) -> bool:
    """:func:`~kvtier.core.tiers.disk.tier.read_chunk` in direct mode, or with ``pipeline`` forced on
    buffered I/O: ``length`` payload bytes into ``out`` (exactly that long), the header block into
    ``header`` with the first slice; True if the digest matches.  Direct I/O goes through the bounce
    slices when ``out`` is not aligned, and a partial last block through the tail block."""
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
            pread_exact(fd, iov, HEADER_BYTES * (i != 0) + off, n + HEADER_BYTES * (i == 0))
            return out[off:off + n]
        if bounced:
            iov.append(bounce[i % len(bounce)][:round_up(n)])
        else:
            whole = n // ALIGN * ALIGN
            if whole:
                iov.append(out[off:off + whole])
            if n > whole:
                iov.append(tail)
        pread_exact(fd, [b for b in iov if b.nbytes], HEADER_BYTES * (i != 0) + off,
                    n + HEADER_BYTES * (i == 0))
        if bounced:
            return bounce[i % len(bounce)][:n]
        if n % ALIGN:
            out[off + n // ALIGN * ALIGN:off + n] = tail[:n % ALIGN]
        return out[off:off + n]

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


def pread_exact(fd: int, iov: list[memoryview], offset: int, want: int) -> None:
    """Read until ``want`` bytes arrived (into ``iov`` in order) or the file ends (ChunkFormatError)."""
    got = os.preadv(fd, iov, offset)
    if got < want:
        read_rest(fd, iov, offset, got, want)


def read_rest(fd: int, iov: list[memoryview], offset: int, got: int, want: int) -> None:
    """Go on after a short read of ``got`` of ``want`` bytes (legal before the end of a file) from where it
    stopped; ChunkFormatError if the file ends first."""
    total = got
    while total < want:
        rest = skip_iov(iov, total)
        more = os.preadv(fd, rest, offset + total) if rest else 0
        if more <= 0:
            raise ChunkFormatError(f"payload truncated ({total} of {want} bytes of a slice)")
        total += more


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    _pwritev_all(fd, [buf], offset)


def _pwritev_all(fd: int, iov: list[memoryview], offset: int) -> None:
    total = sum(b.nbytes for b in iov)
    done = os.pwritev(fd, iov, offset)
    while done < total:  # short writes are rare but legal
        done += os.pwritev(fd, skip_iov(iov, done), offset + done)


def helper_threads(io_threads: int) -> int:
    """Helper threads for ``io_threads`` concurrent chunk reads, each with :data:`READ_DEPTH` slices in flight."""
    return min(READ_DEPTH * max(io_threads, 1), 32)
