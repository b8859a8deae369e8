"""The node pool's presence table: which values the pool holds, in the pool's own shared memory, so an
engine's scheduler answers a lookup by reading it (no message to the owner, no other process or
thread to wake).

Why (issue 38, the fleet day): a lookup over the owner's socket wakes five threads or processes in
turn (the scheduler's lookup thread, the tier's call thread, the owner, the call thread again, the
lookup thread again).  On EPYC-2 (2 vCPUs) with five CPU-bound processes, a process sleeping 20 ms
was woken up to 320 ms late at p99 and 864 ms at worst (kernel 6.18), so lookups whose owner
answered within 0.1 ms passed ``shared_deadline_s`` (0.25 s): ``scripts/node_lookup_latency.py``
and docs/node.md ("Lookups") have the figures.  Read here, a lookup is a few array reads on the
caller's thread.

Layout (:mod:`~kvtier.core.tiers.node.pool`): ``slots``, a uint64 array of a power-of-two length at
least four times the pool's pages, open addressing with linear probing; a slot holds 0 (empty), 1
(a removed value's) or the 64-bit fingerprint of a committed value's (namespace, key)
(:func:`fingerprint`, XXH3-64, never 0 or 1).  ``meta``: ``[heartbeat, sequence]``, two uint64
words of the pool's header.

- **Only the owner writes** (:class:`PresenceTable`, from :class:`~kvtier.core.tiers.node.index.PoolIndex`):
  a commit inserts the value's fingerprint, a delete or eviction marks its slot removed; once more
  than half the slots are used it rebuilds the table with ``sequence`` odd meanwhile.  Each change
  is one aligned 8-byte store.
- **The owner beats**: it writes ``time.monotonic_ns()`` (``CLOCK_MONOTONIC``, one clock for every
  process of the host) into ``heartbeat`` every :data:`HEARTBEAT_S`, and 0 when it stops.
- **A reader** (:func:`lookup`) answers only while the heartbeat is younger than :data:`STALE_S`
  and ``sequence`` is even and the same before and after its probes; otherwise ``None`` and the
  caller asks the owner over its socket (as before).  An answer is a hint, like every shared-tier
  lookup: the load pins and verifies each value, and a value gone since is a shorter load (vLLM
  recomputes the rest).  A false "absent" costs a hit; a false "present" (a 64-bit fingerprint
  collision, or a value evicted while the answer travels) costs a load that ends short.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

EMPTY = 0
REMOVED = 1
HEARTBEAT, SEQUENCE = 0, 1
META_WORDS = 2
HEARTBEAT_S = 0.1
"""How often the owner writes its heartbeat, seconds."""
STALE_S = 2.0
"""A heartbeat older than this: the owner is dead or stalled, the table is not read, seconds.  Above
the 0.86 s a sleeping process was woken late at worst on EPYC-2 under five CPU-bound processes
(module docstring), so an owner that is only slow to be scheduled does not lose its table; an
owner that died or stopped answers lookups from its last table for at most this long (each a load
that then fails over the socket: recomputed)."""
MAX_PROBES = 64
"""Probes a reader makes per key before it gives up (then: ``None``); at most a quarter of the slots
hold live values and a rebuild comes at half, so a probe run is a few slots long."""


def table_slots(num_pages: int) -> int:
    """Slots of the table of a pool of ``num_pages`` pages: a power of two, at least 4 per page."""
    return max(8, 1 << (4 * num_pages - 1).bit_length())


def fingerprint(namespace: bytes, key: bytes) -> int:
    """The 64-bit fingerprint of a value's (namespace, chunk key): XXH3-64 of both, never 0 or 1."""
    fp = xxhash.xxh3_64_intdigest(namespace + key)
    return fp if fp > REMOVED else fp + 2


class PresenceTable:
    """The owner's writer of the table (see the module docstring); not thread-safe (the owner's
    event loop alone calls it)."""

    def __init__(self, slots: np.ndarray, meta: np.ndarray) -> None:
        self.slots, self.meta = slots, meta
        self.mask = len(slots) - 1
        self.taken = 0  # slots not EMPTY (live and removed)
        self.rebuilds = 0

    def insert(self, fp: int) -> int:
        """Put ``fp`` in the table; its slot.  Past half the slots used, the caller rebuilds
        (:meth:`full`)."""
        i = fp & self.mask
        while True:
            held = int(self.slots[i])
            if held <= REMOVED:
                self.taken += held == EMPTY
                self.slots[i] = fp
                return i
            i = (i + 1) & self.mask

    def remove(self, slot: int) -> None:
        """Mark ``slot`` (an :meth:`insert`'s) removed."""
        self.slots[slot] = REMOVED

    def full(self) -> bool:
        """Whether more than half the slots are used (live or removed): time to :meth:`rebuild`."""
        return 2 * self.taken > len(self.slots)

    def rebuild(self, fps: Iterable[int]) -> list[int]:
        """Empty the table and insert ``fps`` again (readers wait it out: ``sequence`` is odd
        meanwhile); their new slots, in order."""
        seq = int(self.meta[SEQUENCE])
        self.meta[SEQUENCE] = seq | 1  # odd: readers do not trust the table
        self.slots[:] = EMPTY
        self.taken = 0
        out = [self.insert(fp) for fp in fps]
        self.meta[SEQUENCE] = (seq | 1) + 1
        self.rebuilds += 1
        return out

    def beat(self, now_ns: int | None = None) -> None:
        """Write the heartbeat (``time.monotonic_ns()`` unless given; 0: the owner has stopped)."""
        self.meta[HEARTBEAT] = time.monotonic_ns() if now_ns is None else now_ns

    def problem(self, live: dict[int, int]) -> str:
        """``""`` if the table holds exactly ``live`` (slot -> fingerprint), else what differs."""
        used = np.flatnonzero(self.slots > REMOVED)
        if len(used) != len(live) or any(int(self.slots[s]) != fp for s, fp in live.items()):
            return "the presence table differs from the values"
        if int(self.meta[SEQUENCE]) & 1:
            return "the presence table is marked as being rebuilt"
        return ""


def lookup(slots: np.ndarray, meta: np.ndarray, namespace: bytes, keys: Sequence[bytes]) -> list[bool] | None:
    """Which of ``keys`` the table says the pool holds under ``namespace``; ``None`` when it cannot
    be trusted now (no fresh heartbeat, a rebuild under way, a probe run over :data:`MAX_PROBES`):
    ask the owner instead."""
    beat = int(meta[HEARTBEAT])
    if beat == 0 or time.monotonic_ns() - beat > STALE_S * 1e9:
        return None
    seq = int(meta[SEQUENCE])
    if seq & 1:
        return None
    fps = np.fromiter((fingerprint(namespace, bytes(k)) for k in keys), dtype=np.uint64, count=len(keys))
    mask = np.uint64(len(slots) - 1)
    pos = fps & mask
    found = np.zeros(len(keys), dtype=bool)
    active = np.arange(len(keys))
    for _ in range(MAX_PROBES):
        held = slots[pos[active]]
        hit = held == fps[active]
        found[active[hit]] = True
        active = active[~hit & (held != EMPTY)]
        if not len(active):
            break
        pos[active] = (pos[active] + np.uint64(1)) & mask
    else:
        return None
    if int(meta[SEQUENCE]) != seq:
        return None
    return found.tolist()
