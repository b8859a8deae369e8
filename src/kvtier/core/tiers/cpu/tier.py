"""CPU DRAM tier: one allocation of fixed-size pages, one chunk per page.

The pool is allocated once at start (no per-chunk malloc) as anonymous ``mmap`` memory viewed as a
numpy array, so it starts on a page boundary and pages of a multiple of 4096 bytes suit
``O_DIRECT`` disk I/O.  When the engine's KV cache is on a GPU the worker calls
:meth:`CpuTier.pin_host_memory`, which registers the pool as pinned host memory
(``cudaHostRegister``, :mod:`kvtier.core.pinned`) so the GPU copies straight into and out of its
pages; if registration fails the pool stays pageable and the copy path stages (logged once).
:meth:`CpuTier.view` returns zero-copy
numpy views into the pool, valid while the chunk stays resident (the store pins chunks that
callers hold views of).

Two-phase writes let a producer fill a page in place: ``reserve(key)`` hands out a page that
``contains`` does not report yet, ``commit(key)`` publishes it, ``abort(key)`` returns it.

Thread-safety: page accounting is guarded by a lock (uncontended under the store, whose own lock
serialises metadata); byte copies run outside it, on pages the caller keeps alive (the store pins
them).
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtier.core import pinned
from kvtier.core.config import GiB
from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.sizing import cpu_capacity_bytes
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.base import (
    AlreadyHeld,
    GetResult,
    NoRoom,
    PutResult,
    Reservation,
    ReserveResult,
    StagingTier,
    TierUsage,
)
from kvtier.core.tiers.valueread import check_range, check_room

if TYPE_CHECKING:
    from kvtier.core.tiers.factory import TierContext


log = logging.getLogger(__name__)


def _allocate_pool(num_bytes: int) -> np.ndarray:
    """A page-aligned uint8 pool of ``num_bytes`` (anonymous ``mmap``), every OS page faulted in.

    Linux populates the pages inside ``mmap`` (``MAP_POPULATE``): measured on the 2-core CI machine
    kind, 4 GiB (the default ``cpu_gib``) took 1.4 s against 3.0 s for touching every page from
    Python, so an engine with the default settings starts sooner.  Elsewhere every page is touched."""
    if not num_bytes:
        return np.empty(0, np.uint8)
    # anonymous mmap: page-aligned, so the disk tier's O_DIRECT I/O can use the pages directly
    populate = getattr(mmap, "MAP_POPULATE", 0)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate
    pool = np.frombuffer(mmap.mmap(-1, num_bytes, flags=flags), dtype=np.uint8)
    if not populate:
        pool[::4096] = 0  # fault every OS page in now, so the first save into a page is a plain copy
    return pool


class CpuTier(StagingTier):
    """Fixed pool of ``num_pages`` pages of ``page_bytes`` bytes.

    Args:
        capacity_bytes: bytes to allocate; rounded down to whole pages.
        page_bytes: bytes per page = the largest chunk this tier accepts.

    Raises:
        ValueError: ``page_bytes`` not positive.
    """

    name = "cpu"

    def __init__(self, capacity_bytes: int, page_bytes: int) -> None:
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        super().__init__()
        self.page_bytes = page_bytes
        self.num_pages = max(capacity_bytes, 0) // page_bytes
        self.pool = _allocate_pool(self.num_pages * page_bytes)
        self.pinned = False  # registered as pinned host memory (pin_host_memory)
        self._pages = self.pool.reshape(self.num_pages, page_bytes) if self.num_pages else \
            self.pool.reshape(0, page_bytes)
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        # each page's row view, made on its first view() and kept: a hit hands out the same array objects
        # (a numpy view is ~4 us cold, per chunk of a hit) (lazily: a view per page up front is ~100 B each)
        self._rows: list[np.ndarray | None] = [None] * self.num_pages
        self._key_to_page: dict[ChunkKey, int] = {}
        # contains() is the dict's own membership test, a C call: the index asks it per chunk on the hit path
        self.contains = self._key_to_page.__contains__  # type: ignore[method-assign,assignment]
        self._key_to_len: dict[ChunkKey, int] = {}
        # each resident chunk's view (view() below): the dict's own item lookup, a C call (the index maps a
        # hit's chunks through it); set when a page is published, dropped when it is freed
        self._views: dict[ChunkKey, np.ndarray] = {}
        self.view = self._views.__getitem__  # type: ignore[method-assign,assignment]
        self._reserved: dict[ChunkKey, int] = {}
        self._regions: dict[int, tuple[int, weakref.finalize]] = {}  # address -> (bytes, its unregistration)
        self._lock = threading.RLock()

    def pin_host_memory(self) -> bool:
        """Register the pool as pinned host memory for GPU copies (:func:`kvtier.core.pinned.register_host`).

        Idempotent.  On failure the pool stays pageable, one warning names the reason, and the copy
        path stages each page through a pinned bounce buffer (slower, equally correct).  The pool is
        unregistered when this tier is collected.  Returns whether the pool is pinned.
        """
        if self.pinned:
            return True
        why = self.register_memory(self.pool)
        if why is not None:
            log.warning("kvtier: the cpu tier's %.1f GiB pool is not pinned (%s); GPU copies go through a "
                        "staging buffer", self.pool.nbytes / GiB, why)
            return False
        self.pinned = True
        return True

    # ---- RegistersMemory -----------------------------------------------------------------
    def register_memory(self, region: np.ndarray) -> str | None:
        """Pin ``region`` (a contiguous host array, alive while registered) for GPU copies
        (:func:`kvtier.core.pinned.register_host`); ``None`` once pinned (or already registered
        here), else why not.  Unpinned when this tier is collected, if not before."""
        start = int(region.ctypes.data)
        with self._lock:
            if start in self._regions:
                return None
        why = pinned.register_host(region)
        if why is not None:
            return why
        pieces = pinned.registered_pieces(region)
        # unpinned when the tier is collected; not at interpreter exit, when CUDA may be torn down already
        done = weakref.finalize(self, pinned.unregister_host, pieces)
        done.atexit = False
        with self._lock:
            self._regions[start] = (int(region.nbytes), done)
        return None

    def unregister_memory(self, region: np.ndarray) -> bool:
        """Unpin a region :meth:`register_memory` pinned; ``False`` if it did not."""
        with self._lock:
            found = self._regions.pop(int(region.ctypes.data), None)
        if found is None:
            return False
        found[1]()  # runs pinned.unregister_host once
        if region.ctypes.data == self.pool.ctypes.data:
            self.pinned = False
        return True

    def registered_memory(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each region pinned through this tier."""
        with self._lock:
            return [(start, nbytes) for start, (nbytes, _) in self._regions.items()]

    # ---- two-phase write -----------------------------------------------------------------
    def can_reserve(self) -> bool:
        """Whether a free page exists."""
        return bool(self._free)

    def reserve(self, key: ChunkKey, length: int | None = None) -> ReserveResult:
        """A :class:`Reservation` of a writable view ``[length]`` (default ``page_bytes``) of a fresh
        page for ``key``, not yet visible to ``contains``; ``AlreadyHeld.ALREADY_HELD`` if ``key`` is
        present or reserved, else ``NoRoom.NO_ROOM`` if no page is free.

        Raises:
            ValueError: ``length`` larger than ``page_bytes``.
        """
        length = self.page_bytes if length is None else length
        if length > self.page_bytes:
            raise ValueError(f"chunk of {length} bytes does not fit a {self.page_bytes}-byte page")
        with self._lock:
            if key in self._key_to_page or key in self._reserved:
                return AlreadyHeld.ALREADY_HELD
            if not self._free:
                return NoRoom.NO_ROOM
            page = self._free.pop()
            self._reserved[key] = page
            self._key_to_len[key] = length
        return Reservation(self._pages[page] if length == self.page_bytes else self._pages[page, :length])

    def commit(self, key: ChunkKey) -> None:
        """Publish a reserved page.  Raises KeyError if ``key`` was not reserved."""
        with self._lock:
            self._key_to_page[key] = page = self._reserved.pop(key)
            self._views[key] = self._view_of(page, self._key_to_len[key])

    def reserve_many(self, keys: Sequence[ChunkKey]) -> list[ReserveResult]:
        """:meth:`reserve` of each of ``keys`` (a whole page each), in order, under one hold of the lock."""
        with self._lock:
            return [self.reserve(key) for key in keys]

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [self.delete(key) for key in keys]

    def commit_many(self, keys: Sequence[ChunkKey]) -> None:
        """:meth:`commit` of each of ``keys``, under one hold of the lock (a load's promoted chunks)."""
        with self._lock:
            for key in keys:
                self._key_to_page[key] = page = self._reserved.pop(key)
                self._views[key] = self._view_of(page, self._key_to_len[key])

    def abort(self, key: ChunkKey) -> None:
        """Return a reserved page to the free list; unknown keys are ignored."""
        with self._lock:
            page = self._reserved.pop(key, None)
            if page is not None:
                self._free.append(page)
                self._key_to_len.pop(key, None)

    # ---- Tier contract -------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return key in self._key_to_page

    def view(self, key: ChunkKey) -> np.ndarray:
        """Zero-copy uint8 view ``[chunk_len]`` of a resident chunk (the same array object while it stays
        resident).  Raises KeyError if absent.  (The instance's ``view`` is its views' dict lookup: this
        method documents it.)"""
        return self._views[key]

    def _view_of(self, page: int, length: int) -> np.ndarray:
        """The view of ``length`` bytes of ``page``: a whole page is its row, made once."""
        if length != self.page_bytes:
            return self._pages[page, :length]
        row = self._rows[page]
        if row is None:
            row = self._rows[page] = self._pages[page]
        return row

    def length(self, key: ChunkKey) -> int:
        """Bytes of a resident or reserved chunk.  Raises KeyError if absent."""
        return self._key_to_len[key]

    def get_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> GetResult:
        """Copy a resident chunk into ``dst`` (the cpu tier keeps no tenant record: the store's top
        tier does, :mod:`kvtier.core.index`; ``records`` gets nothing)."""
        with self._lock:
            page = self._key_to_page.get(key)
            if page is None:
                return GetResult.MISS
            n = self._key_to_len[key]
        if n != memoryview(dst).nbytes:
            return GetResult.MISS  # another chunk size: never a partial fill
        np.copyto(np.frombuffer(dst, dtype=np.uint8, count=n), self._pages[page, :n])
        return GetResult.HIT

    def read_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> int | None:
        """Copy a resident chunk into ``dst[:length]`` (``dst`` at least its length); its length,
        or ``None`` if absent.  Pages are process memory: nothing to verify.

        Raises:
            BufferTooSmall: ``dst`` is shorter than the chunk.
        """
        with self._lock:
            page = self._key_to_page.get(key)
            if page is None:
                return None
            n = self._key_to_len[key]
            out = check_room(n, dst)
            np.copyto(np.frombuffer(out, dtype=np.uint8), self._pages[page, :n])
        return n

    def get(self, key: ChunkKey, records: TenantRecords | None = None) -> bytes | None:
        """A copy of a resident chunk's bytes, or ``None``."""
        with self._lock:
            page = self._key_to_page.get(key)
            return None if page is None else self._pages[page, :self._key_to_len[key]].tobytes()

    def get_range(self, key: ChunkKey, offset: int, length: int) -> bytes | None:
        """``chunk[offset:offset + length]`` of a resident chunk (clipped at its end), or ``None``."""
        check_range(offset, length)
        with self._lock:
            page = self._key_to_page.get(key)
            if page is None:
                return None
            n = self._key_to_len[key]
            return self._pages[page, min(offset, n):min(offset + length, n)].tobytes()

    def put(self, key: ChunkKey, data: memoryview | bytes, tenant: Writer | None = None) -> PutResult:
        """Copy ``data`` into a page (``tenant`` is kept by the store's top tier, not here);
        ``NO_ROOM`` for data longer than a page."""
        if key in self._key_to_page or key in self._reserved:  # checked again by reserve
            return PutResult.PRESENT
        src = np.frombuffer(data, dtype=np.uint8)
        if src.size > self.page_bytes:
            return PutResult.NO_ROOM
        got = self.reserve(key, src.size)
        if got is AlreadyHeld.ALREADY_HELD:
            return PutResult.PRESENT
        if got is NoRoom.NO_ROOM:
            return PutResult.NO_ROOM
        np.copyto(got.buffer, src)
        self.commit(key)
        return PutResult.STORED

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            page = self._key_to_page.pop(key, None)
            if page is None:
                return False
            self._key_to_len.pop(key, None)
            self._views.pop(key, None)
            self._free.append(page)
        return True

    def keys(self) -> list[ChunkKey]:
        """Resident keys (committed only)."""
        with self._lock:
            return list(self._key_to_page)

    def usage(self) -> TierUsage:
        with self._lock:
            used = (self.num_pages - len(self._free)) * self.page_bytes
            cap = self.num_pages * self.page_bytes
            return TierUsage(used, cap - used, cap, len(self._key_to_page))

    def check(self) -> None:
        """Assert page accounting: every page is free, reserved or resident, exactly once."""
        with self._lock:
            pages = list(self._free) + list(self._reserved.values()) + list(self._key_to_page.values())
        assert len(pages) == self.num_pages and len(set(pages)) == self.num_pages, \
            f"cpu tier pages leaked or doubled: {len(pages)} accounted of {self.num_pages}"
        assert self._views.keys() == self._key_to_page.keys(), "cpu tier views differ from its resident chunks"


def from_config(ctx: TierContext) -> CpuTier:
    """The cpu tier of one rank (always present: every chunk passes through it).

    Raises:
        ConfigError: a size :func:`kvtier.core.sizing.cpu_capacity_bytes` refuses, or the pool
            cannot be allocated.
    """
    capacity = cpu_capacity_bytes(ctx.config, ctx.chunk_bytes, ctx.tp_size)
    try:
        return CpuTier(capacity, ctx.chunk_bytes)
    except (MemoryError, ValueError) as exc:
        raise ConfigError(f"cannot allocate the cpu tier of {capacity / GiB:.1f} GiB ({exc}); lower cpu_gib") from None
