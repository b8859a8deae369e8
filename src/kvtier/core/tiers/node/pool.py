"""The node pool's memory: one file in shared memory (``/dev/shm`` or a hugetlbfs mount), mapped
by the owner and by every engine that uses it.

Layout (little-endian)::

    offset 0              the header, 4096 bytes: magic b"KVTNODE2", pool id (16 random bytes,
                          new each time the file is created), page bytes, pages, epoch (bumped by
                          every owner start), data offset, table slots; at 2048 the presence
                          table's heartbeat and sequence (two uint64)
    4096                  generations: one uint64 per page, the allocation that last granted it
    4096 + 8 * pages      heads: one uint64 per page, where a committed value starts its value
                          bytes + 1 (low 32 bits) and key space (high 32 bits, 0 without a
                          secret; :func:`~kvtier.core.tiers.node.index.head_word`), else 0 (what
                          a restarted owner rebuilds its index from)
    4096 + 16 * pages     the presence table: one uint64 per slot (:mod:`~kvtier.core.tiers.node.presence`)
    data offset           the pages (the data offset is a multiple of 2 MiB, a huge page)

Only the owner writes the header, the generations, the heads and the presence table; engines
write the pages they were granted, read the pages they pinned, and read the presence table.  A value (an envelope, :mod:`kvtier.core.envelope`)
occupies consecutive pages from its first.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.core.tiers.node.presence import META_WORDS, table_slots

MAGIC = b"KVTNODE2"
MAGIC_FAMILY = b"KVTNODE"
"""The first bytes of every node pool layout kvtier wrote (``KVTNODE1``, ``KVTNODE2``): a file that
starts otherwise is not a kvtier pool, and the owner never overwrites it (:func:`foreign_file`)."""
HEADER_BYTES = 4096
META_OFFSET = 2048
"""Where the presence table's heartbeat and sequence are in the header."""
ALIGN_BYTES = 2 << 20
"""The data offset's alignment: a 2 MiB huge page (x86-64's default hugetlbfs page size)."""
_HEADER = struct.Struct("<8s16sQQQQQ")
_GEN = struct.Struct("<Q")


class PoolError(OSError):
    """The pool file is missing, of another format or of another size than the owner says."""


