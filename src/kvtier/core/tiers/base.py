"""The tier contract: what :class:`~kvtier.core.store.TieredStore` calls on every tier.

A tier stores chunk bytes under :data:`~kvtier.core.keys.ChunkKey` keys. The store composes an ordered list of
tiers (``cpu`` first, then e.g. ``disk``, ``redis``; see :mod:`kvtier.core.tiers.registry`). Two kinds:

- a **local** tier (``shared = False``: cpu, disk) has a fixed capacity and never evicts on its own: the store
  decides what leaves (with an :class:`~kvtier.core.policies.EvictionPolicy`) and what is pinned;
- a **shared** tier (``shared = True``: redis) is written and read by other hosts too and evicts on its own
  (TTL, the server's ``maxmemory``). The store never evicts it and never asks it synchronously during a
  lookup: its presence answers come from the asynchronous lookup path.

Every tier is thread-safe (the conformance suite runs concurrent callers); the store still serialises its own
metadata and runs data copies outside its lock, on chunks it has pinned.

Operations (none raises on a miss, a fault or bad bytes: those are results):

- ``contains(key)`` / ``contains_many(keys)``: presence; no side effects. ``indexed(key)``: presence as far as
  this process knows without I/O (a local index; may say ``False`` for a key another process wrote).
- ``get_into(key, dst) -> GetResult``: copy the chunk's bytes into ``dst`` (a writable buffer of exactly the
  chunk's expected length; a stored payload of another length is never a hit). ``HIT`` means ``dst`` holds
  verified bytes; ``MISS`` means the key is absent (or the tier could not be reached); ``CORRUPT`` means the
  stored value failed verification; the tier then forgets it and counts it in ``corrupt``. Unverified bytes
  are never reported as a hit. With ``records`` (a dict, :data:`~kvtier.core.tenant.TenantRecords`) the tier
  puts there the tenant record each verified hit carried (a tier that keeps none adds nothing): the record
  comes back with the payload, explicitly, never through thread state.
- ``put(key, data, tenant=None) -> PutResult``: store ``data`` (any buffer) for ``tenant`` (who the chunk is
  written for, :mod:`kvtier.core.tenant`; ``None``: unknown), which a tier that keeps a tenant record (disk,
  redis, s3: the value envelope, :mod:`kvtier.core.envelope`) writes with it. ``PRESENT`` if the key was
  already stored (chunk bytes are immutable under their key, the original is kept), ``NO_ROOM`` if the tier is
  full, ``FAILED`` if the write failed (I/O error, unreachable server).
- Blob verbs (variable length, every tier; :mod:`kvtier.core.tiers.valueread`): ``get(key, records) -> bytes |
  None`` (the whole verified payload, any length, 0 included); ``read_into(key, dst, records) -> int | None``
  (into a buffer of *at least* the payload's length: the length, or ``None``; a buffer too short raises
  :class:`~kvtier.core.tiers.valueread.BufferTooSmall` naming the length, nothing written); ``get_range(key,
  offset, length) -> bytes | None`` (``payload[offset:offset + length]``, clipped at the end: ``b""`` past it;
  ``None``: absent). ``get`` and ``read_into`` verify the whole value: one that fails is ``None``, counted in
  ``corrupt`` and forgotten, never served. ``get_range`` checks the value's header (namespace, key, format, a
  chain that keeps the bytes) and reads only the range: **its bytes are not verified** (no per-range digest
  exists), so it is never used to serve KV. ``put`` takes any length.
- ``delete(key) -> bool``: forget the chunk; ``False`` if it was not there.
- ``keys()``: keys this process knows to be stored, oldest first (a shared tier cannot list the server's keys
  and returns those this process wrote and has not seen vanish).
- ``usage() -> TierUsage``: bytes used/free/capacity and number of chunks (a shared tier counts what this
  process wrote; its capacity is the server's business).
- ``stored_bytes(payload_bytes)``: bytes one chunk takes in the tier (header included).
- ``check()``: assert the tier's own accounting; raises ``AssertionError`` naming what broke.
- ``wire_stats()``: a remote tier's wire numbers (:class:`~kvtier.core.stats.WireStats`), which the store puts
  in its snapshot; ``None`` for a local tier.
- ``close()``: release connections and threads; idempotent.
- ``clear() -> ClearResult``: remove every chunk of the tier's namespace that the tier can reach (a local
  tier: its index and its storage, other processes' files of the namespace included; a shared tier: every key
  of its namespace on the server, never another namespace's); the keys it can name are returned. Never raises
  on a fault: ``ok`` is then ``False``.
- ``get_many`` / ``put_many`` / ``delete_many``: batch forms with per-key results (a remote tier answers a
  batch in one round trip per server).

Results have no truth value (``bool(GetResult.MISS)`` raises ``TypeError``): a miss and a
corrupt value are told apart by every caller.

Tiers that stage writes in place (the cpu tier) implement :class:`StagingTier`: ``reserve(key) -> Reservation
| NoRoom | AlreadyHeld`` hands out space that ``contains`` does not report yet, ``commit(key)``
(``commit_many(keys)``) publishes it, ``abort(key)`` gives it back; ``view(key)`` is a zero-copy view of a
resident chunk, valid while the store holds it pinned.

Optional capabilities are typed protocols, checked with ``isinstance`` (never ``getattr``) and declared in the
tier's registry record (:attr:`~kvtier.core.tiers.registry.TierSpec.capabilities`, checked by the conformance
suite): :class:`Rescannable` (takes in other processes' chunks in an explicit rescan), :class:`Generational`
(may lose its whole contents, and says so by a new generation), :class:`ExactUsage` (its byte count may exceed
its capacity until trimmed), :class:`Paged` (a fixed number of equal pages), :class:`RegistersMemory`
(registers the host memory it reads into and writes from for GPU copies: the cpu tier's page pool).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import numpy as np

from kvtier.core.keys import ChunkKey
from kvtier.core.stats import WireStats
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.valueread import BufferTooSmall

__all__ = ["AlreadyHeld", "BufferTooSmall", "ClearResult", "ExactUsage", "Generational", "GetResult", "NoRoom",
           "Paged", "PutResult", "RegistersMemory", "Rescannable", "Reservation", "ReserveResult", "StagingTier",
           "Tier", "TierUsage", "capabilities", "writers"]

if TYPE_CHECKING:
    from kvtier.core.tiers.disk.scan import RescanResult


class GetResult(enum.Enum):
    """Outcome of one read.  No truth value: callers tell ``MISS`` from ``CORRUPT`` explicitly."""

    HIT = "hit"
    MISS = "miss"
    CORRUPT = "corrupt"

    def __bool__(self) -> bool:
        raise TypeError("a GetResult has no truth value; compare with GetResult.HIT (a MISS and a CORRUPT differ)")


class PutResult(enum.Enum):
    """Outcome of one write.  No truth value: use :attr:`stored` or compare members."""

    STORED = "stored"
    PRESENT = "present"
    NO_ROOM = "no_room"
    FAILED = "failed"

    @property
    def stored(self) -> bool:
        """The key is stored afterwards (``STORED`` or ``PRESENT``)."""
        return self in (PutResult.STORED, PutResult.PRESENT)

    def __bool__(self) -> bool:
        raise TypeError("a PutResult has no truth value; use .stored or compare with a member")


@dataclass(frozen=True, slots=True)
class Reservation:
    """Space :meth:`StagingTier.reserve` handed out: ``buffer`` is a writable uint8 array of the
    chunk's bytes, invisible to ``contains`` until ``commit``."""

    buffer: np.ndarray


