"""Verified chunk-file I/O of the disk tier: buffered or ``O_DIRECT``, hashing overlapped with I/O.

:class:`ChunkIO` moves one payload between a file (payload at offset
:data:`~kvtier.core.tiers.chunkfile.HEADER_BYTES`) and a memory buffer and returns the payload's
XXH3-128, computed over every payload byte:

- **Reads** go in slices of ``slice_bytes``: a helper thread reads slice ``i + 1`` while the
  calling thread hashes slice ``i`` (both release the GIL: ``os.preadv`` in the kernel, xxhash in
  C), so the hash costs little more than the last slice's share.  A payload of one slice is read
  and hashed on the calling thread (a hand-off would cost more than it hides).
- **Writes** hash the whole payload on a helper thread while the calling thread writes it; the
  header (which holds the digest) is written last, at offset 0.
- **O_DIRECT** (``direct=True``): the page cache is bypassed, so the kernel does not copy the
  bytes and the host's page cache is not filled with chunks the cpu tier already holds.  I/O goes
  straight to and from the caller's buffer when it is 4096-byte aligned (the cpu tier's pages
  are); otherwise through per-thread aligned bounce buffers (anonymous ``mmap`` memory, which is
  page-aligned).  A payload whose length is not a multiple of 4096 has its last partial block
  read and written through a bounce block; the file is then truncated to its exact length.

Alignment rules are those of open(2), "O_DIRECT": buffer address, length and file offset must be
multiples of the logical block size (4096 covers every common device).

Errors: a short read (the file is shorter than its header says) raises
:class:`~kvtier.core.tiers.chunkfile.ChunkFormatError`; other failures raise ``OSError``.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import numpy as np

from kvtier.core.tiers.chunkfile import HEADER_BYTES, ChunkFormatError, PayloadHasher, payload_digest

T = TypeVar("T")
ALIGN = 4096
"""Alignment of O_DIRECT buffers, lengths and offsets, bytes."""
O_DIRECT = getattr(os, "O_DIRECT", 0)
DEFAULT_SLICE_BYTES = 1 << 20


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
    """Per-thread aligned buffers: a header block, a tail block and two bounce slices."""

    def __init__(self) -> None:
        self.header = aligned_buffer(HEADER_BYTES)
        self.tail = aligned_buffer(ALIGN)
        self.bounce: list[memoryview] = []

    def bounces(self, slice_bytes: int) -> list[memoryview]:
        if not self.bounce or self.bounce[0].nbytes < slice_bytes:
            self.bounce = [aligned_buffer(slice_bytes), aligned_buffer(slice_bytes)]
        return self.bounce


class ChunkIO:
    """Reads and writes payloads of chunk files; see the module docstring.

    Args:
        direct: use ``O_DIRECT`` (the caller opens files with :attr:`open_flags`).
        slice_bytes: bytes per read slice, a positive multiple of 4096.
        helper_threads: threads of the helper pool that reads ahead and hashes writes.

    Raises:
        ValueError: ``slice_bytes`` is not a positive multiple of 4096.
    """

    def __init__(self, direct: bool, slice_bytes: int = DEFAULT_SLICE_BYTES, helper_threads: int = 2) -> None:
        if slice_bytes <= 0 or slice_bytes % ALIGN:
            raise ValueError(f"slice_bytes must be a positive multiple of {ALIGN}, got {slice_bytes}")
        self.direct = direct
        self.slice_bytes = slice_bytes
        self.open_flags = O_DIRECT if direct else 0
        self._buffers = _Buffers()
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

    # ---- header --------------------------------------------------------------------------
    def read_header(self, fd: int) -> memoryview:
        """The file's first :data:`HEADER_BYTES` bytes (fewer if the file is shorter); a per-thread view."""
        buf = self._buffers.header
        got = os.preadv(fd, [buf], 0)
        return buf[:got]

    def write_header(self, fd: int, header: bytes) -> None:
        """Write the header block at offset 0."""
        buf = self._buffers.header
        buf[:] = header
        _pwrite_all(fd, buf, 0)

    # ---- payload reads -------------------------------------------------------------------
    def read_payload(self, fd: int, out: memoryview, length: int) -> bytes:
        """Read ``length`` payload bytes into ``out[:length]``; returns their XXH3-128.

        Raises:
            ChunkFormatError: the file ends before ``length`` payload bytes.
            OSError: the read failed.
        """
        out = out[:length]
        bounced = self.direct and address(out) % ALIGN != 0
        bounce = self._buffers.bounces(self.slice_bytes) if bounced else []
        tail = self._buffers.tail
        offsets = range(0, length, self.slice_bytes)

        def read(i: int) -> memoryview:
            """Read slice ``i``; return where its bytes are (``out`` or a bounce buffer)."""
            off = offsets[i]
            n = min(self.slice_bytes, length - off)
            if not self.direct:
                _pread_exact(fd, [out[off:off + n]], HEADER_BYTES + off, n)
                return out[off:off + n]
            if bounced:
                buf = bounce[i % 2]
                _pread_exact(fd, [buf[:round_up(n)]], HEADER_BYTES + off, n)
                return buf[:n]
            whole = n // ALIGN * ALIGN
            iov = [out[off:off + whole]] if whole else []
            if n > whole:
                iov.append(tail)
            _pread_exact(fd, iov, HEADER_BYTES + off, n)
            if n > whole:
                out[off + whole:off + n] = tail[:n - whole]
            return out[off:off + n]

        if len(offsets) == 1:
            got = read(0)
            if bounced:
                out[:] = got
            return payload_digest(got)
        hasher = PayloadHasher()
        ahead = self._submit(read, 0)
        try:
            for i, off in enumerate(offsets):
                got = ahead.result()
                if i + 1 < len(offsets):
                    ahead = self._submit(read, i + 1)
                hasher.update(got)
                if bounced:
                    out[off:off + got.nbytes] = got
        finally:
            wait([ahead])  # never leave a read into the caller's buffers running
        return hasher.digest()

    # ---- payload writes ------------------------------------------------------------------
    def write_payload(self, fd: int, payload: memoryview) -> bytes:
        """Write ``payload`` at offset :data:`HEADER_BYTES`; returns its XXH3-128, computed on a
        helper thread while the bytes are written.  In direct mode a partial last block is padded
        and the file truncated to ``HEADER_BYTES + len(payload)``.

        Raises:
            OSError: the write failed.
        """
        length = payload.nbytes
        digest = self._submit(payload_digest, payload)
        try:
            if not self.direct:
                _pwrite_all(fd, payload, HEADER_BYTES)
            elif address(payload) % ALIGN == 0:
                whole = length // ALIGN * ALIGN
                if whole:
                    _pwrite_all(fd, payload[:whole], HEADER_BYTES)
                if length > whole:
                    self._write_tail(fd, payload[whole:], HEADER_BYTES + whole)
            else:
                bounce = self._buffers.bounces(self.slice_bytes)[0]
                for off in range(0, length, self.slice_bytes):
                    n = min(self.slice_bytes, length - off)
                    bounce[:n] = payload[off:off + n]
                    if n % ALIGN:
                        bounce[n:round_up(n)] = bytes(round_up(n) - n)
                    _pwrite_all(fd, bounce[:round_up(n)], HEADER_BYTES + off)
            if self.direct and length % ALIGN:
                os.ftruncate(fd, HEADER_BYTES + length)
        finally:
            result = digest.result()
        return result

    def _write_tail(self, fd: int, rest: memoryview, offset: int) -> None:
        tail = self._buffers.tail
        tail[:rest.nbytes] = rest
        tail[rest.nbytes:] = bytes(ALIGN - rest.nbytes)
        _pwrite_all(fd, tail, offset)


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
    done = 0
    while done < buf.nbytes:  # short writes are rare but legal
        done += os.pwrite(fd, buf[done:], offset + done)


