"""Encoding of one chunk as one value in a shared store (Redis/Valkey): a header, then the payload.

Layout (little-endian), 64 bytes of header then ``length`` bytes of payload::

    offset  size  field
    0       4     magic  b"KVTR"
    4       2     format version (1)
    6       1     digest kind: 0 = XXH3-128 checksum, 1 = keyed BLAKE3-128 MAC
    7       1     reserved (zero)
    8       16    namespace digest
    24      16    chunk key
    40      8     payload length, bytes
    48      16    digest of bytes 0..47 followed by the payload

Header and payload travel in one value written by one ``SET``, so the server can never evict
one without the other (LMCache#426 kept them in two keys and served false hits).  The digest
covers the header fields too, so a value moved under another key or namespace fails.

With a ``shared_secret`` the digest is a keyed BLAKE3 MAC: a shared server is a trust boundary,
and a writer without the secret cannot plant a value that a reader accepts.  The MAC key is
derived from the secret with BLAKE3's key-derivation mode (context ``"kvtier shared tier v1
MAC"``), so the secret itself never keys anything else.  Without a secret the digest is XXH3-128,
which catches corruption, not forgery.
"""

from __future__ import annotations

import hmac
import logging
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import blake3
import numpy as np
import xxhash

from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.base import GetResult

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

log = logging.getLogger(__name__)
MAGIC = b"KVTR"
VERSION = 1
HEADER_BYTES = 64
DIGEST_BYTES = 16
_FIELDS = struct.Struct("<4sHBB16s16sQ")  # 48 bytes, followed by the digest
KIND_CHECKSUM = 0
KIND_MAC = 1
MAC_CONTEXT = "kvtier shared tier v1 MAC"


class SharedValueError(Exception):
    """The bytes are not a valid value for this namespace, key and secret (a miss)."""


class Decoded(NamedTuple):
    """Where the verified payload lies inside a value: ``value[offset:offset + length]``."""

    offset: int
    length: int


KEYSPACE_CONTEXT = "kvtier shared tier v1 key space"


def keyspace(secret: bytes | None) -> str:
    """The key segment that keeps values under different secrets apart: ``""`` without a secret,
    else 16 hex digits derived from it (BLAKE3 ``derive_key``, context :data:`KEYSPACE_CONTEXT`,
    one-way: the secret cannot be recovered from it).  Engines with another secret, or none, then
    never see, fail to verify, and delete each other's values: they share nothing, as engines
    of different models do."""
    if secret is None:
        return ""
    return blake3.blake3(secret, derive_key_context=KEYSPACE_CONTEXT).hexdigest(length=8) + ":"


class ValueCodec:
    """Encodes and verifies values of one namespace, with or without a shared secret.

    Args:
        namespace: 16-byte namespace digest.
        secret: the shared secret (bytes), or ``None`` for a plain checksum.
    """

    def __init__(self, namespace: bytes, secret: bytes | None) -> None:
        if len(namespace) != 16:
            raise ValueError(f"namespace digest must be 16 bytes, got {len(namespace)}")
        self.namespace = namespace
        self.kind = KIND_CHECKSUM if secret is None else KIND_MAC
        self._mac_key = None if secret is None else blake3.blake3(secret, derive_key_context=MAC_CONTEXT).digest()

    def _digest(self, fields: bytes | memoryview, payload: memoryview | bytes) -> bytes:
        if self._mac_key is None:
            h = xxhash.xxh3_128(fields)
            h.update(payload)
            return h.digest()
        mac = blake3.blake3(fields, key=self._mac_key)
        mac.update(payload)
        return mac.digest(DIGEST_BYTES)

    def header(self, key: bytes, payload: memoryview | bytes) -> bytes:
        """The ``HEADER_BYTES`` that go in front of ``payload`` in its value (digest included).

        A writer may send header and payload as two pieces of one ``SET`` argument
        (:mod:`kvtier.core.tiers.redisstream`): the value on the server is the same bytes as
        :meth:`encode`'s, without the copy."""
        view = memoryview(payload).cast("B")
        fields = _FIELDS.pack(MAGIC, VERSION, self.kind, 0, self.namespace, key, view.nbytes)
        return fields + self._digest(fields, view)

    def encode(self, key: bytes, payload: memoryview | bytes, out: bytearray | None = None) -> bytearray:
        """One value: header + a copy of ``payload``, written into ``out`` (reused, so its pages are
        already faulted in) when it has exactly ``HEADER_BYTES + len(payload)`` bytes."""
        view = memoryview(payload).cast("B")
        value = out if out is not None and len(out) == HEADER_BYTES + view.nbytes else \
            bytearray(HEADER_BYTES + view.nbytes)
        # numpy's copy is a memcpy; bytearray slice assignment from a memoryview is ~7x slower
        np.copyto(np.frombuffer(value, dtype=np.uint8, offset=HEADER_BYTES), np.frombuffer(view, dtype=np.uint8))
        value[:HEADER_BYTES] = self.header(key, view)
        return value

    def decode(self, key: bytes, value: bytes | memoryview, max_length: int) -> Decoded:
        """Verify ``value`` for ``key``; where its payload lies.

        Raises:
            SharedValueError: short, foreign format or version, another namespace, key or digest
                kind, a length that disagrees with the value or exceeds ``max_length``, or a
                digest mismatch.
        """
        if len(value) < HEADER_BYTES:
            raise SharedValueError(f"value truncated ({len(value)} bytes, header alone is {HEADER_BYTES})")
        magic, version, kind, reserved, namespace, stored_key, length = _FIELDS.unpack_from(value)
        if magic != MAGIC or version != VERSION or reserved:
            raise SharedValueError("not a kvtier value of a known format version")
        if namespace != self.namespace or stored_key != key:
            raise SharedValueError("value belongs to another namespace or key")
        if kind != self.kind:
            raise SharedValueError("value was written with a different shared_secret setting")
        if length != len(value) - HEADER_BYTES:
            raise SharedValueError(f"payload is {len(value) - HEADER_BYTES} bytes, header says {length}")
        if length > max_length:
            raise SharedValueError(f"payload of {length} bytes exceeds the {max_length}-byte buffer")
        view = memoryview(value)
        expect = self._digest(view[:_FIELDS.size], view[HEADER_BYTES:])
        if not hmac.compare_digest(expect, bytes(view[_FIELDS.size:HEADER_BYTES])):
            raise SharedValueError("digest mismatch (corrupt, or written without the shared secret)")
        return Decoded(HEADER_BYTES, length)


