"""The tier contract.

A tier stores chunk bytes under :data:`~kvtier.core.keys.ChunkKey` keys within a fixed capacity.
It never evicts on its own: :class:`~kvtier.core.store.TieredStore` decides what to evict (with an
:class:`~kvtier.core.policies.EvictionPolicy`) and what is pinned.  A tier is not thread-safe by
itself unless it says so; the store serialises metadata calls and lets data copies run outside
its lock only on chunks it has pinned.

Operations:

- ``contains(key)`` / ``contains_many(keys)``: presence, no side effects.
- ``get_into(key, dst) -> bool``: copy the chunk's bytes into ``dst`` (a writable buffer of at
  least the chunk's length); ``False`` on a miss **or** a chunk that fails verification (which
  the tier then forgets and counts).  Never returns unverified bytes.
- ``put(key, data) -> bool``: store ``data`` (any buffer); ``False`` if there is no room.  A key
  already present is left as it is (chunk bytes are immutable under their key) and ``True`` is returned.
- ``delete(key) -> bool``: forget the chunk; ``False`` if it was not there.
- ``usage() -> TierUsage``: bytes used/free/capacity and number of chunks.
- ``get_many`` / ``put_many`` / ``delete_many``: batch forms with per-key results.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from kvtier.core.keys import ChunkKey


class TierUsage(NamedTuple):
    """Occupancy of one tier, in bytes (``used + free == capacity``) and chunks."""

    used_bytes: int
    free_bytes: int
    capacity_bytes: int
    num_chunks: int


class Tier(ABC):
    """Base class of storage tiers; see the module docstring."""

    name: str = "abstract"

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Whether ``key`` is stored (no side effects)."""

    @abstractmethod
    def get_into(self, key: ChunkKey, dst: memoryview) -> bool:
        """Copy the chunk into ``dst``; ``False`` on a miss or failed verification."""

    @abstractmethod
    def put(self, key: ChunkKey, data: memoryview | bytes) -> bool:
        """Store ``data`` under ``key``; ``False`` if there is no room."""

    @abstractmethod
    def delete(self, key: ChunkKey) -> bool:
        """Forget ``key``; ``False`` if absent."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """Bytes used, free and capacity; number of chunks."""

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Batch form of :meth:`contains`."""
        return [self.contains(k) for k in keys]

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview]) -> list[bool]:
        """Batch form of :meth:`get_into`; ``dsts[i]`` receives ``keys[i]``."""
        return [self.get_into(k, d) for k, d in zip(keys, dsts, strict=True)]

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes]) -> list[bool]:
        """Batch form of :meth:`put`."""
        return [self.put(k, d) for k, d in zip(keys, datas, strict=True)]

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Batch form of :meth:`delete`."""
        return [self.delete(k) for k in keys]
