"""Early copies: a node-tier read starts copying while its pin is in flight (issue 38's load ≤ 1.2×).

A read pins its values (one round trip to the owner: ~1 ms on 2 busy CPUs, the owner woken on the
other core) and copies them only once the pin's answer says where they lie.  An engine that pinned
or wrote a value before knows where it lay then (:class:`Locations`: first page, value bytes,
generation), so the read copies and verifies those values into their destinations while the answer
is on its way (:func:`copy_early`, on the caller's thread after the pin is sent), and the answer
then confirms or refuses each early copy (:meth:`~kvtier.core.tiers.node.tier.NodeTier.finish_get`)::

    send pin ──> build the scatters ──> copy + verify each value at its last known place ──> read the answer
                                                                                               │
                    served: the answer names the same (page, bytes, generation) <──────────────┘
                    and the batch's generation check, after every copy, finds it on its pages;
                    else: copied again from where the answer says, as a read without early copies

Why an early copy that the answer confirms is exactly the bytes a pinned copy would have served:
generations only grow (every allocation takes a new one, a restarted owner continues above the
pool's highest), so pages that carry generation ``g`` after the copy (the batch's one check in
``finish_get``, after every copy, early or not, as for a pinned copy) carried ``g`` all through
it: one allocation's pages, whose value was committed before this engine learnt its place (a pin
names committed values only; this engine's own write is noted after its commit) and which no
writer touches until the pages are granted again (a new generation).  The digest is checked over
the copy as always (what is verified is what is served), and the pin still takes its lease,
touches the value's recency and is released as before: the owner's view of reads is unchanged.
An early copy the answer does not confirm (the value moved, was evicted, the owner is gone) is
never served: its destination is written again, or the key is a miss.  The copies take at most
half of what is left of the read's deadline when they start (the rest is the answer's).

Only values this engine pinned or wrote on the pool it maps now are copied early (a value another
engine wrote is first read the ordinary way); :data:`LOCATIONS_MAX` bounds what is remembered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvtier.core.errors import ChunkFormatError
from kvtier.core.tiers.node.pool import Pool
from kvtier.core.tiers.node.readcopy import Scatter, Verifier, settle

LOCATIONS_MAX = 1 << 15
"""Most values whose place an engine remembers, the oldest noted forgotten first (~240 bytes each:
~8 MB at most; a 4,000-token prompt of 128-token chunks is 31)."""

Where = tuple[int, int, int]
"""A value's first page, its bytes (header included) and its pages' generation."""


class Early(NamedTuple):
    """A value copied early: where it was copied from, on which pool, and what the copy gave (the
    value's tenant record, or why it is unusable)."""

    pool: Pool
    where: Where
    got: bytes | None | ChunkFormatError


class Locations:
    """Where this engine last saw each value (pinned or written), on one mapped pool; thread-safe."""

    def __init__(self, max_entries: int = LOCATIONS_MAX) -> None:
        self.max_entries = max_entries
        self._where: dict[bytes, Where] = {}
        self._pool: Pool | None = None
        self._lock = threading.Lock()

    def note(self, pool: Pool, seen: Iterable[tuple[bytes, Where | None]]) -> None:
        """Remember each ``(key, where)`` on ``pool`` (``None``: the value is not there: forgotten);
        a pool other than the one noted before forgets everything first."""
        with self._lock:
            if pool is not self._pool:
                self._where.clear()
                self._pool = pool
            where_of = self._where
            for key, where in seen:
                where_of.pop(key, None)  # (re)inserted last: the oldest noted is dropped first
                if where is not None:
                    where_of[key] = where
            while len(where_of) > self.max_entries:
                del where_of[next(iter(where_of))]

    def forget(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._where.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._where.clear()
            self._pool = None

    def lookup(self, pool: Pool, keys: Sequence[bytes]) -> list[Where | None]:
        """Where each of ``keys`` was last seen on ``pool`` (``None``: unknown there)."""
        with self._lock:
            if pool is not self._pool:
                return [None] * len(keys)
            get = self._where.get
            return [get(k) for k in keys]

    def __len__(self) -> int:
        return len(self._where)


def copy_early(verifier: Verifier, locations: Locations, pool: Pool, keys: Sequence[bytes],
               dsts: Sequence[memoryview | Scatter], until: float) -> dict[int, Early]:
    """Copy and verify (inline) each key (a pool name, :mod:`~kvtier.core.tiers.node.names`) whose place ``locations`` knows on ``pool`` into its
    destination, in order, until ``time.perf_counter()`` passes ``until``; per key index copied,
    its :class:`Early` (whether the value's pages carry its generation is the caller's check, once
    for the batch after every copy: generations only grow, so pages that carry it after the copy
    carried it before and all through it; no check per value before the copy, which only saved the
    copy of a value moved since, a rare case the answer redoes anyway).  Never raises: a
    destination that cannot take the value is left to the ordinary copy."""
    out: dict[int, Early] = {}
    data, page_bytes, copy = memoryview(pool.data), pool.page_bytes, verifier.copy  # type: ignore[arg-type]
    try:
        for i, where in enumerate(locations.lookup(pool, [bytes(k) for k in keys])):
            if where is None or i >= len(dsts):
                continue
            if time.perf_counter() > until:
                break
            at = where[0] * page_bytes
            nbytes = where[1]
            got: bytes | None | ChunkFormatError
            try:
                got = settle(copy(keys[i], data[at:at + nbytes], dsts[i], False))  # (inline: never pending)
            except ChunkFormatError as exc:
                got = exc
            except ValueError:
                continue  # a scatter that cannot be built: the ordinary copy reports it
            out[i] = Early(pool, where, got)  # its pages' generation: checked after every copy (finish_get)
    finally:
        del data
    return out