class NoRoom(enum.Enum):
    """:meth:`StagingTier.reserve` found no free space."""

    NO_ROOM = "no_room"


class AlreadyHeld(enum.Enum):
    """:meth:`StagingTier.reserve` found the key stored or reserved already."""

    ALREADY_HELD = "already_held"


ReserveResult = Reservation | NoRoom | AlreadyHeld
"""Outcome of :meth:`StagingTier.reserve`: match on the type (no truth value on the enums)."""


class ClearResult(NamedTuple):
    """What :meth:`Tier.clear` removed.

    Attributes:
        keys: the removed chunks the tier can name (a chunk being written when the clear ran may
            land afterwards: the store deletes it then, :mod:`kvtier.core.mover`).
        ok: ``False`` when something could not be removed (an I/O error, an unreachable server).
        reason: why not, one phrase for a log line (empty when ``ok``).
    """

    keys: list[ChunkKey]
    ok: bool = True
    reason: str = ""


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
    def get_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> GetResult:
        """Copy the chunk into ``dst``; see the module docstring for the results and ``records``."""

    @abstractmethod
    def put(self, key: ChunkKey, data: memoryview | bytes, tenant: Writer | None = None) -> PutResult:
        """Store ``data`` under ``key`` for ``tenant``; see the module docstring for the results."""

    @abstractmethod
    def get(self, key: ChunkKey, records: TenantRecords | None = None) -> bytes | None:
        """The verified payload of ``key`` (any length), or ``None`` (absent, unreachable, or
        failing verification: counted in ``corrupt`` and forgotten).  ``records`` as ``get_into``."""

    @abstractmethod
    def read_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> int | None:
        """Put the verified payload of ``key`` in ``dst[:length]`` and return ``length``; ``None``
        as :meth:`get` (``dst`` may then hold unverified bytes).

        Raises:
            BufferTooSmall: ``dst`` is shorter than the payload (nothing written;
                :attr:`~kvtier.core.tiers.valueread.BufferTooSmall.value_bytes` says how long).
        """

    @abstractmethod
    def get_range(self, key: ChunkKey, offset: int, length: int) -> bytes | None:
        """``payload[offset:offset + length]`` of ``key``, clipped at the payload's end (``b""``
        past it), ``None`` if absent or its header fails its check.  The bytes are NOT verified
        (see the module docstring): never serve KV from them.

        Raises:
            ValueError: a negative ``offset`` or ``length``.
        """

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

    def clear(self) -> ClearResult:
        """Remove every chunk of the tier's namespace it can reach (see the module docstring).
        This default deletes the keys this process knows (:meth:`keys`)."""
        keys = self.keys()
        self.delete_many(keys)
        return ClearResult(keys)

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Batch form of :meth:`contains`."""
        return [self.contains(k) for k in keys]

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview],
                 records: TenantRecords | None = None) -> list[GetResult]:
        """Batch form of :meth:`get_into`; ``dsts[i]`` receives ``keys[i]``."""
        return [self.get_into(k, d, records) for k, d in zip(keys, dsts, strict=True)]

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                 tenants: Sequence[Writer | None] | None = None) -> list[PutResult]:
        """Batch form of :meth:`put`; ``tenants[i]`` is who ``datas[i]`` is written for."""
        return [self.put(k, d, t) for k, d, t in zip(keys, datas, writers(tenants, len(keys)), strict=True)]

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Batch form of :meth:`delete`."""
        return [self.delete(k) for k in keys]


