"""The value envelope: one stored format for every tier below the cpu tier (disk, redis, s3 and
any later one), issue 33 item 3.

Layout (little-endian), envelope version 1: a fixed 128-byte header, zero padding up to
``header bytes``, then the stored payload::

    offset  size  field
    0       4     magic b"KVTE"
    4       1     envelope version (1)
    5       1     digest kind: 0 = XXH3-128 checksum, 1 = keyed BLAKE3-128 MAC (``shared_secret``)
    6       2     header bytes = offset of the payload (128; the disk tier pads to 4096)
    8       16    namespace digest
    24      16    chunk key
    40      8     stored payload length, bytes (after the codec chain)
    48      8     original payload length, bytes (before it: the chunk's bytes)
    56      2     layout id (0: the namespace's page layout, the only one today)
    58      1     codec count n (0..5)
    59      5     codec ids in the order applied on write (:mod:`kvtier.core.codecs`; zero past n)
    64      48    tenant record (:mod:`kvtier.core.tenant`; all zero: unknown tenant)
    112     16    digest of bytes 0..111 followed by the stored payload
    128     ...   zero up to ``header bytes`` (not covered by the digest; must be zero)

   0       8        24       40      48      56  58 59   64            112       128
   +-------+--------+--------+-------+-------+---+--+----+-------------+---------+- - - -+---------
   |magic  |ns      |key     |stored |orig.  |lay|n |ids | tenant      | digest  | zero  | payload
   |ver,kd,|digest  |        |length |length |out|  |    | record (48) | (16)    | pad   | (stored
   |hdr len|        |        |       |       |   |  |    |             |         |       |  length)
   +-------+--------+--------+-------+-------+---+--+----+-------------+---------+- - - -+---------

The digest covers the header fields, the tenant record and the payload: a value moved under
another key or namespace, or whose record was changed, fails verification (a miss).  The record
also has its own XXH3-64, so a purge, which reads the header alone (:func:`decode_header`), tells
a damaged record from a good one.  With a ``shared_secret`` the digest is a BLAKE3 MAC keyed by
:func:`mac_key` (a writer without the secret cannot plant a value a reader accepts); without one
it is XXH3-128, which catches corruption, not forgery.

Zero copy: :meth:`Envelope.header` gives the header bytes alone, so a writer sends them and the
payload as two pieces (the redis tier's ``SET`` from the caller's memory) or writes them into a
reused buffer (the s3 tier, :meth:`Envelope.encode`); :meth:`Envelope.open_into` verifies a value
in memory and decodes it into the caller's buffer; the disk tier streams its digest with
:meth:`Envelope.hasher` while the bytes move.

Compatibility rule: a reader reads this envelope and the formats the release before it wrote
(:mod:`kvtier.core.legacyformats`: the chunk file version 2 and the shared value versions 1 and
2).  A value of any other format, a newer envelope version, an unknown codec or layout is a
counted, logged miss and is removed, never a crash and never a served byte.  Writers write only
the envelope.
"""

from __future__ import annotations

import hmac
import struct
import time
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import xxhash

from kvtier.core import codecs, compression, encryption, legacyformats, tenant  # noqa: F401 - registers the codecs
from kvtier.core.codecstats import CodecStats
from kvtier.core.envelopedigest import MAC_CONTEXT, Hasher, Mac, mac_key
from kvtier.core.errors import ChunkFormatError, length_problem

__all__ = ["MAC_CONTEXT", "Envelope", "EnvelopeError", "EnvelopeHeader", "ForeignValue", "Hasher", "Sealed",
           "decode_header", "mac_key"]
