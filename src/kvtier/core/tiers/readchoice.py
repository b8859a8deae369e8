"""Serial or split buffered reads of the disk tier: whichever is measured faster now."""

from __future__ import annotations

import os
import threading

ALIGN = 4096
SPLIT_MIN_BYTES = 256 << 10
"""Buffered payloads at least this large may be read split over two threads (:class:`ReadChooser`)."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ReadChooser:
    """Serial or split buffered reads: whichever is measured faster now.

    Serial costs read + hash on one thread (R + H).  Split costs about R/2 + H plus a hand-off
    when a core is free, and R + H + a hand-off (a wait for a core) when none is: the machine's
    load decides, so it is measured instead of assumed.  For each class of reads (payload size,
    by its power of two, and how many reads ran at once: 1, 2, 3-4, more) the chooser keeps an
    exponentially weighted mean of wall seconds per byte of each way, uses the faster one, and the
    other one every :attr:`explore_every`-th read so that its estimate follows the load (a loaded
    machine pays the hand-off on one read in 16).  Split is not tried at all while more reads run
    at once than half the usable CPUs (each split read keeps two busy) or on a single CPU.

    One chooser serves the whole process (:data:`CHOOSER`): the load is the machine's.  Updates
    are not locked; a race loses a sample, never a read.
    """

    explore_every = 16
    warmup = 3
    """Samples of each way taken (alternating) before the means decide."""
    weight = 0.25
    """Weight of a new sample in the running mean."""

    def __init__(self, cpus: int | None = None) -> None:
        self.cpus = usable_cpus() if cpus is None else cpus
        self.force: str | None = None
        """``"serial"`` or ``"split"`` to fix the choice (tests, benchmarks); ``None`` to measure."""
        self.running = 0
        self._lock = threading.Lock()
        self._stats: dict[tuple[int, int], list[float]] = {}  # class -> [serial s/B, split s/B, n serial, n split, reads]
        self.splits = 0
        self.serials = 0

    def begin(self, length: int) -> tuple[tuple[int, int], bool]:
        """Start a read of ``length`` payload bytes: (its class, whether to split it)."""
        with self._lock:
            self.running += 1
            running = self.running
        cls = (length.bit_length(), min(running, 3) if running < 5 else 4)
        if self.force is not None:
            return cls, self.force == "split" and length >= ALIGN * 2
        if length < SPLIT_MIN_BYTES or self.cpus < 2 or 2 * running > self.cpus:
            return cls, False
        st = self._stats.setdefault(cls, [0.0, 0.0, 0, 0, 0])
        st[4] += 1
        if st[2] < self.warmup or st[3] < self.warmup:
            return cls, st[3] < st[2]  # alternate until each way has its samples
        faster_split = st[1] < st[0]
        explore = st[4] % self.explore_every == 0
        return cls, faster_split != explore

    def end(self, cls: tuple[int, int], split: bool, length: int, seconds: float) -> None:
        """Record a finished read of ``length`` bytes that took ``seconds``."""
        with self._lock:
            self.running -= 1
            if split:
                self.splits += 1
            else:
                self.serials += 1
        st = self._stats.get(cls)
        if st is None or length <= 0 or self.force is not None:
            return
        i = 1 if split else 0
        per_byte = seconds / length
        st[i] = per_byte if not st[2 + i] else st[i] + self.weight * (per_byte - st[i])
        st[2 + i] += 1

    def split_share(self) -> float:
        """Share of the buffered reads since start that were split (for benchmark notes)."""
        total = self.splits + self.serials
        return self.splits / total if total else 0.0


CHOOSER = ReadChooser()
"""The process's chooser of buffered read strategies."""