def writers(tenants: Sequence[Writer | None] | None, count: int) -> Sequence[Writer | None]:
    """``tenants``, or ``count`` unknown tenants (``None``) when not given.

    Raises:
        ValueError: ``tenants`` is not ``count`` long.
    """
    if tenants is None:
        return [None] * count
    if len(tenants) != count:
        raise ValueError(f"{len(tenants)} tenants for {count} chunks")
    return tenants


class StagingTier(Tier):
    """A tier that stages writes in place (two-phase) and hands out zero-copy views."""

    @abstractmethod
    def can_reserve(self) -> bool:
        """Whether :meth:`reserve` would find room now."""

    @abstractmethod
    def reserve(self, key: ChunkKey) -> ReserveResult:
        """A :class:`Reservation` (a writable uint8 buffer for ``key``, invisible to ``contains`` until :meth:`commit`);
        ``AlreadyHeld.ALREADY_HELD`` if ``key`` is present or reserved; else ``NoRoom.NO_ROOM`` if no space is free."""

    @abstractmethod
    def commit(self, key: ChunkKey) -> None:
        """Publish a reserved chunk.  Raises ``KeyError`` if ``key`` was not reserved."""

    @abstractmethod
    def commit_many(self, keys: Sequence[ChunkKey]) -> None:
        """:meth:`commit` of each of ``keys``, in one call (a load's promoted chunks)."""

    @abstractmethod
    def reserve_many(self, keys: Sequence[ChunkKey]) -> list[ReserveResult]:
        """:meth:`reserve` of each of ``keys``, in order, in one call (a load's promotions)."""

    @abstractmethod
    def abort(self, key: ChunkKey) -> None:
        """Give a reservation back; unknown keys are ignored."""

    @abstractmethod
    def view(self, key: ChunkKey) -> np.ndarray:
        """Zero-copy uint8 view of a resident chunk.  Raises ``KeyError`` if absent."""

    def pin_host_memory(self) -> bool:
        """Make the pages pinned host memory for direct GPU copies (:mod:`kvtier.core.pinned`); whether they are (default False)."""
        return False


