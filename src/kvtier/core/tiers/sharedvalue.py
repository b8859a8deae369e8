"""Encoding of one chunk as one value in a shared store (Redis/Valkey, S3): a header, then the payload.

Layout (little-endian) of format version 2, written since the tenant record (issue 22 item 3),
112 bytes of header then ``length`` bytes of payload::

    offset  size  field
    0       4     magic  b"KVTR"
    4       2     format version (2)
    6       1     digest kind: 0 = XXH3-128 checksum, 1 = keyed BLAKE3-128 MAC
    7       1     reserved (zero)
    8       16    namespace digest
    24      16    chunk key
    40      8     payload length, bytes
    48      48    tenant record (:mod:`kvtier.core.tenant`; all zero: unknown tenant)
    96      16    digest of bytes 0..95 followed by the payload

Version 1 (before the tenant record) is the same without bytes 48..95: a 64-byte header whose
digest, at 48..63, covers bytes 0..47 and the payload.  Both versions are read; only version 2 is
written.  A version-1 reader (an older kvtier) refuses a version-2 value as of an unknown format
(a counted miss, deleted), so engines sharing a server should be upgraded together (docs/purge.md).

The tenant record sits in the header so that ``kvtier purge --salt``/``--lora`` reads it with the
header alone (a Redis ``GETRANGE``, an S3 ranged ``GET``), never the payload.  The value's digest
covers it too, so a record changed on the server makes the value fail verification on read; the
record's own XXH3-64 lets a purge, which never reads the payload, tell a damaged record (never
trusted) from a good one.

Header and payload travel in one value written by one ``SET`` (or one ``PUT``), so the server can never evict
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

from kvtier.core import tenant
from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import buffers
from kvtier.core.tiers.base import GetResult

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

log = logging.getLogger(__name__)
MAGIC = b"KVTR"
VERSION = 2
"""The format version this kvtier writes (it reads :data:`V1` too)."""
V1 = 1
DIGEST_BYTES = 16
_FIELDS = struct.Struct("<4sHBB16s16sQ")  # 48 bytes: then (version 2) the tenant record, then the digest
RECORD_OFFSET = _FIELDS.size
"""Offset of the tenant record in a version-2 header."""
HEADER_BYTES = _FIELDS.size + tenant.RECORD_BYTES + DIGEST_BYTES
"""Bytes of the header this kvtier writes (version 2: 112)."""
V1_HEADER_BYTES = _FIELDS.size + DIGEST_BYTES
"""Bytes of a version-1 header (64)."""
_UNKNOWN_RECORD = bytes(tenant.RECORD_BYTES)
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

    def header(self, key: bytes, payload: memoryview | bytes, writer: tenant.Writer | None = None) -> bytes:
        """The :data:`HEADER_BYTES` that go in front of ``payload`` in its value (digest included),
        with the tenant record of ``writer`` (``None``: unknown, an all-zero record).

        A writer may send header and payload as two pieces of one ``SET`` argument
        (:mod:`kvtier.core.tiers.redisstream`): the value on the server is the same bytes as
        :meth:`encode`'s, without the copy."""
        view = memoryview(payload).cast("B")
        record = _UNKNOWN_RECORD if writer is None else tenant.record(self.namespace, writer)
        fields = _FIELDS.pack(MAGIC, VERSION, self.kind, 0, self.namespace, key, view.nbytes) + record
        return fields + self._digest(fields, view)

    def encode(self, key: bytes, payload: memoryview | bytes, out: bytearray | memoryview | None = None,
               writer: tenant.Writer | None = None) -> bytearray | memoryview:
        """One value: header (with ``writer``'s tenant record) + a copy of ``payload``, written into
        ``out`` (reused, so its pages are already faulted in; :mod:`kvtier.core.tiers.buffers`) when
        it has exactly ``HEADER_BYTES + len(payload)`` bytes, else into a fresh buffer (not zeroed:
        every byte is written here)."""
        view = memoryview(payload).cast("B")
        value = out if out is not None and len(out) == HEADER_BYTES + view.nbytes else \
            buffers.fresh(HEADER_BYTES + view.nbytes)
        # numpy's copy is a memcpy; bytearray slice assignment from a memoryview is ~7x slower
        np.copyto(np.frombuffer(value, dtype=np.uint8, offset=HEADER_BYTES), np.frombuffer(view, dtype=np.uint8))
        value[:HEADER_BYTES] = self.header(key, view, writer)
        return value

    def decode(self, key: bytes, value: bytes | memoryview, max_length: int) -> Decoded:
        """Verify ``value`` (format version 2, or 1 written before the tenant record) for ``key``;
        where its payload lies.

        Raises:
            SharedValueError: short, foreign format or version, another namespace, key or digest
                kind, a length that disagrees with the value or exceeds ``max_length``, or a
                digest mismatch (the tenant record of version 2 included).
        """
        if len(value) < V1_HEADER_BYTES:
            raise SharedValueError(f"value truncated ({len(value)} bytes, header alone is {V1_HEADER_BYTES})")
        magic, version, kind, reserved, namespace, stored_key, length = _FIELDS.unpack_from(value)
        if magic != MAGIC or version not in (V1, VERSION) or reserved:
            raise SharedValueError("not a kvtier value of a known format version")
        header_bytes = HEADER_BYTES if version == VERSION else V1_HEADER_BYTES
        if len(value) < header_bytes:
            raise SharedValueError(f"value truncated ({len(value)} bytes, header alone is {header_bytes})")
        if namespace != self.namespace or stored_key != key:
            raise SharedValueError("value belongs to another namespace or key")
        if kind != self.kind:
            raise SharedValueError("value was written with a different shared_secret setting")
        if length != len(value) - header_bytes:
            raise SharedValueError(f"payload is {len(value) - header_bytes} bytes, header says {length}")
        if length > max_length:
            raise SharedValueError(f"payload of {length} bytes exceeds the {max_length}-byte buffer")
        view = memoryview(value)
        covered = header_bytes - DIGEST_BYTES
        expect = self._digest(view[:covered], view[header_bytes:])
        if not hmac.compare_digest(expect, bytes(view[covered:header_bytes])):
            raise SharedValueError("digest mismatch (corrupt, or written without the shared secret)")
        return Decoded(header_bytes, length)


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
    it.  No network.  The tenant record of each verified version-2 value goes to
    :func:`kvtier.core.tenant.note_verified` (kept where this thread reads within
    :func:`kvtier.core.tenant.reading`: a promotion)."""
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
        if decoded.offset == HEADER_BYTES:  # version 2: the verified digest covers its tenant record
            tenant.note_verified(codec.namespace, key, view[RECORD_OFFSET:RECORD_OFFSET + tenant.RECORD_BYTES])
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
    """The fields of a value's header that name it (:func:`peek`).

    Attributes:
        namespace / key: 16-byte namespace digest and chunk key.
        length: payload bytes.
        record: the raw :data:`~kvtier.core.tenant.RECORD_BYTES` tenant record (version 2; all
            zero when the writer did not know its tenant), or ``None`` for a version-1 value,
            which has none.
    """

    namespace: bytes
    key: bytes
    length: int
    record: bytes | None


def peek(header: bytes | memoryview) -> Header | None:
    """What a value's first bytes (:data:`HEADER_BYTES` of them, or fewer when the value is a
    shorter version-1 one) name, or ``None`` when they are not a kvtier value header of a known
    format version.  Nothing is verified: the digest covers the payload too; a purge reads only the
    header to know the object and its tenant (the record has its own checksum)."""
    if len(header) < V1_HEADER_BYTES:
        return None
    magic, version, kind, reserved, namespace, key, length = _FIELDS.unpack_from(header)
    if magic != MAGIC or version not in (V1, VERSION) or reserved or kind not in (KIND_CHECKSUM, KIND_MAC):
        return None
    if version == V1:
        return Header(namespace, key, length, None)
    if len(header) < HEADER_BYTES:
        return None
    return Header(namespace, key, length, bytes(header[RECORD_OFFSET:RECORD_OFFSET + tenant.RECORD_BYTES]))
