"""Pinned (page-locked) host memory for DMA between the GPU and kvtier's host pages.

A GPU copies to and from host memory asynchronously, at the link's speed, only when that memory is
pinned; from pageable memory the driver bounces every copy through its own pinned buffer and the
call blocks the host (CUDA C++ Programming Guide, "Page-Locked Host Memory").  The cpu tier
allocates its page pool with ``mmap`` (page aligned, so the disk tier's ``O_DIRECT`` I/O can use its
pages) and registers it here with ``cudaHostRegister`` (through ``torch.cuda.cudart()``), as vLLM's
native offload registers its shared region (vllm/v1/kv_offload/cpu/host_register.py and
``pin_mmap_region`` in vllm/v1/kv_offload/cpu/gpu_worker.py, which also bounds one registration to
64 GiB).  It does not use ``torch.empty(..., pin_memory=True)``: torch's caching host allocator
rounds every allocation up to a power of two, so a 40 GiB pool would pin 64 GiB.

:data:`REGIONS` records what is registered, so the copy path can tell, per page, whether it may DMA
straight into it (:func:`is_pinned`) or must stage it through a pinned bounce buffer (a private
buffer outside the pool, or a pool whose registration failed).  Registration is pure speed: an
unpinned page is copied correctly, only slower.

Thread safety: :class:`PinnedRegions` is guarded by a lock; registration runs once per pool.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import threading
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)

MAX_REGISTER_BYTES = 64 << 30
"""Largest range one ``cudaHostRegister`` call pins (vLLM's ``MAX_HOST_REGISTER_CHUNK_BYTES``: driver limits)."""

CUDA_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: pinned for every CUDA context of the process, not only the current one."""


class PinnedRegions:
    """Non-overlapping host address ranges ``[start, start + nbytes)`` known to be pinned."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._lock = threading.Lock()

    def add(self, start: int, nbytes: int) -> None:
        """Record ``[start, start + nbytes)``.  Raises ValueError for an empty range or one overlapping a recorded one."""
        if nbytes <= 0:
            raise ValueError(f"a pinned region needs a positive size, got {nbytes}")
        with self._lock:
            i = bisect.bisect_right(self._starts, start)
            if (i > 0 and self._ends[i - 1] > start) or (i < len(self._starts) and self._starts[i] < start + nbytes):
                raise ValueError(f"pinned region at {start:#x} (+{nbytes}) overlaps one already recorded")
            self._starts.insert(i, start)
            self._ends.insert(i, start + nbytes)

    def remove(self, start: int) -> bool:
        """Forget the region starting at ``start``; False if none starts there."""
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            if i == len(self._starts) or self._starts[i] != start:
                return False
            del self._starts[i], self._ends[i]
            return True

    def covers(self, start: int, nbytes: int) -> bool:
        """Whether ``[start, start + nbytes)`` lies inside one recorded region (adjacent regions
        registered separately do not join: a copy never spans two registrations)."""
        with self._lock:
            i = bisect.bisect_right(self._starts, start) - 1
            return i >= 0 and start + max(nbytes, 0) <= self._ends[i]

    def __len__(self) -> int:
        with self._lock:
            return len(self._starts)


REGIONS = PinnedRegions()
"""The process's pinned host ranges (registered by :func:`register_host`)."""


def is_pinned(array: np.ndarray) -> bool:
    """Whether ``array``'s bytes (a contiguous array) lie inside one registered pinned region."""
    return REGIONS.covers(array.ctypes.data, array.nbytes)


def register_ranges(start: int, nbytes: int, max_bytes: int = MAX_REGISTER_BYTES) -> list[tuple[int, int]]:
    """The ``(start, nbytes)`` pieces one registration of ``[start, start + nbytes)`` is split into,
    each at most ``max_bytes`` (a multiple of 4096 is kept so no OS page is split between two).

    Raises:
        ValueError: ``max_bytes`` below one 4 KiB page.
    """
    if max_bytes < 4096:
        raise ValueError(f"max_bytes must be at least one 4096-byte page, got {max_bytes}")
    step = max_bytes - max_bytes % 4096
    return [(start + off, min(step, nbytes - off)) for off in range(0, max(nbytes, 0), step)]


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed registration (it would surface at the next
    kernel launch check), through the process's loaded ``libcudart`` as vLLM's ``CudaRTLibrary`` does."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart" in line), None)
        if path:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass


def register_host(array: np.ndarray) -> str | None:
    """Pin ``array``'s memory for the GPU (``cudaHostRegister``, portable) and record it in :data:`REGIONS`.

    Args:
        array: a contiguous host array that stays alive (and mapped) while registered.

    Returns:
        None once registered; else one sentence saying why not (no CUDA build of torch, no device,
        or the driver's error).  ``RLIMIT_MEMLOCK`` is not among the causes: NVIDIA's driver pins
        the pages with ``pin_user_pages`` and never charges them to that limit (os_lock_user_pages in
        NVIDIA/open-gpu-kernel-modules kernel-open/nvidia/os-mlock.c), so a container's default
        memlock limit and dropped capabilities do not stop it (docs/deploy.md).  Pieces already
        registered are unregistered again, so the array is either wholly pinned or not at all.
    """
    if array.nbytes == 0:
        return "nothing to pin (an empty pool)"
    try:
        import torch  # optional: core does not depend on torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    try:
        cudart = torch.cuda.cudart()
    except (AssertionError, RuntimeError) as exc:  # no libcudart, or CUDA re-initialised in a fork
        return f"the CUDA runtime is not usable here ({exc})"
    done: list[tuple[int, int]] = []
    for start, nbytes in register_ranges(array.ctypes.data, array.nbytes):
        result = cudart.cudaHostRegister(start, nbytes, CUDA_HOST_REGISTER_PORTABLE)
        if int(result) != 0:
            _clear_cuda_error()
            for ok_start, _n in done:
                cudart.cudaHostUnregister(ok_start)
            try:
                reason = str(cudart.cudaGetErrorString(result))
            except (TypeError, RuntimeError):
                reason = "no description"
            return (f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(result)} ({reason}); "
                    "docs/deploy.md#pinned-host-memory-and-memlock says what limits pinning (not ulimit -l)")
        done.append((start, nbytes))
    for start, nbytes in done:
        REGIONS.add(start, nbytes)
    return None


def unregister_host(pieces: Sequence[tuple[int, int]]) -> None:
    """Unpin the ``(start, nbytes)`` pieces :func:`registered_pieces` listed (before the memory is unmapped)."""
    try:
        import torch
    except ImportError:
        return
    for start, _nbytes in pieces:
        if REGIONS.remove(start) and torch.cuda.is_available():
            torch.cuda.cudart().cudaHostUnregister(start)


def registered_pieces(array: np.ndarray) -> list[tuple[int, int]]:
    """The ``(start, nbytes)`` pieces :func:`register_host` registers for ``array``."""
    return register_ranges(array.ctypes.data, array.nbytes)