@runtime_checkable
class Rescannable(Protocol):
    """A tier other processes write behind its back (a shared directory): :meth:`scan` finds
    their chunks without locks, :meth:`adopt` takes them into the index (capability
    ``rescannable``)."""

    def scan(self) -> RescanResult:
        """Find chunks written or removed by other processes; no index change."""

    def adopt(self, result: RescanResult) -> RescanResult:
        """Index what :meth:`scan` found; fills ``result.adopted`` / ``result.gone``."""


@runtime_checkable
class Generational(Protocol):
    """A tier that may lose its whole contents (a recreated directory) and then bumps
    :attr:`generation` (capability ``generational``)."""

    generation: int


@runtime_checkable
class ExactUsage(Protocol):
    """A tier whose bytes held may exceed its capacity until the store trims it (capability
    ``exact_usage``); :meth:`usage_exact` is that byte count (``usage()`` clamps it)."""

    def usage_exact(self) -> int:
        """Bytes held, unclamped."""


@runtime_checkable
class Paged(Protocol):
    """A tier of ``num_pages`` equal pages (capability ``paged``)."""

    num_pages: int


@runtime_checkable
class RegistersMemory(Protocol):
    """A tier that registers buffer regions it reads into and writes from (capability
    ``registers_memory``), so a GPU copies straight to and from them: host memory is pinned
    (``cudaHostRegister``, :mod:`kvtier.core.pinned`).  The cpu tier registers its page pool
    (:meth:`StagingTier.pin_host_memory`) and any host buffer a read lands in (issue 37)."""

    def register_memory(self, region: np.ndarray) -> str | None:
        """Register ``region`` (a contiguous uint8 array that stays alive while registered);
        ``None`` once registered (or already), else one sentence saying why not."""

    def unregister_memory(self, region: np.ndarray) -> bool:
        """Unregister ``region``; ``False`` if it was not registered by this tier."""

    def registered_memory(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each region this tier registered, in registration order."""


@runtime_checkable
class AnswersNow(Protocol):
    """A shared tier that can say which chunks it holds on the caller's thread, without I/O or a
    wait (capability ``answers_now``): the node tier reads its pool's presence table.  The
    scheduler's lookups take this first and ask on their own threads only when it returns ``None``."""

    def contains_now(self, keys: Sequence[ChunkKey]) -> list[bool] | None:
        """One flag per key, in order; ``None`` when only a round trip can answer."""


CAPABILITY_PROTOCOLS: dict[str, type] = {"rescannable": Rescannable, "generational": Generational,
                                         "exact_usage": ExactUsage, "paged": Paged, "staging": StagingTier,
                                         "registers_memory": RegistersMemory, "answers_now": AnswersNow}
"""Capability name (:attr:`~kvtier.core.tiers.registry.TierSpec.capabilities`) -> protocol or base class."""


def capabilities(tier: object) -> frozenset[str]:
    """Names of the capabilities ``tier`` implements (for the conformance suite and wrappers)."""
    return frozenset(name for name, proto in CAPABILITY_PROTOCOLS.items() if isinstance(tier, proto))
