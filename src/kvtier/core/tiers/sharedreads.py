"""The blob verbs of the shared tiers (redis, s3): variable-length reads (``get``, ``read_into``)
and ranged reads (``get_range``) of the value envelope, over each tier's own fetches.

:class:`SharedReads` is that part of :class:`~kvtier.core.tiers.redis.tier.RedisTier` and
:class:`~kvtier.core.tiers.s3.tier.S3Tier`.  A tier gives it:

- ``fetch_many(keys)`` (the :class:`~kvtier.core.tiers.split.SplitTier` half it has already):
  whole values, ``None`` where absent;
- :meth:`SharedReads.fetch_head_and` and :meth:`SharedReads.fetch_range`: a value's size, its
  first :data:`~kvtier.core.envelope.FIXED_BYTES` bytes and one byte range, in as few round trips
  as the server allows (Redis: one pipeline of ``STRLEN`` and two ``GETRANGE``; S3: a ``HEAD`` then
  two ranged ``GET`` in parallel).

Whole reads verify the digest (or MAC) over header and payload
(:func:`~kvtier.core.tiers.valueread.open_value`).  A ranged read checks the header only (the
namespace, key, format, sizes; a value whose chain changes the payload is read whole, verified,
and sliced): **the range's bytes are not verified** (no per-range digest in envelope version 1; :mod:`kvtier.core.tiers.valueread`), so
it never serves KV.  A value that fails either check is logged, counted in ``corrupt`` and
deleted; the verb answers ``None``.  These run on the caller's thread (bare tier) or on
:class:`~kvtier.core.tiers.guarded.GuardedTier`'s threads under its deadline; they raise on a fault.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvtier.core import envelope
from kvtier.core.envelope import note_verified
from kvtier.core.errors import ChunkFormatError, length_problem
from kvtier.core.keys import ChunkKey
from kvtier.core.stats import WireCounters
from kvtier.core.tenant import TenantRecords
from kvtier.core.tiers.loglimit import warn_unusable
from kvtier.core.tiers.sharedvalue import ValueCodec
from kvtier.core.tiers.valueread import check_range, open_bytes, open_value, payload_range, whole_sliced

log = logging.getLogger(__name__)


class SharedReads:
    """Blob verbs over a shared tier's fetches (see the module docstring)."""

    name: str
    where: str
    corrupt: int
    codec: ValueCodec
    wire: WireCounters
    _lock: threading.Lock

    def fetch_many(self, keys: Sequence[ChunkKey]) -> tuple[list[Any], float]:
        raise NotImplementedError

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        raise NotImplementedError

    def fetch_head_and(self, key: ChunkKey, start: int, end: int) -> tuple[int, bytes, bytes] | None:
        """``(value bytes, its first FIXED_BYTES bytes, value[start:end])`` (each clipped at the
        value's end), or ``None`` if absent.  Raises on a fault."""
        raise NotImplementedError

    def fetch_range(self, key: ChunkKey, start: int, end: int) -> bytes | None:
        """``value[start:end]`` (``start < end <= value bytes``), ``None`` if absent.  Raises on a fault."""
        raise NotImplementedError

    def lost(self, key: ChunkKey) -> None:
        """Forget ``key`` in the tier's own index (absent or unusable)."""
        raise NotImplementedError

    def give_back(self, values: list[Any]) -> None:
        """Return what :meth:`fetch_many` handed out (reused read buffers); default: nothing."""

    def _failed(self, key: ChunkKey, reason: str) -> None:
        """A value failed verification: logged, counted, forgotten (the caller deletes it)."""
        warn_unusable(self.codec.unusable_lines, log, f"kvtier {self.name} tier ({self.where})", key.hex(), reason, "deleted, treated as a miss")
        with self._lock:
            self.corrupt += 1
        self.wire.corrupt(1)
        self.lost(key)

    def _unusable(self, key: ChunkKey, reason: str) -> None:
        self._failed(key, reason)
        self.delete_many([key])

    def finish_read(self, key: ChunkKey, fetched: tuple[list[Any], float], dst: memoryview | None,
                    records: TenantRecords | None = None) -> tuple[memoryview | bytes | None, bool]:
        """The caller's half of a read of :meth:`fetch_many`'s ``([value], t0)``: verify the value and
        put its payload in ``dst`` (``None``: a new ``bytes``), its record in ``records``.  Returns
        the payload (``None``: absent or failed) and whether it failed verification (counted and
        forgotten here; the caller deletes it: :class:`~kvtier.core.tiers.guarded.GuardedTier` with
        its guarded delete).  No network.  The fetched buffers go back for reuse.

        Raises:
            BufferTooSmall: ``dst`` is shorter than the payload (nothing written).
        """
        values, t0 = fetched
        try:
            if values[0] is None:
                self.lost(key)
                return None, False
            payload: memoryview | bytes
            try:
                if dst is None:
                    payload, record = open_bytes(self.codec.envelope, key, memoryview(values[0]))
                else:
                    payload, record = open_value(self.codec.envelope, key, memoryview(values[0]), dst)
            except envelope.ForeignValue:  # another engine's master key: a miss, kept for it
                return None, False
            except ChunkFormatError as exc:
                self._failed(key, str(exc))
                return None, True
        finally:
            self.give_back(values)
        note_verified(records, self.codec.namespace, key, record)  # the verified digest covers it
        self.wire.moved("read", len(payload), time.perf_counter() - t0)
        return payload, False

    def _open(self, key: ChunkKey, dst: memoryview | None, records: TenantRecords | None) -> memoryview | bytes | None:
        payload, failed = self.finish_read(key, self.fetch_many([key]), dst, records)
        if failed:
            self.delete_many([key])
        return payload

    def get(self, key: ChunkKey, records: TenantRecords | None = None) -> bytes | None:
        """The verified payload (any length), or ``None`` (absent, or failing: counted and deleted)."""
        got = self._open(key, None, records)
        return None if got is None else bytes(got)

    def read_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> int | None:
        """The verified payload into ``dst[:length]``; its length, or ``None`` as :meth:`get`.

        Raises:
            BufferTooSmall: ``dst`` is shorter than the payload (nothing written).
        """
        got = self._open(key, dst, records)
        return None if got is None else len(got)

    def get_range(self, key: ChunkKey, offset: int, length: int) -> bytes | None:
        """``payload[offset:offset + length]`` clipped at its end; the header checked, the bytes NOT
        verified (see the module docstring); ``None`` if absent or the header fails.

        Raises:
            ValueError: a negative ``offset`` or ``length``.
        """
        check_range(offset, length)
        guess = envelope.FIXED_BYTES + offset, envelope.FIXED_BYTES + offset + length  # an envelope's header
        t0 = time.perf_counter()
        got = self.fetch_head_and(key, *guess)
        if got is None:
            self.lost(key)
            return None
        size, head, data = got
        try:
            header = envelope.decode_header(head)
            if problem := length_problem(size, header.header_bytes, header.stored_bytes):
                raise ChunkFormatError(problem)
            where = payload_range(self.codec.envelope, header, key, offset, length)
        except ChunkFormatError as exc:
            self._unusable(key, str(exc))
            return None
        if where is None:  # a chain that changes the payload: the whole value, verified, sliced
            return whole_sliced(self.get, key, offset, length)
        start, end = where
        if start == end:
            return b""
        if (start, end) != (guess[0], min(guess[1], size)):  # a legacy value's shorter header
            again = self.fetch_range(key, start, end)
            if again is None:
                self.lost(key)
                return None
            data = again
        if len(data) != end - start:  # replaced meanwhile by a value of another size
            return None
        self.wire.moved("read", len(data), time.perf_counter() - t0)
        return bytes(data)
