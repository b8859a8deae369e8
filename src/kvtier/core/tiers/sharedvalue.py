"""The values of the shared tiers (Redis/Valkey, S3): one value per chunk, the value envelope
(:mod:`kvtier.core.envelope`: a 128-byte header, then the payload), written by one ``SET`` (or one
``PUT``) so the server can never evict the header without the payload (LMCache#426 kept them in
two keys and served false hits).

Values the release before the envelope wrote (the shared value format versions 1 and 2, 64- and
112-byte headers, :mod:`kvtier.core.legacyformats`) are still read and verified; only envelopes are
written.  An older kvtier refuses an envelope as a value of an unknown format (a counted miss,
deleted), so engines sharing a server should be upgraded together (docs/purge.md).

The tenant record sits in the header so that ``kvtier purge --salt``/``--lora`` reads it with the
header alone (a Redis ``GETRANGE``, an S3 ranged ``GET`` of :data:`HEADER_BYTES`, :func:`peek`),
never the payload.  The value's digest covers it too, so a record changed on the server makes the
value fail verification on read.

With a ``shared_secret`` the digest is a keyed BLAKE3 MAC (a shared server is a trust boundary:
a writer without the secret cannot plant a value that a reader accepts); without one it is
XXH3-128, which catches corruption, not forgery (:mod:`kvtier.core.envelope`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import blake3
import numpy as np

from kvtier.core import encryption, envelope, legacyformats, tenant
from kvtier.core.encryption import KeyRing
from kvtier.core.errors import ChunkFormatError, ConfigError, length_problem
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import buffers
from kvtier.core.tiers.base import GetResult
from kvtier.core.tiers.blobs import StorageFailed
from kvtier.core.tiers.loglimit import CauseLimiter, warn_unusable

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

log = logging.getLogger(__name__)
HEADER_BYTES = envelope.FIXED_BYTES
"""Bytes of the header this kvtier writes (the envelope's: 128), and of a purge's header read."""
V2_HEADER_BYTES = legacyformats.VALUE_V2_HEADER_BYTES
"""Bytes of a shared value version-2 header (112; read, no longer written)."""
V1_HEADER_BYTES = legacyformats.VALUE_V1_HEADER_BYTES
"""Bytes of a shared value version-1 header (64; read, no longer written)."""
RECORD_OFFSET = envelope.RECORD_OFFSET
"""Offset of the tenant record in the header this kvtier writes."""
DIGEST_BYTES = envelope.DIGEST_BYTES
KIND_CHECKSUM = envelope.KIND_CHECKSUM
KIND_MAC = envelope.KIND_MAC


class SharedValueError(Exception):
    """The bytes are not a valid value for this namespace, key and secret (a miss)."""


class ForeignSharedValue(SharedValueError):
    """A value sealed under a master key this reader lacks: a miss, left on the server."""


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


def configured_keyspace(config: KVTierConfig) -> str:
    """A configuration's key space segment without its trailing ``:`` (:func:`keyspace` of its
    :func:`shared_secret`), ``""`` without a secret: which values a shared tier's blob store may
    reset or purge as this configuration's (:mod:`kvtier.core.purge`).

    Raises:
        StorageFailed: the secret file cannot be read.
    """
    try:
        return keyspace(shared_secret(config)).rstrip(":")
    except ConfigError as exc:
        raise StorageFailed(str(exc)) from None


class ValueCodec:
    """Encodes and verifies values of one namespace, with or without a shared secret.

    Args:
        namespace: 16-byte namespace digest.
        secret: the shared secret (bytes), or ``None`` for a plain checksum.
        chain: the codec chain written (:mod:`kvtier.core.codecs`; identity by default).
        keyring: the master keys of encryption at rest (:mod:`kvtier.core.encryption`), or ``None``.
    """

    def __init__(self, namespace: bytes, secret: bytes | None, chain: Sequence[str | int] = ("identity",),
                 keyring: KeyRing | None = None) -> None:
        self.envelope = envelope.Envelope(namespace, secret, chain, keyring=keyring)
        self.namespace = namespace
        self.unusable_lines = CauseLimiter()  # values that fail verification: a line per cause per interval
        self.kind = self.envelope.kind

    def seal(self, key: bytes, payload: memoryview | bytes, writer: tenant.Writer | None = None) -> envelope.Sealed:
        """Header (with ``writer``'s tenant record; ``None``: unknown) and body (``payload`` through
        the codec chain: the caller's memory itself for identity) of one value.  A writer may send
        them as two pieces of one ``SET`` argument (:mod:`kvtier.core.tiers.redis.stream`): the
        value on the server is the same bytes as :meth:`encode`'s, without the copy."""
        return self.envelope.seal(key, payload, writer)

    def value_bytes(self, payload_bytes: int) -> int:
        """Bytes of the value of a ``payload_bytes`` payload when the chain fixes them (identity,
        ``aes-256-gcm`` alone: 32 more), else of an identity value (a compressing chain's are known
        only once encoded): the size of the reused buffer :meth:`encode` is given."""
        extra = encryption.OVERHEAD_BYTES if self.envelope.chain.ids == (encryption.CODEC_ID,) else 0
        return HEADER_BYTES + payload_bytes + extra

    def header(self, key: bytes, payload: memoryview | bytes, writer: tenant.Writer | None = None) -> bytes:
        """The :data:`HEADER_BYTES` in front of ``payload`` (a passthrough chain's body is the payload)."""
        return self.seal(key, payload, writer).header

    def encode(self, key: bytes, payload: memoryview | bytes, out: bytearray | memoryview | None = None,
               writer: tenant.Writer | None = None) -> bytearray | memoryview:
        """One value: header (with ``writer``'s tenant record) + a copy of the body, written into
        ``out`` (reused, so its pages are already faulted in; :mod:`kvtier.core.tiers.buffers`) when
        it has exactly the value's length, else into a fresh buffer (not zeroed: every byte is
        written here)."""
        head, body = self.seal(key, payload, writer)
        size = len(head) + body.nbytes
        value = out if out is not None and len(out) == size else buffers.fresh(size)
        # numpy's copy is a memcpy; bytearray slice assignment from a memoryview is ~7x slower
        np.copyto(np.frombuffer(value, dtype=np.uint8, offset=len(head)), np.frombuffer(body, dtype=np.uint8))
        value[:len(head)] = head
        return value

    def open_into(self, key: bytes, value: bytes | memoryview, dst: memoryview) -> bytes | None:
        """Verify ``value`` (an envelope, or a shared value of version 1 or 2) for ``key`` and put
        its payload in ``dst`` (exactly its length); the tenant record it carried (``None``:
        version 1 has none).

        Raises:
            SharedValueError: a value that is not usable here (see
                :meth:`kvtier.core.envelope.Envelope.open_into`).
        """
        try:
            return self.envelope.open_into(key, value, dst)
        except envelope.ForeignValue as exc:
            raise ForeignSharedValue(str(exc)) from None
        except ChunkFormatError as exc:
            raise SharedValueError(str(exc)) from None

    def decode(self, key: bytes, value: bytes | memoryview, max_length: int) -> Decoded:
        """Verify ``value`` for ``key`` without copying its payload; where the payload lies (a
        passthrough chain only: the stored bytes are the payload).

        Raises:
            SharedValueError: as :meth:`open_into`, a payload longer than ``max_length``, or a
                codec chain that changes the bytes.
        """
        view = memoryview(value).cast("B")
        try:
            head = envelope.decode_header(view)
            if head.stored_bytes > max_length:
                raise SharedValueError(f"payload of {head.stored_bytes} bytes exceeds the {max_length}-byte buffer")
            self.envelope.check(head, key, head.original_bytes)
            if problem := length_problem(view.nbytes, head.header_bytes, head.stored_bytes):
                raise SharedValueError(problem)
            self.envelope.verify(head, view)
        except ChunkFormatError as exc:
            raise SharedValueError(str(exc)) from None
        if head.stored_bytes != head.original_bytes:
            raise SharedValueError("value's codec chain changes its bytes: read it with open_into")
        return Decoded(head.header_bytes, head.stored_bytes)


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
                dsts: Sequence[memoryview], where: str, forget: Callable[[ChunkKey], None],
                records: tenant.TenantRecords | None = None) -> Verified:
    """Verify ``values[i]`` (``None``: absent) for ``keys[i]`` and put its payload into ``dsts[i]``,
    for a shared tier's read (the caller's half of a :class:`~kvtier.core.tiers.split.SplitTier`
    read).  ``forget(key)`` is called for each key without a usable value.  A value that fails
    :meth:`ValueCodec.open_into` is ``CORRUPT`` and logged, one line each naming ``where`` (e.g.
    ``"kvtier redis tier (host:port)"``) and the chunk; the tier counts it and the caller deletes
    it.  No network.  The tenant record of each verified value goes into ``records``
    (:func:`kvtier.core.envelope.note_verified`; ``None``: not collected)."""
    results: list[GetResult] = []
    num_bytes = corrupt = 0
    for key, value, dst in zip(keys, values, dsts, strict=True):
        if value is None:
            forget(key)
            results.append(GetResult.MISS)
            continue
        view = memoryview(value)  # any buffer: bytes, a read buffer's view, obstore's body
        out = memoryview(dst).cast("B")
        try:
            record = codec.open_into(key, view, out)
        except ForeignSharedValue as exc:  # another engine's master key: kept on the server for it
            log.debug("%s: chunk %s: %s; treated as a miss, kept", where, key.hex(), exc)
            results.append(GetResult.MISS)
            continue
        except SharedValueError as exc:
            warn_unusable(codec.unusable_lines, log, where, key.hex(), str(exc), "deleted, treated as a miss")
            forget(key)
            corrupt += 1
            results.append(GetResult.CORRUPT)
            continue
        envelope.note_verified(records, codec.namespace, key, record)  # the verified digest covers the record
        num_bytes += out.nbytes
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
        length: payload bytes (as stored).
        record: the raw :data:`~kvtier.core.envelope.RECORD_BYTES` tenant record (all zero when the
            writer did not know its tenant), or ``None`` for a version-1 value, which has none.
    """

    namespace: bytes
    key: bytes
    length: int
    record: bytes | None


def peek(header: bytes | memoryview) -> Header | None:
    """What a value's first bytes (:data:`HEADER_BYTES` of them, or fewer when the value is
    shorter) name, or ``None`` when they are not a kvtier value header of a known format
    (:func:`kvtier.core.envelope.decode_header`: envelope, shared value version 1 or 2).  Nothing
    is verified: the digest covers the payload too; a purge reads only the header to know the
    object and its tenant (the record has its own checksum)."""
    try:
        head = envelope.decode_header(header)
    except ChunkFormatError:
        return None
    if head.format == envelope.FORMAT_CHUNK_FILE:
        return None
    return Header(head.namespace, head.key, head.stored_bytes, head.record)
