"""Reused byte buffers for the shared tiers' encoded values and reads.

A fresh ``bytearray`` of tens of MiB costs more than the copy it is made for: CPython zeroes it
(``memset``) and every page faults in on first touch.  Measured on this project's 2-core machine,
quiet, one 32 MiB payload (``/tmp``-free microbenchmark in docs/benchmarks.md, "s3 put: encode
buffers"): ``bytearray`` + copy 21 ms, ``numpy.empty`` + copy 7.5 ms, a reused buffer + copy
4.9 ms, the XXH3-128 pass 1.2 ms.  A pool hands out buffers of an exact size and takes them back
once no thread reads them; what it keeps is bounded in bytes (the oldest are dropped first).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import numpy as np


def fresh(size: int) -> memoryview:
    """A new writable buffer of ``size`` bytes, contents undefined (``numpy.empty``: no zeroing pass).

    Returns a one-dimensional ``"B"`` memoryview (obstore, sockets and ``numpy.frombuffer`` take it)."""
    return memoryview(np.empty(size, dtype=np.uint8).data).cast("B")


class BufferPool:
    """Buffers of exact sizes, reused; at most ``max_bytes`` kept idle (thread-safe).

    ``take(size)`` gives an idle buffer of exactly ``size`` bytes or a fresh one (:func:`fresh`, or
    a zeroed ``bytearray`` with ``zeroed=True``); ``give(buffers)`` returns them once nothing reads
    them.  A buffer must be given back at most once, and not used after."""

    def __init__(self, max_bytes: int, zeroed: bool = False) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.zeroed = zeroed
        self._lock = threading.Lock()
        self._idle: deque[bytearray | memoryview] = deque()
        self._idle_bytes = 0
        self.reused = 0
        """Buffers handed out from the idle ones (a count, for tests and benchmarks)."""

    def take(self, size: int) -> bytearray | memoryview:
        with self._lock:
            for i, buffer in enumerate(self._idle):
                if len(buffer) == size:
                    del self._idle[i]
                    self._idle_bytes -= size
                    self.reused += 1
                    return buffer
        return bytearray(size) if self.zeroed else fresh(size)

    def take_many(self, sizes: list[int]) -> list[bytearray | memoryview]:
        return [self.take(size) for size in sizes]

    def give(self, buffers: Sequence[bytearray | memoryview]) -> None:
        with self._lock:
            for buffer in buffers:
                if len(buffer) > self.max_bytes:
                    continue
                self._idle.append(buffer)
                self._idle_bytes += len(buffer)
            while self._idle_bytes > self.max_bytes:
                self._idle_bytes -= len(self._idle.popleft())

    def clear(self) -> None:
        """Drop every idle buffer (the next ``take`` of each size allocates)."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0

    def __len__(self) -> int:
        """Idle buffers kept now."""
        return len(self._idle)

    @property
    def idle_bytes(self) -> int:
        """Bytes of the buffers kept idle now."""
        return self._idle_bytes
