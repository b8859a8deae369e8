"""``EnvelopeTier``: a tier over plain value storage, with the value envelope written and verified
for it, so a new tier is a blob store and nothing more.

A subclass stores and loads whole values under chunk keys (:meth:`EnvelopeTier.load`,
:meth:`EnvelopeTier.store`, optionally :meth:`EnvelopeTier.load_range` for a ranged read that
does not load the whole value) and keeps its own index and accounting (``contains``, ``delete``,
``keys``, ``usage``, ``check``).  This class gives it the rest of the tier contract
(:mod:`kvtier.core.tiers.base`) over the envelope (:mod:`kvtier.core.envelope`): every value is
written with its header (namespace, key, lengths, codec chain, the writer's tenant record, the
digest) and every whole read is verified (:mod:`kvtier.core.tiers.valueread`); a value that fails
is ``CORRUPT`` (``None`` from the blob verbs), counted in ``corrupt``, logged and deleted, never
served.  The toy dict tier of the tests (tests/dict_tier.py) is one; the disk, redis and s3 tiers
write the same values with their own zero-copy paths.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Sequence
from typing import TypeVar

from kvtier.core import envelope
from kvtier.core.encryption import KeyRing
from kvtier.core.errors import ChunkFormatError
from kvtier.core.keys import ChunkKey
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.base import GetResult, PutResult, Tier
from kvtier.core.tiers.loglimit import CauseLimiter, warn_unusable
from kvtier.core.tiers.valueread import check_range, open_bytes, open_value, payload_range, whole_sliced

log = logging.getLogger(__name__)
T = TypeVar("T")


class EnvelopeTier(Tier):
    """A tier over whole-value storage (see the module docstring).

    Args:
        namespace: 16-byte namespace digest written into and checked against every header.
        secret: a shared secret (keyed BLAKE3 MAC) or ``None`` (XXH3-128).
        chain: the codec chain written (:mod:`kvtier.core.codecs`); a plug-in passes its configured
            one and the key ring: ``**kvtier.core.codecsettings.envelope_args(config, name)``.
        keyring: the master keys of encryption at rest (:mod:`kvtier.core.encryption`), or ``None``.

    Raises:
        ValueError / CodecError: as :class:`~kvtier.core.envelope.Envelope`.
    """

    def __init__(self, namespace: bytes, secret: bytes | None = None, chain: Sequence[str | int] = ("identity",),
                 keyring: KeyRing | None = None) -> None:
        super().__init__()
        self.namespace = namespace
        self.envelope = envelope.Envelope(namespace, secret, chain, keyring=keyring)
        self._counts = threading.Lock()
        self._unusable_lines = CauseLimiter()  # values that fail verification: a line per cause per interval

    # ---- what a subclass implements --------------------------------------------------------
    @abstractmethod
    def load(self, key: ChunkKey) -> bytes | memoryview | None:
        """The whole stored value of ``key``, or ``None`` if absent."""

    @abstractmethod
    def store(self, key: ChunkKey, value: bytes) -> PutResult:
        """Store ``value`` (a whole envelope) under ``key``: ``STORED``, ``PRESENT`` (kept the
        original), ``NO_ROOM`` or ``FAILED``."""

    def load_range(self, key: ChunkKey, start: int, end: int) -> bytes | memoryview | None:
        """Bytes ``start..end`` of the stored value (clipped at its end), or ``None`` if absent.
        Default: :meth:`load` and slice; a storage with ranged reads overrides it."""
        value = self.load(key)
        return None if value is None else memoryview(value)[start:end]

    def sealed_key(self, key: ChunkKey) -> bytes:
        """The key ``key``'s envelope carries (written, and checked on read): ``key`` itself; a
        storage that names values otherwise overrides it (the node pool's key spaces,
        :mod:`kvtier.core.tiers.node.names`)."""
        return key

    # ---- the tier contract over them ---------------------------------------------------------
    def _unusable(self, key: ChunkKey, reason: str) -> None:
        warn_unusable(self._unusable_lines, log, f"kvtier {self.name} tier", key.hex(), reason, "deleted, treated as a miss")
        with self._counts:
            self.corrupt += 1
        self.delete(key)

    def _foreign(self, key: ChunkKey, exc: Exception, answer: T) -> T:
        """A value sealed under a master key this tier's ring lacks: a miss (counted in the codec
        numbers), left in place for the engines that hold the key."""
        log.debug("kvtier %s tier: chunk %s: %s; treated as a miss, kept", self.name, key.hex(), exc)
        return answer

    def get_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> GetResult:
        value = self.load(key)
        if value is None:
            return GetResult.MISS
        try:
            record = self.envelope.open_into(self.sealed_key(key), value, dst)
        except envelope.ForeignValue as exc:
            return self._foreign(key, exc, GetResult.MISS)
        except ChunkFormatError as exc:
            self._unusable(key, str(exc))
            return GetResult.CORRUPT
        envelope.note_verified(records, self.namespace, key, record)
        return GetResult.HIT

    def read_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> int | None:
        value = self.load(key)
        if value is None:
            return None
        try:
            opened = open_value(self.envelope, self.sealed_key(key), value, dst)
        except envelope.ForeignValue as exc:
            return self._foreign(key, exc, None)
        except ChunkFormatError as exc:
            self._unusable(key, str(exc))
            return None
        envelope.note_verified(records, self.namespace, key, opened.record)
        return opened.payload.nbytes

    def get(self, key: ChunkKey, records: TenantRecords | None = None) -> bytes | None:
        value = self.load(key)
        if value is None:
            return None
        try:
            payload, record = open_bytes(self.envelope, self.sealed_key(key), value)
        except envelope.ForeignValue as exc:
            return self._foreign(key, exc, None)
        except ChunkFormatError as exc:
            self._unusable(key, str(exc))
            return None
        envelope.note_verified(records, self.namespace, key, record)
        return payload

    def get_range(self, key: ChunkKey, offset: int, length: int) -> bytes | None:
        """``payload[offset:offset + length]`` after the header's check, the bytes unverified; of a
        value whose chain changes the payload, a verified whole read sliced
        (:mod:`kvtier.core.tiers.valueread`)."""
        check_range(offset, length)
        head = self.load_range(key, 0, envelope.FIXED_BYTES)
        if head is None:
            return None
        try:
            where = payload_range(self.envelope, envelope.decode_header(head), self.sealed_key(key), offset, length)
        except ChunkFormatError as exc:
            self._unusable(key, str(exc))
            return None
        if where is None:  # a chain that changes the payload: the whole value, verified, sliced
            return whole_sliced(self.get, key, offset, length)
        start, end = where
        if start == end:
            return b""
        got = self.load_range(key, start, end)
        return None if got is None else bytes(got)

    def put(self, key: ChunkKey, data: memoryview | bytes, tenant: Writer | None = None) -> PutResult:
        """Store ``data`` (any length) as an envelope with ``tenant``'s record."""
        header, body = self.envelope.seal(self.sealed_key(key), data, tenant)
        return self.store(key, header + body.tobytes())

    def stored_bytes(self, payload_bytes: int) -> int:
        return self.envelope.stored_bytes(payload_bytes)
