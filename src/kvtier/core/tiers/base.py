"""The tier contract: what :class:`~kvtier.core.store.TieredStore` calls on every tier.

A tier stores chunk bytes under :data:`~kvtier.core.keys.ChunkKey` keys.  The store composes an
ordered list of tiers (``cpu`` first, then e.g. ``disk``, ``redis``; see
:mod:`kvtier.core.tiers.registry`).  Two kinds:

- a **local** tier (``shared = False``: cpu, disk) has a fixed capacity and never evicts on its
  own: the store decides what leaves (with an :class:`~kvtier.core.policies.EvictionPolicy`) and
  what is pinned;
- a **shared** tier (``shared = True``: redis) is written and read by other hosts too and evicts
  on its own (TTL, the server's ``maxmemory``).  The store never evicts it and never asks it
  synchronously during a lookup: its presence answers come from the asynchronous lookup path.

Every tier is thread-safe (the conformance suite runs concurrent callers); the store still
serialises its own metadata and runs data copies outside its lock, on chunks it has pinned.

Operations (none raises on a miss, a fault or bad bytes: those are results):

- ``contains(key)`` / ``contains_many(keys)``: presence; no side effects.  ``indexed(key)``:
  presence as far as this process knows without I/O (a local index; may say ``False`` for a key
  another process wrote).
- ``get_into(key, dst) -> GetResult``: copy the chunk's bytes into ``dst`` (a writable buffer of
  exactly the chunk's expected length; a stored payload of another length is never a hit).  ``HIT`` means ``dst`` holds verified bytes; ``MISS`` means the
  key is absent (or the tier could not be reached); ``CORRUPT`` means the stored value failed
  verification; the tier then forgets it and counts it in ``corrupt``.  Unverified bytes are
  never reported as a hit.
- ``put(key, data) -> PutResult``: store ``data`` (any buffer).  ``PRESENT`` if the key was
  already stored (chunk bytes are immutable under their key, the original is kept), ``NO_ROOM``
  if the tier is full, ``FAILED`` if the write failed (I/O error, unreachable server).
- ``delete(key) -> bool``: forget the chunk; ``False`` if it was not there.
- ``keys()``: keys this process knows to be stored, oldest first (a shared tier cannot list the
  server's keys and returns those this process wrote and has not seen vanish).
- ``usage() -> TierUsage``: bytes used/free/capacity and number of chunks (a shared tier counts
  what this process wrote; its capacity is the server's business).
- ``stored_bytes(payload_bytes)``: bytes one chunk takes in the tier (header included).
- ``check()``: assert the tier's own accounting; raises ``AssertionError`` naming what broke.
- ``wire_stats()``: a remote tier's wire numbers (:class:`~kvtier.core.stats.WireStats`), which
  the store puts in its snapshot; ``None`` for a local tier.
- ``close()``: release connections and threads; idempotent.
- ``get_many`` / ``put_many`` / ``delete_many``: batch forms with per-key results (a remote tier
  answers a batch in one round trip per server).

Tiers that stage writes in place (the cpu tier) implement :class:`StagingTier`:
``reserve(key) -> buffer | None`` hands out space that ``contains`` does not report yet,
``commit(key)`` publishes it, ``abort(key)`` gives it back; ``view(key)`` is a zero-copy view of
a resident chunk, valid while the store holds it pinned.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvtier.core.keys import ChunkKey
from kvtier.core.stats import WireStats


class GetResult(enum.Enum):
    """Outcome of one read.  Truthy only for ``HIT``."""

    HIT = "hit"
    MISS = "miss"
    CORRUPT = "corrupt"

    def __bool__(self) -> bool:
        return self is GetResult.HIT


class PutResult(enum.Enum):
    """Outcome of one write.  Truthy when the key is stored afterwards (``STORED``, ``PRESENT``)."""

    STORED = "stored"
    PRESENT = "present"
    NO_ROOM = "no_room"
    FAILED = "failed"

    def __bool__(self) -> bool:
        return self in (PutResult.STORED, PutResult.PRESENT)


class TierUsage(NamedTuple):
    """Occupancy of one tier, in bytes (``used + free == capacity``) and chunks."""

    used_bytes: int
    free_bytes: int
    capacity_bytes: int
    num_chunks: int


class Tier(ABC):
    """Base class of storage tiers; see the module docstring."""

    name: str = "abstract"
    shared: bool = False
    """True for a tier other hosts write and that evicts on its own (see the module docstring)."""

    def __init__(self) -> None:
        self.corrupt = 0  # values that failed verification (each also a CORRUPT result)
        self.write_errors = 0  # chunk writes that failed in the tier's storage (a full or read-only disk...)

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Whether ``key`` is stored (no side effects)."""

    @abstractmethod
    def get_into(self, key: ChunkKey, dst: memoryview) -> GetResult:
        """Copy the chunk into ``dst``; see the module docstring for the results."""

    @abstractmethod
    def put(self, key: ChunkKey, data: memoryview | bytes) -> PutResult:
        """Store ``data`` under ``key``; see the module docstring for the results."""

    @abstractmethod
    def delete(self, key: ChunkKey) -> bool:
        """Forget ``key``; ``False`` if absent."""

    @abstractmethod
    def keys(self) -> list[ChunkKey]:
        """Keys this process knows to be stored, oldest first."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """Bytes used, free and capacity; number of chunks."""

    @abstractmethod
    def check(self) -> None:
        """Assert the tier's accounting.  Raises ``AssertionError`` naming the broken invariant."""

    def indexed(self, key: ChunkKey) -> bool:
        """Whether this process knows ``key`` is stored, without I/O."""
        return self.contains(key)

    def stored_bytes(self, payload_bytes: int) -> int:
        """Bytes one chunk of ``payload_bytes`` takes in this tier."""
        return payload_bytes

    def wire_stats(self) -> WireStats | None:
        """What a remote tier did on the wire (lookups, bytes, faults, breaker); ``None`` for a local tier."""
        return None

    def close(self) -> None:
        """Release connections and threads.  Idempotent."""

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Batch form of :meth:`contains`."""
        return [self.contains(k) for k in keys]

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview]) -> list[GetResult]:
        """Batch form of :meth:`get_into`; ``dsts[i]`` receives ``keys[i]``."""
        return [self.get_into(k, d) for k, d in zip(keys, dsts, strict=True)]

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes]) -> list[PutResult]:
        """Batch form of :meth:`put`."""
        return [self.put(k, d) for k, d in zip(keys, datas, strict=True)]

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Batch form of :meth:`delete`."""
        return [self.delete(k) for k in keys]


class StagingTier(Tier):
    """A tier that stages writes in place (two-phase) and hands out zero-copy views."""

    @abstractmethod
    def can_reserve(self) -> bool:
        """Whether :meth:`reserve` would find room now."""

    @abstractmethod
    def reserve(self, key: ChunkKey) -> np.ndarray | None:
        """A writable uint8 buffer for ``key``, invisible to ``contains`` until :meth:`commit`;
        ``None`` if there is no room or ``key`` is already present or reserved."""

    @abstractmethod
    def commit(self, key: ChunkKey) -> None:
        """Publish a reserved chunk.  Raises ``KeyError`` if ``key`` was not reserved."""

    @abstractmethod
    def abort(self, key: ChunkKey) -> None:
        """Give a reservation back; unknown keys are ignored."""

    @abstractmethod
    def view(self, key: ChunkKey) -> np.ndarray:
        """Zero-copy uint8 view of a resident chunk.  Raises ``KeyError`` if absent."""