MAGIC = b"KVTE"
VERSION = 1
FIXED_BYTES = 128
"""Bytes of the header's fields, record and digest (the shared tiers' whole header)."""
DISK_HEADER_BYTES = 4096
"""The disk tier's header block: the fixed header padded so the payload starts on a 4096-byte
boundary, the largest logical block size of common devices, which ``O_DIRECT`` needs."""
DIGEST_BYTES = 16
MAX_CODECS = 5
KIND_CHECKSUM = 0
KIND_MAC = 1
LAYOUT_PAGES = 0
"""Layout id of the payload kvtier writes today: the namespace's page layout."""
_FIELDS = struct.Struct("<4sBBH16s16sQQHB5s")  # 64 bytes
RECORD_OFFSET = _FIELDS.size
"""Offset of the tenant record."""
DIGEST_OFFSET = RECORD_OFFSET + tenant.RECORD_BYTES
"""Offset of the digest (= bytes it covers before the payload)."""
_UNKNOWN = bytes(tenant.RECORD_BYTES)
FORMAT = "envelope v1"
FORMAT_CHUNK_FILE = "chunk file v2"
FORMAT_VALUE_V1 = "shared value v1"
FORMAT_VALUE_V2 = "shared value v2"
assert DIGEST_OFFSET + DIGEST_BYTES == FIXED_BYTES


class EnvelopeError(ChunkFormatError):
    """Bytes that are not a usable value for this namespace, key, secret and buffer (a miss)."""


class ForeignValue(EnvelopeError):
    """A value encrypted under a master key this reader does not hold: a miss, left in place."""


class EnvelopeHeader(NamedTuple):
    """A stored value's header as :func:`decode_header` reads it, in any format a reader accepts.

    Attributes:
        format: :data:`FORMAT`, or a legacy one (:data:`FORMAT_CHUNK_FILE`,
            :data:`FORMAT_VALUE_V1`, :data:`FORMAT_VALUE_V2`).
        header_bytes: offset of the payload in the value or file.
        kind: digest kind (:data:`KIND_CHECKSUM` or :data:`KIND_MAC`).
        namespace / key: 16-byte namespace digest and chunk key.
        stored_bytes / original_bytes: payload bytes as stored and after decoding (equal for
            every legacy format and for a passthrough codec chain).
        layout: layout id (:data:`LAYOUT_PAGES` for legacy values).
        codecs: codec ids in write order (``(1,)``, identity, for legacy values).
        record: the raw :data:`~kvtier.core.tenant.RECORD_BYTES` tenant record (all zero:
            unknown), or ``None`` for a shared value of version 1, which has none.
        digest: the stored 16-byte digest (legacy chunk file: XXH3-128 of the payload alone).
    """

    format: str
    header_bytes: int
    kind: int
    namespace: bytes
    key: bytes
    stored_bytes: int
    original_bytes: int
    layout: int
    codecs: tuple[int, ...]
    record: bytes | None
    digest: bytes

    @property
    def fields(self) -> bytes:
        """The envelope bytes its digest covers before the payload (``b""`` for legacy formats)."""
        if self.format != FORMAT:
            return b""
        ids = bytes(self.codecs) + bytes(MAX_CODECS - len(self.codecs))
        return _FIELDS.pack(MAGIC, VERSION, self.kind, self.header_bytes, self.namespace, self.key,
                            self.stored_bytes, self.original_bytes, self.layout, len(self.codecs), ids) + \
            (self.record or _UNKNOWN)


def decode_header(raw: bytes | memoryview) -> EnvelopeHeader:
    """The header at the start of ``raw`` in any format a reader accepts (envelope, chunk file
    version 2, shared value version 1 or 2), read without the payload: what ``kvtier purge``, the
    disk tier's rescan and ``stat`` need.  Nothing is verified except what the header alone
    allows (the legacy chunk file's header checksum; the envelope's padding present in ``raw``):
    the digest covers the payload.  ``raw`` needs :data:`FIXED_BYTES` for an envelope (fewer for a
    short legacy value), 4096 for a legacy chunk file.

    Raises:
        ChunkFormatError: not a header of a known format (an :class:`EnvelopeError` for an
            envelope of another version or a malformed one).
    """
    view = memoryview(raw)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    magic = view[:4].tobytes()
    if magic == MAGIC and view.nbytes >= FIXED_BYTES:  # the common case first
        return _decode_envelope(view)
    if magic == legacyformats.CHUNK_MAGIC:
        old = legacyformats.decode_chunk_header(view)
        return EnvelopeHeader(FORMAT_CHUNK_FILE, legacyformats.CHUNK_HEADER_BYTES, KIND_CHECKSUM, old.namespace,
                              old.key, old.length, old.length, LAYOUT_PAGES, (codecs.IDENTITY.id,),
                              old.tenant[:tenant.RECORD_BYTES], old.payload_digest)
    if magic == legacyformats.VALUE_MAGIC:
        val = legacyformats.decode_value_header(view)
        covered = val.header_bytes - DIGEST_BYTES
        return EnvelopeHeader(FORMAT_VALUE_V1 if val.record is None else FORMAT_VALUE_V2, val.header_bytes,
                              val.kind, val.namespace, val.key, val.length, val.length, LAYOUT_PAGES,
                              (codecs.IDENTITY.id,), val.record, bytes(view[covered:val.header_bytes]))
    if magic != MAGIC:
        raise ChunkFormatError("not a kvtier value (bad magic)")
    raise EnvelopeError(f"header truncated ({view.nbytes} of {FIXED_BYTES} bytes)")