def direct_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether files in ``directory`` can be opened, written and read with ``O_DIRECT``.

    A filesystem that refuses it (EINVAL at open, as tmpfs did before Linux 6.6, or at the first
    aligned I/O) gives ``False``; other errors propagate as ``OSError``.
    """
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f".kvtier-direct-probe-{os.getpid()}-{threading.get_ident()}")
    buf = aligned_buffer(ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == 22:  # EINVAL: the filesystem does not do O_DIRECT
            return False
        raise
    try:
        os.pwrite(fd, buf, 0)
        os.preadv(fd, [buf], 0)
        return True
    except OSError as exc:
        if exc.errno == 22:
            return False
        raise
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


PROBE_BYTES = 16 << 20
"""Bytes written and read back per mode by :func:`measure_direct`."""
_measured: dict[int, tuple[bool, str]] = {}
_measured_lock = threading.Lock()


def measure_direct(directory: str | os.PathLike[str]) -> tuple[bool, str]:
    """Choose ``O_DIRECT`` for ``directory`` by measurement (the ``disk_io: auto`` rule).

    Writes :data:`PROBE_BYTES` in 1 MiB writes and reads them back, once buffered (``fdatasync``
    after writing, and the file dropped from the page cache with ``posix_fadvise(DONTNEED)``
    before reading, so both modes pay the device) and once with ``O_DIRECT``.  Direct wins
    when it is supported and takes at most 1.1× the buffered time: it keeps the host's page cache
    free of chunks the cpu tier already holds, which is worth a little throughput.  The result is
    remembered per filesystem (``st_dev``) for the life of the process.

    Returns:
        (use direct, one line saying why, with the measured times).
    """
    import time

    dev = os.stat(directory).st_dev
    with _measured_lock:
        if dev in _measured:
            return _measured[dev]
        if not direct_supported(directory):
            _measured[dev] = (False, "the filesystem refuses O_DIRECT")
            return _measured[dev]
        block = aligned_buffer(1 << 20)
        block[:] = np.random.default_rng(0).integers(0, 256, block.nbytes, dtype=np.uint8).tobytes()
        seconds = {}
        for name, flags in (("buffered", 0), ("direct", O_DIRECT)):
            path = os.path.join(directory, f".kvtier-io-probe-{os.getpid()}")
            try:
                t0 = time.perf_counter()
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flags, 0o600)
                try:
                    for off in range(0, PROBE_BYTES, block.nbytes):
                        _pwrite_all(fd, block, off)
                    os.fdatasync(fd)
                    if not flags and hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    for off in range(0, PROBE_BYTES, block.nbytes):
                        os.preadv(fd, [block], off)
                finally:
                    os.close(fd)
                seconds[name] = time.perf_counter() - t0
            finally:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        direct = seconds["direct"] <= 1.1 * seconds["buffered"]
        why = (f"{PROBE_BYTES >> 20} MiB written and read back: buffered {seconds['buffered'] * 1e3:.0f} ms, "
               f"O_DIRECT {seconds['direct'] * 1e3:.0f} ms")
        _measured[dev] = (direct, why)
        return _measured[dev]
