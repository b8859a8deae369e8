"""The split data path of a remote tier behind :class:`~kvtier.core.tiers.guarded.GuardedTier`.

One optional protocol, :class:`SplitTier`, lets a remote tier keep its own data path behind the
wrapper, with no copy of a payload beyond the one each direction needs (the redis and s3 tiers
implement it; a new remote tier implements it too, or gets the wrapper's private copies).  Each
direction splits into a wire half on the wrapper's threads (under the deadline and the breaker)
and a half on the caller's thread:

- **Reads**: ``fetch_many`` (wrapper's threads) receives the values into buffers the tier owns,
  never a caller's: reused ones (redis) or new ones per call (s3); a late fetch lands in nobody's
  buffer.  ``finish_get`` (caller's thread, only after the fetch returned in time) verifies each
  value and copies its payload into the caller's buffer: the one copy a read needs.  It touches
  no network; the wrapper then deletes every ``CORRUPT`` key through its own guarded
  ``delete_many``.  A tier's ``while_fetching(dsts)``, if any, runs on the caller's thread meanwhile.
  A tier that bounds its own waits (:class:`BoundsItself`) fetches on the caller's thread.
- **Writes**: ``stream_put`` returns a :class:`PutStream`: ``send`` on the wrapper's threads while
  ``produce`` (digests, or whole encoded values) runs on the caller's thread, then ``abandon``
  once the caller stops waiting, so a write given up at the deadline stops before its next
  chunk.  What ``send`` may read of the caller's buffers after ``put_many`` returned is the
  tier's guarantee: either nothing (the s3 tier's ``produce`` encodes header + payload, the one
  copy a write needs) or payloads whose digests ``produce`` already took, so a payload changed
  after the deadline is stored as a value that fails verification (a miss), never served (the
  redis tier sends payloads straight from the caller's memory).

The protocol is used only on a tier given directly, never through another wrapper (a
:class:`~kvtier.core.tiers.wrappers.TierWrapper` forwards attributes, and a method reached that
way would bypass the wrapper in between).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvtier.core.keys import ChunkKey
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.base import GetResult, PutResult


class WriteAbandoned(Exception):
    """A :class:`PutStream`'s ``send`` stopped: the caller abandoned the write, or ``produce`` did
    not deliver the next chunk in time (a fault of that call, nothing more)."""


@dataclass
class PutStream:
    """One write of a :class:`SplitTier`.

    Attributes:
        send: puts every chunk (on the wrapper's threads); raises on a fault, and
            :class:`WriteAbandoned` once ``abandon`` was called or ``produce`` fell behind.
        produce: given the ``time.perf_counter()`` at which the call's deadline passes, prepares
            what ``send`` consumes (on the caller's thread, while ``send`` runs); any wait in it
            ends by that time.
        abandon: the caller stopped waiting (returned, in time or not): a ``send`` still running
            stops before its next chunk.  Always called, once.
    """

    send: Callable[[], list[PutResult]]
    produce: Callable[[float], None]
    abandon: Callable[[], None]


@runtime_checkable
class SplitTier(Protocol):
    """A remote tier whose reads and writes split into a wire half (the wrapper's threads) and a half on
    the caller's thread, so :class:`GuardedTier` needs no private copies (see the module docstring).  The
    redis, s3 and node tiers implement it; each method raises on a fault, as their ``get_many``/``put_many`` do."""

    def fetch_many(self, keys: Sequence[ChunkKey]) -> Any:
        """Fetch the values of ``keys`` into buffers the tier owns (never a caller's); an opaque
        result for :meth:`finish_get`.  Runs on the wrapper's threads."""

    def finish_get(self, keys: Sequence[ChunkKey], fetched: Any, dsts: Sequence[memoryview],
                   records: TenantRecords | None = None) -> list[GetResult]:
        """Verify what :meth:`fetch_many` returned in time and copy each payload into ``dsts[i]``
        (``MISS``: absent; ``CORRUPT``: failed verification, counted and forgotten), each verified
        value's tenant record into ``records``.  Runs on the caller's thread and touches no
        network: the wrapper deletes every ``CORRUPT`` key afterwards (a guarded ``delete_many``)."""

    def stream_put(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                   tenants: Sequence[Writer | None] | None = None) -> PutStream:
        """The stream that writes ``datas[i]`` under ``keys[i]`` for ``tenants[i]`` (``datas`` are the caller's
        buffers, uncopied: see the module docstring for what ``send`` may read of them)."""


@runtime_checkable
class BoundsItself(Protocol):
    """A :class:`SplitTier` whose fetch bounds every wait of its own (a socket timeout set to what
    is left of the deadline), so :class:`GuardedTier` runs it on the caller's thread: no hop to the
    wrapper's threads, the same deadline, breaker and counts (the node tier: a round trip to a
    process on this host, where the hop cost more than the round trip)."""

    def fetch_many_by(self, keys: Sequence[ChunkKey], deadline: float, during: Callable[[], None] | None,
                      dsts: Sequence[Any] | None = None) -> Any:
        """``fetch_many(keys)`` that returns or raises (``TimeoutError`` past it) by ``deadline``
        (a ``time.perf_counter()`` value); ``during()``, if given, runs once the request is sent,
        while the answer is awaited.  ``dsts``: where ``finish_get`` will copy each key's value; the
        tier may write them meanwhile (the node tier's early copies, which ``finish_get`` then
        serves or redoes: the caller reads ``dsts`` only after ``finish_get``)."""


def split_get(split: SplitTier, keys: Sequence[ChunkKey], dsts: Sequence[memoryview], fetch: Callable[[], Any],
              delete: Callable[[list[ChunkKey]], object], records: TenantRecords | None = None) -> list[GetResult]:
    """One :class:`SplitTier` read: ``fetch()`` (``split.fetch_many(keys)``, on this thread or
    under a deadline; ``None``: every key a miss), ``split.finish_get`` on this thread, then
    ``delete`` of every ``CORRUPT`` key.  A tier's own ``get_many`` and :class:`GuardedTier` both
    read this way."""
    fetched = fetch()
    if fetched is None:
        return [GetResult.MISS] * len(keys)
    results = split.finish_get(keys, fetched, dsts, records)
    corrupt = [k for k, r in zip(keys, results, strict=True) if r is GetResult.CORRUPT]
    if corrupt:
        delete(corrupt)
    return results