@lru_cache(maxsize=8)
def _zeros(nbytes: int) -> bytes:
    return bytes(nbytes)


def _decode_envelope(view: memoryview) -> EnvelopeHeader:
    """:func:`decode_header` of an envelope (``view``: at least :data:`FIXED_BYTES` bytes)."""
    (_magic, version, kind, header_bytes, namespace, key, stored, original, layout, count,
     ids) = _FIELDS.unpack_from(view)
    if version != VERSION:
        raise EnvelopeError(f"unsupported chunk format: envelope version {version} (this kvtier reads {VERSION})")
    if kind not in (KIND_CHECKSUM, KIND_MAC) or header_bytes < FIXED_BYTES or count > MAX_CODECS \
            or any(ids[count:]):
        raise EnvelopeError("malformed envelope header")
    end = min(header_bytes, view.nbytes)
    if end > FIXED_BYTES and view[FIXED_BYTES:end].tobytes() != _zeros(end - FIXED_BYTES):  # memcmp
        raise EnvelopeError("envelope padding is not zero")
    return EnvelopeHeader(FORMAT, header_bytes, kind, namespace, key, stored, original, layout,
                          tuple(ids[:count]), view[RECORD_OFFSET:DIGEST_OFFSET].tobytes(),
                          view[DIGEST_OFFSET:FIXED_BYTES].tobytes())


@lru_cache(maxsize=64)
def _chain(ids: tuple[int, ...]) -> codecs.Chain:
    return codecs.chain_of(ids)


class Sealed(NamedTuple):
    """A value to store: ``header`` then ``body`` (after the codec chain: for a passthrough chain the caller's memory)."""

    header: bytes
    body: memoryview