def copy_payload(value: bytes | memoryview, decoded: Decoded, dst: memoryview) -> None:
    """Copy a verified payload into ``dst``."""
    src = np.frombuffer(value, dtype=np.uint8, count=decoded.length, offset=decoded.offset)
    np.copyto(np.frombuffer(dst, dtype=np.uint8, count=decoded.length), src)


class Verified(NamedTuple):
    """What :func:`verify_into` made of one batch of values.

    Attributes:
        results: per key, ``HIT`` (payload copied), ``MISS`` (no value) or ``CORRUPT``.
        payload_bytes: bytes copied into the destinations.
        corrupt: how many values failed verification (each logged, each a ``CORRUPT`` result).
    """

    results: list[GetResult]
    payload_bytes: int
    corrupt: int


def verify_into(codec: ValueCodec, keys: Sequence[ChunkKey], values: Sequence[bytes | memoryview | None],
                dsts: Sequence[memoryview], where: str, forget: Callable[[ChunkKey], None]) -> Verified:
    """Verify ``values[i]`` (``None``: absent) for ``keys[i]`` and copy its payload into ``dsts[i]``,
    for a shared tier's read (the caller's half of a :class:`~kvtier.core.tiers.guarded.SplitTier`
    read).  ``forget(key)`` is called for each key without a usable value.  A value that fails
    :meth:`ValueCodec.decode` is ``CORRUPT`` and logged, one line each naming ``where`` (e.g.
    ``"kvtier redis tier (host:port)"``) and the chunk; the tier counts it and the caller deletes
    it.  No network."""
    results: list[GetResult] = []
    num_bytes = corrupt = 0
    for key, value, dst in zip(keys, values, dsts, strict=True):
        if value is None:
            forget(key)
            results.append(GetResult.MISS)
            continue
        view = memoryview(value)  # any buffer: bytes, a read buffer's view, obstore's body
        try:
            decoded = codec.decode(key, view, memoryview(dst).nbytes)
        except SharedValueError as exc:
            log.warning("%s: value of chunk %s is unusable (%s); deleted, treated as a miss", where, key.hex(), exc)
            forget(key)
            corrupt += 1
            results.append(GetResult.CORRUPT)
            continue
        copy_payload(view, decoded, dst)
        num_bytes += decoded.length
        results.append(GetResult.HIT)
    return Verified(results, num_bytes, corrupt)


def shared_secret(config: KVTierConfig) -> bytes | None:
    """The shared secret from ``shared_secret`` or ``shared_secret_file`` (``None`` if neither).

    Raises:
        ConfigError: the file cannot be read or holds fewer than 16 characters.
    """
    if config.shared_secret:
        return config.shared_secret.encode()
    if config.shared_secret_file:
        try:
            text = Path(config.shared_secret_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"cannot read shared_secret_file {config.shared_secret_file!r}: {exc.strerror}; "
                              "fix the path or its permissions") from None
        if len(text) < 16:
            raise ConfigError(f"shared_secret_file {config.shared_secret_file!r} holds fewer than 16 characters; "
                              "use a long random secret (e.g. openssl rand -hex 32)")
        return text.encode()
    return None


class Header(NamedTuple):
    """The fields of a value's header that name it (:func:`peek`)."""

    namespace: bytes
    key: bytes
    length: int


def peek(header: bytes | memoryview) -> Header | None:
    """The namespace, chunk key and payload length a value's first :data:`HEADER_BYTES` bytes name,
    or ``None`` when they are not a kvtier value header of a known format version (nothing is
    verified: the digest covers the payload too; a purge reads only the header to know the object)."""
    if len(header) < HEADER_BYTES:
        return None
    magic, version, kind, reserved, namespace, key, length = _FIELDS.unpack_from(header)
    if magic != MAGIC or version != VERSION or reserved or kind not in (KIND_CHECKSUM, KIND_MAC):
        return None
    return Header(namespace, key, length)
