"""Serial or split reads, whichever is measured faster now: the disk tier's buffered reads
(:mod:`kvtier.core.tiers.disk.reads`) and the node tier's verified copies
(:mod:`kvtier.core.tiers.node.readcopy`) both ask :class:`ReadChooser`.  Also the aligned
buffers and I/O vectors the disk tier's reads and writes share (:class:`IOBuffers`,
:func:`skip_iov`): here, below both, so that a read runs no writer's module."""

from __future__ import annotations

import mmap
import os
import threading
from collections import deque

import numpy as np

ALIGN = 4096
"""Alignment of O_DIRECT buffers, lengths and offsets, bytes."""
SPLIT_MIN_BYTES = 256 << 10
"""Buffered payloads at least this large may be read split over two threads (:class:`ReadChooser`)."""


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


class IOBuffers(threading.local):
    """Per-thread aligned buffers of one reader or writer: a header block of ``header_bytes``, a
    tail block and the bounce slices.  Only scratch memory for the I/O of the call running on the
    thread: no request or tenant state (those travel as arguments, issue 33)."""

    def __init__(self, header_bytes: int) -> None:
        self.header = aligned_buffer(header_bytes)
        self.tail = aligned_buffer(ALIGN)
        self.bounce: list[memoryview] = []

    def bounces(self, slice_bytes: int, count: int) -> list[memoryview]:
        if len(self.bounce) < count or self.bounce[0].nbytes < slice_bytes:
            self.bounce = [aligned_buffer(slice_bytes) for _ in range(count)]
        return self.bounce[:count]


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
    """Serial or split buffered reads: whichever is measured faster now.

    Serial costs read + hash on one thread (R + H).  Split costs about R/2 + H plus a hand-off
    when a core is free, and R + H + a hand-off (a wait for a core) when none is: the machine's
    load decides, so it is measured instead of assumed.  For each class of reads (payload size,
    by its power of two, and how many reads ran at once: 1, 2, 3-4, more) the chooser keeps the
    last :attr:`window` wall times per byte of each way and compares their medians (one read
    preempted by another process must not swing the choice): split is used when its median is
    below :attr:`split_margin` × serial's, serial otherwise, and the other way on an *exploring*
    read so that its samples follow the load.  Exploring reads come every :attr:`explore_every`
    reads at first; each one that loses (is not faster by the margin than every read of the
    chosen way in the window) doubles the gap, up to :attr:`explore_max`, and one that wins
    brings it back to :attr:`explore_every`, so a way that keeps losing costs one read in 256,
    and one that starts winning is found at the next exploring read.

    Split is not tried at all unless a core is left over for the rest of the host: while twice
    the reads at once reach the usable CPUs (each split read keeps two busy), so never on 1 or 2
    CPUs.  Measured on 2 CPUs (docs/benchmarks.md, sessions 3 and 4): split never beat serial,
    idle or loaded, and under load (other processes on both cores) single reads swing 10x, so the
    medians of 8 samples picked split while it was slower (32 MiB: 0.66 against serial's 0.77 ×
    raw, interleaved).

    One chooser serves the whole process (:data:`CHOOSER`): the load is the machine's.  Samples
    are not locked; a race loses a sample, never a read.
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

    def split_share(self) -> float:
        """Share of the buffered reads since start that were split (for benchmark notes)."""
        total = self.splits + self.serials
        return self.splits / total if total else 0.0


CHOOSER = ReadChooser()
"""The process's chooser of buffered read strategies."""