def pages_for(total_bytes: int, page_bytes: int) -> tuple[int, int]:
    """``(pages, data offset)`` of a pool file of ``total_bytes`` with pages of ``page_bytes``.

    Raises:
        ValueError: not room for one page.
    """
    pages = (total_bytes - HEADER_BYTES) // (page_bytes + 16)
    while pages > 0:
        offset = -(-(HEADER_BYTES + 16 * pages + 8 * table_slots(pages)) // ALIGN_BYTES) * ALIGN_BYTES
        if offset + pages * page_bytes <= total_bytes:
            return pages, offset
        pages -= max(1, (offset + pages * page_bytes - total_bytes) // page_bytes)
    least = ALIGN_BYTES + page_bytes  # the header and tables end at a huge page boundary, then one page
    raise ValueError(f"a pool of {total_bytes} bytes has no room for one page of {page_bytes} bytes: its pages "
                     f"start at a {ALIGN_BYTES >> 20} MiB (huge page) boundary after its header, so it needs at "
                     f"least {least} bytes ({least / (1 << 20):.2f} MiB, {math.ceil(least / (1 << 30) * 1e4) / 1e4:g} GiB)")


@dataclass
class Pool:
    """A mapped pool file.

    Attributes:
        path: the file.
        pool_id: its 16-byte id (new when the file was created).
        page_bytes / num_pages / data_offset: the layout above.
        gens / heads: uint64 views of the generations and heads (shared memory).
        slots / meta: uint64 views of the presence table and its heartbeat and sequence.
        data: a uint8 view of the pages.
        epoch: the header's epoch when mapped (the owner bumps it on start).
    """

    path: Path
    pool_id: bytes
    page_bytes: int
    num_pages: int
    data_offset: int
    gens: np.ndarray
    heads: np.ndarray
    slots: np.ndarray
    meta: np.ndarray
    data: np.ndarray
    epoch: int
    _map: mmap.mmap

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def value(self, page: int, nbytes: int) -> memoryview:
        """The ``nbytes`` bytes from the start of ``page`` (a view of shared memory)."""
        start = page * self.page_bytes
        return memoryview(self.data[start:start + nbytes])  # type: ignore[arg-type]

    def pages_of(self, nbytes: int) -> int:
        """Pages a value of ``nbytes`` occupies (at least one)."""
        return max(1, -(-nbytes // self.page_bytes))

    def same_generation(self, page: int, nbytes: int, gen: int) -> bool:
        """Whether every page of the value at ``page`` still carries generation ``gen`` (and it
        ends within the pool)."""
        n = self.pages_of(nbytes)
        return 0 <= page and page + n <= self.num_pages and \
            self.gens[page:page + n].tobytes() == _GEN.pack(gen) * n

    def same_generations(self, values: Sequence[tuple[int, int, int, int]]) -> list[bool]:
        """Per pinned value ``(lease, first page, value bytes, generation)`` (a ``pin`` reply's),
        whether every page of it still carries the pin's generation (:meth:`same_generation`; a
        value reaching past the last page: ``False``).  Only the read values' own generation words
        are looked at, compared as bytes: no array pass, no temporary arrays, and nothing that lets
        another thread take the GIL in the middle of a load (a numpy pass over a 31-value batch
        cost 0.02 ms alone and 0.3-1.2 ms in an engine, 2026-12-06)."""
        gens, page_bytes, num_pages, pack = self.gens, self.page_bytes, self.num_pages, _GEN.pack
        out = []
        for _lease, page, nbytes, gen in values:
            n = max(1, -(-nbytes // page_bytes))
            out.append(0 <= page and page + n <= num_pages and gens[page:page + n].tobytes() == pack(gen) * n)
        return out

    def set_epoch(self, epoch: int) -> None:
        """Write ``epoch`` into the header (the owner, on start)."""
        self.epoch = epoch
        self._map[:_HEADER.size] = _HEADER.pack(MAGIC, self.pool_id, self.page_bytes, self.num_pages, epoch,
                                                self.data_offset, len(self.slots))

    def close(self) -> None:
        """Unmap (views taken from it must be gone; a view still alive keeps the map open)."""
        del self.gens, self.heads, self.slots, self.meta, self.data
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view: the map goes with it
            pass


def _map(path: Path, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _views(path: Path, m: mmap.mmap) -> Pool:
    magic, pool_id, page_bytes, num_pages, epoch, data_offset, num_slots = _HEADER.unpack(m[:_HEADER.size])
    if magic != MAGIC:
        raise PoolError(f"{path} is not a kvtier node pool of this kvtier version (its first bytes are not "
                        f"{MAGIC!r})")
    if data_offset + num_pages * page_bytes > len(m) or num_slots != table_slots(num_pages) \
            or HEADER_BYTES + 16 * num_pages + 8 * num_slots > data_offset:
        raise PoolError(f"{path} is shorter than its header says")
    gens = np.frombuffer(m, dtype="<u8", count=num_pages, offset=HEADER_BYTES)
    heads = np.frombuffer(m, dtype="<u8", count=num_pages, offset=HEADER_BYTES + 8 * num_pages)
    slots = np.frombuffer(m, dtype="<u8", count=num_slots, offset=HEADER_BYTES + 16 * num_pages)
    meta = np.frombuffer(m, dtype="<u8", count=META_WORDS, offset=META_OFFSET)
    data = np.frombuffer(m, dtype=np.uint8, count=num_pages * page_bytes, offset=data_offset)
    return Pool(path, pool_id, page_bytes, num_pages, data_offset, gens, heads, slots, meta, data, epoch, m)


def foreign_file(path: Path) -> str | None:
    """Why the existing ``path`` is not kvtier's to replace (one clause), or ``None`` when it is a
    node pool file of any kvtier layout (its first bytes :data:`MAGIC_FAMILY`; a pool file appears
    only whole, :func:`create_pool` renames it into place) or does not exist.

    Raises:
        PoolError: it exists but cannot be read.
    """
    try:
        if not path.exists() and not path.is_symlink():
            return None
        if not path.is_file():
            return "is not a regular file" if path.exists() else "is a dangling symbolic link"
        with open(path, "rb") as f:
            first = f.read(len(MAGIC_FAMILY))
    except OSError as exc:
        raise PoolError(f"cannot read the node pool {path}: {exc.strerror or exc}") from None
    if first != MAGIC_FAMILY:
        return "is not a kvtier node pool (it does not start with a kvtier pool header)"
    return None


def open_pool(path: Path) -> Pool:
    """Map an existing pool file (an engine; the owner on restart).

    Raises:
        PoolError: it is missing, unreadable or not a pool.
    """
    try:
        size = path.stat().st_size
        if size < HEADER_BYTES:
            raise PoolError(f"{path} is not a whole kvtier node pool (only {size} bytes)")
        return _views(path, _map(path, size))
    except PoolError:
        raise
    except (OSError, ValueError) as exc:
        raise PoolError(f"cannot map the node pool {path}: {exc}") from None


def create_pool(path: Path, total_bytes: int, page_bytes: int) -> Pool:
    """Create (or recreate, emptied) the pool file of ``total_bytes`` at ``path`` and map it.

    Raises:
        PoolError: the file cannot be created or sized (no room in ``/dev/shm``, a hugetlbfs
            without enough huge pages).
        ValueError: not room for one page.
    """
    pages, offset = pages_for(total_bytes, page_bytes)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, total_bytes)
            # reserve the memory now: a page of a sparse tmpfs file that finds no room when first
            # written is a SIGBUS in the engine writing it, not an error anyone can answer
            os.posix_fallocate(fd, 0, total_bytes)
        finally:
            os.close(fd)
        m = _map(tmp, total_bytes)
        m[:_HEADER.size] = _HEADER.pack(MAGIC, os.urandom(16), page_bytes, pages, 0, offset, table_slots(pages))
        os.replace(tmp, path)  # engines map the file only once it is whole
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        try:  # what the mount could hold: the size to ask for instead
            vfs = os.statvfs(path.parent)
            room = f"; {path.parent} has {vfs.f_bavail * vfs.f_frsize / (1 << 30):,.1f} GiB free"
        except OSError:
            room = ""
        raise PoolError(f"cannot create the node pool {path} of {total_bytes / (1 << 30):,.1f} GiB "
                        f"({total_bytes:,} bytes): {exc.strerror or exc}{room}") from None
    return _views(path, m)