class Envelope:
    """Writes and verifies envelopes of one namespace.

    Args:
        namespace: 16-byte namespace digest.
        secret: the shared secret (a keyed BLAKE3 MAC), or ``None`` (XXH3-128).
        chain: codec names or ids in write order (:func:`kvtier.core.codecs.chain_of`).
        header_bytes: the payload's offset (:data:`FIXED_BYTES`; the disk tier
            :data:`DISK_HEADER_BYTES`).
        layout: layout id written (:data:`LAYOUT_PAGES`).
        keyring: the operator's master keys (:class:`~kvtier.core.encryption.KeyRing`) for a
            chain with ``aes-256-gcm`` and for reading encrypted values; ``None``: none.

    Attributes:
        stats: the chain's numbers (:class:`~kvtier.core.codecstats.CodecStats`; payload-changing chains only).

    Raises:
        ValueError: a namespace not of 16 bytes, too many codecs, or ``header_bytes`` below
            :data:`FIXED_BYTES` or above 65535.
        CodecError: an unknown codec.
    """

    def __init__(self, namespace: bytes, secret: bytes | None = None, chain: Sequence[str | int] = ("identity",),
                 header_bytes: int = FIXED_BYTES, layout: int = LAYOUT_PAGES,
                 keyring: encryption.KeyRing | None = None) -> None:
        if len(namespace) != 16:
            raise ValueError(f"namespace digest must be 16 bytes, got {len(namespace)}")
        if not FIXED_BYTES <= header_bytes <= 0xFFFF:
            raise ValueError(f"header_bytes must be {FIXED_BYTES}..65535, got {header_bytes}")
        self.namespace = namespace
        self.chain = codecs.chain_of(chain)
        if len(self.chain.codecs) > MAX_CODECS:
            raise ValueError(f"a codec chain holds at most {MAX_CODECS} codecs, got {len(self.chain.codecs)}")
        self.kind = KIND_CHECKSUM if secret is None else KIND_MAC
        self.mac_key = None if secret is None else mac_key(secret)
        self.header_bytes = header_bytes
        self.layout = layout
        ids = self.chain.ids
        self._ids = len(ids), bytes(ids) + bytes(MAX_CODECS - len(ids))
        self._known = ids  # the chain this envelope writes: known without a look-up
        self._pad = bytes(header_bytes - FIXED_BYTES)
        if self.chain.sealed and keyring is None:
            raise codecs.CodecError("codec aes-256-gcm needs a master key; set encryption: {master_key_file: ...}")
        self.keyring = keyring
        self.stats = CodecStats()

    def record(self, writer: tenant.Writer | None) -> bytes:
        """The tenant record of ``writer`` in this namespace (all zero for ``None``: unknown)."""
        return _UNKNOWN if writer is None else tenant.record(self.namespace, writer)

    def fields(self, key: bytes, stored_bytes: int, original_bytes: int, record: bytes = _UNKNOWN) -> bytes:
        """The :data:`DIGEST_OFFSET` header bytes before the digest (which covers them)."""
        count, ids = self._ids
        return _FIELDS.pack(MAGIC, VERSION, self.kind, self.header_bytes, self.namespace, key, stored_bytes,
                            original_bytes, self.layout, count, ids) + record

    def hasher(self, fields: bytes | memoryview) -> Hasher:
        """A streaming digest of the kind this envelope writes, already fed ``fields``: feed it the
        stored payload in order (the disk tier hashes slices while they move)."""
        if self.mac_key is None:
            return xxhash.xxh3_128(fields)
        return Mac(self.mac_key, fields)

    def finish(self, fields: bytes, digest: bytes) -> bytes:
        """The whole :attr:`header_bytes` header: ``fields``, ``digest`` and the zero padding."""
        return fields + digest + self._pad

    def header(self, key: bytes, body: memoryview | bytes, original_bytes: int | None = None,
               writer: tenant.Writer | None = None) -> bytes:
        """The header of a value whose stored payload is ``body`` (its original length
        ``original_bytes``, default ``len(body)``), with ``writer``'s tenant record."""
        view = memoryview(body).cast("B")
        fields = self.fields(key, view.nbytes, view.nbytes if original_bytes is None else original_bytes,
                             self.record(writer))
        h = self.hasher(fields)
        h.update(view)
        return self.finish(fields, h.digest())

    def seal(self, key: bytes, payload: memoryview | bytes, writer: tenant.Writer | None = None) -> Sealed:
        """Header and body of ``payload`` through the codec chain (no copy for a passthrough chain;
        otherwise the codecs' own output buffers).

        Raises:
            CodecError: a codec fails."""
        view = memoryview(payload).cast("B")
        if self.chain.passthrough:
            return Sealed(self.header(key, view, view.nbytes, writer), view)
        record = self.record(writer)
        t0 = time.perf_counter()
        ctx = codecs.CodecContext(self.namespace, record, self.keyring,
                                  lambda stored: self.fields(key, stored, view.nbytes, record))
        body = memoryview(self.chain.encode(view, ctx)).cast("B")
        fields = self.fields(key, body.nbytes, view.nbytes, record)
        h = self.hasher(fields)
        h.update(body)
        head = self.finish(fields, h.digest())
        self.stats.encoded(view.nbytes, body.nbytes, time.perf_counter() - t0)
        return Sealed(head, body)

    def decode_payload(self, header: EnvelopeHeader, value: memoryview, out: memoryview) -> None:
        """Undo ``header``'s codec chain on the verified ``value`` (header and stored payload) into
        ``out`` (exactly the original length), counting it in :attr:`stats`.

        Raises:
            EnvelopeError: a codec fails (a decryption failure counted as one).
        """
        chain = _chain(header.codecs)
        stored = value[header.header_bytes:]
        if chain.passthrough:
            try:
                chain.decode_into(stored, out)
            except codecs.CodecError as exc:
                raise EnvelopeError(str(exc)) from None
            return
        t0 = time.perf_counter()
        ctx = codecs.CodecContext(self.namespace, header.record or _UNKNOWN, self.keyring,
                                  lambda _stored: bytes(value[:DIGEST_OFFSET]))
        try:
            chain.decode_into(stored, out, ctx)
        except codecs.CodecError as exc:
            self.stats.failed(isinstance(exc, codecs.DecryptError))
            raise (ForeignValue if isinstance(exc, codecs.ForeignKeyError) else EnvelopeError)(str(exc)) from None
        self.stats.decoded(stored.nbytes, out.nbytes, time.perf_counter() - t0)

    def stored_bytes(self, payload_bytes: int) -> int:
        """Bytes a value of ``payload_bytes`` takes (header included) with a passthrough chain."""
        return self.header_bytes + payload_bytes

    def check(self, header: EnvelopeHeader, key: bytes, original_bytes: int | None) -> None:
        """Refuse a header that does not belong here: another namespace, key or digest kind, an unknown layout or
        codec, or another original length than ``original_bytes`` (``None``: any length, a variable-length read:
        :mod:`kvtier.core.tiers.valueread`).  Raises EnvelopeError naming which."""
        if header.namespace != self.namespace or header.key != key:
            raise EnvelopeError("value belongs to another namespace or key")
        if header.kind != self.kind:
            raise EnvelopeError("value was written with a different shared_secret setting")
        if header.layout != LAYOUT_PAGES:
            raise EnvelopeError(f"layout id {header.layout} is not one this kvtier reads")
        if header.codecs != self._known and not all(codecs.known(i) for i in header.codecs):
            raise EnvelopeError(f"codec chain {list(header.codecs)} names a codec this kvtier does not know")
        if original_bytes is not None and header.original_bytes != original_bytes:
            raise EnvelopeError(f"payload of {header.original_bytes} bytes is not the expected {original_bytes}")

    def open_header(self, raw: memoryview, key: bytes, original_bytes: int | None,
                    header_bytes: int) -> tuple[EnvelopeHeader, Hasher | None]:
        """A streamed read's header in one call: decoded, refused unless an envelope or chunk file of ``header_bytes``,
        :meth:`check` ed; and an envelope's hasher fed its fields (``None``: a chunk file's covers the payload alone)."""
        header = decode_header(raw)
        if header.header_bytes != header_bytes or header.format not in (FORMAT, FORMAT_CHUNK_FILE):
            raise ChunkFormatError(f"not a chunk file ({header.format}, {header.header_bytes}-byte header)")
        self.check(header, key, original_bytes)
        return header, (self.hasher(raw[:DIGEST_OFFSET]) if header.format == FORMAT else None)

    def verify(self, header: EnvelopeHeader, value: memoryview) -> None:
        """Check ``value``'s digest (``value`` holds the header and the stored payload).

        Raises:
            EnvelopeError: the digest does not match.
        """
        if header.format == FORMAT:
            h = self.hasher(value[:DIGEST_OFFSET])
            h.update(value[header.header_bytes:])
            ok = hmac.compare_digest(h.digest(), header.digest)
        elif header.format == FORMAT_CHUNK_FILE:
            ok = xxhash.xxh3_128_digest(value[header.header_bytes:]) == header.digest
        else:
            ok = legacyformats.value_digest_ok(value, header.header_bytes, self.mac_key)
        if not ok:
            raise EnvelopeError("digest mismatch (corrupt, or written without the shared secret)")

    def open_into(self, key: bytes, value: bytes | memoryview, dst: memoryview) -> bytes | None:
        """Verify ``value`` (any format :func:`decode_header` reads) for ``key`` and decode its
        payload into ``dst`` (exactly the original length); return its tenant record
        (``None``: the format has none).

        Raises:
            ChunkFormatError: unreadable header, or (:class:`EnvelopeError`) a value that does not
                belong here, a length that disagrees with the value, a digest mismatch or a codec
                that fails; ``dst`` may then hold unverified bytes.
        """
        view = memoryview(value).cast("B")
        header = decode_header(view)
        out = memoryview(dst).cast("B")
        self.check(header, key, out.nbytes)
        if view.nbytes != header.header_bytes + header.stored_bytes:  # the sentence only for a bad one: a hit runs this
            raise EnvelopeError(length_problem(view.nbytes, header.header_bytes, header.stored_bytes) or "")
        self.verify(header, view)
        self.decode_payload(header, view, out)
        return header.record
