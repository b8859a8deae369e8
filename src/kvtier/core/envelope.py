"""The value envelope: one stored format for every tier below the cpu tier (disk, redis, s3 and
any later one), issue 33 item 3; here, what reading a value runs: its header decoded and checked,
its digest verified, and the tenant record it carries checked (writing a value: :mod:`kvtier.core.sealing`).

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
    64      48    tenant record (below; all zero: unknown tenant)
    112     16    digest of bytes 0..111 followed by the stored payload
    128     ...   zero up to ``header bytes`` (not covered by the digest; must be zero)

The digest covers the header fields, the tenant record and the payload: a value moved under
another key or namespace, or whose record was changed, fails verification (a miss).  With a
``shared_secret`` the digest is a BLAKE3 MAC keyed by :func:`mac_key` (a writer without the
secret cannot plant a value a reader accepts); without one it is XXH3-128, which catches
corruption, not forgery.

The tenant record (:mod:`kvtier.core.tenant`: who a chunk was saved for, keyed digests of its
``cache_salt`` and LoRA adapter) has its own XXH3-64, so a purge, which reads the header alone
(:func:`decode_header`), tells a damaged record from a good one::

    offset  size  field
    0       4     magic b"KVTN"
    4       1     record version (1)
    5       1     flags: bit 0 a salt was given, bit 1 a LoRA adapter was given
    6       2     zero
    8       16    keyed digest of the cache_salt (zero without one)
    24      16    keyed digest of the LoRA adapter's name (zero without one)
    40      8     XXH3-64 of bytes 0..39

A record that is absent (all zero) is **unknown**; one that fails its check (:func:`read_record`
raises :class:`DamagedRecord`) is never trusted.  A verified read keeps those that pass (:func:`note_verified`).
Zero copy: :meth:`Envelope.open_into` verifies a value in memory and decodes it into the caller's buffer;
the disk tier opens a file's header (checked, hasher, record) in one :meth:`Envelope.open_header` call.

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
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import xxhash

from kvtier.core import codecs, legacyformats
from kvtier.core.envelopedigest import MAC_CONTEXT, Hasher, Mac, mac_key
from kvtier.core.errors import ChunkFormatError, length_problem
from kvtier.core.sealing import (
    DIGEST_BYTES,
    DIGEST_OFFSET,
    DISK_HEADER_BYTES,
    FIELDS,
    FIXED_BYTES,
    KIND_CHECKSUM,
    KIND_MAC,
    LAYOUT_PAGES,
    MAGIC,
    MAX_CODECS,
    RECORD_BYTES,
    RECORD_OFFSET,
    UNKNOWN_RECORD,
    VERSION,
    EnvelopeWriter,
    Sealed,
)

__all__ = ["DIGEST_BYTES", "DIGEST_OFFSET", "DISK_HEADER_BYTES", "FIXED_BYTES", "KIND_CHECKSUM", "KIND_MAC",
           "LAYOUT_PAGES", "MAC_CONTEXT", "RECORD_BYTES", "RECORD_OFFSET", "DamagedRecord", "Envelope",
           "EnvelopeError", "EnvelopeHeader", "ForeignValue", "Hasher", "Record", "RecordedTenant", "Sealed",
           "decode_header", "decode_record", "mac_key", "note_verified", "read_record"]
FORMAT = "envelope v1"
FORMAT_CHUNK_FILE = "chunk file v2"
FORMAT_VALUE_V1 = "shared value v1"
FORMAT_VALUE_V2 = "shared value v2"
RECORD_MAGIC = b"KVTN"
RECORD_VERSION = 1
HAS_SALT = 1
HAS_LORA = 2
RECORD_FIELDS = struct.Struct("<4sBBH16s16s")  # the tenant record's 40 bytes, then their XXH3-64


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
        record: the raw :data:`RECORD_BYTES` tenant record (all zero:
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
        return FIELDS.pack(MAGIC, VERSION, self.kind, self.header_bytes, self.namespace, self.key,
                            self.stored_bytes, self.original_bytes, self.layout, len(self.codecs), ids) + \
            (self.record or UNKNOWN_RECORD)


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
                              old.tenant[:RECORD_BYTES], old.payload_digest)
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
     ids) = FIELDS.unpack_from(view)
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


@dataclass(frozen=True)
class RecordedTenant:
    """A chunk's tenant known only by the record a verified shared value or chunk file carried (a
    chunk read from the redis, s3 or disk tier and promoted into the cpu tier, issue 22): the keyed digests cannot be
    turned back into a :class:`~kvtier.core.tenant.TenantId`, so the record itself travels on, and a tier that writes
    the chunk down (the disk tier's header) writes the same :data:`RECORD_BYTES` bytes.

    Attributes:
        namespace: 16-byte namespace digest the record is keyed by (:func:`kvtier.core.tenant.record`).
        raw: the :data:`RECORD_BYTES` record as read, its own check passed (:func:`read_record`).
    """

    namespace: bytes
    raw: bytes

    @property
    def quota_key(self) -> bytes | None:
        """The tenant quotas' key (:mod:`kvtier.core.quota`): ``b""`` for a chunk saved without a
        ``cache_salt`` (all such requests are one tenant); ``None`` (unknown) for a salted one, whose
        salt digest the keyed record does not give back."""
        rec = decode_record(self.raw)
        return None if rec is None or rec.flags & HAS_SALT else b""

    def record_in(self, namespace: bytes) -> bytes:
        """The record to write for a value of ``namespace``: its own bytes when it was keyed by
        ``namespace``, else an all-zero (unknown) record: keyed digests cannot be keyed anew."""
        return self.raw if self.namespace == namespace else UNKNOWN_RECORD


class Record(NamedTuple):
    """A decoded record: the flags and the two keyed digests."""

    flags: int
    salt: bytes
    lora: bytes


class DamagedRecord(ValueError):
    """A record that is not all zero (so a writer put one there) but fails its check: another
    magic or version, or its checksum fails.  Never trusted: ``kvtier purge`` leaves the chunk
    alone and names it as a problem."""


def read_record(raw: bytes | memoryview) -> Record | None:
    """The record in ``raw`` (at least :data:`RECORD_BYTES` bytes); ``None`` when absent (all zero:
    the writer did not know its tenant, or wrote before records existed).

    Raises:
        DamagedRecord: not all zero, and a short record, another magic or version, or a checksum mismatch.
    """
    raw = bytes(raw[:RECORD_BYTES])
    if raw == UNKNOWN_RECORD:
        return None
    if len(raw) < RECORD_BYTES or raw[:4] != RECORD_MAGIC:
        raise DamagedRecord("its tenant record is not one this kvtier writes")
    if xxhash.xxh3_64_digest(raw[:RECORD_FIELDS.size]) != raw[RECORD_FIELDS.size:RECORD_BYTES]:
        raise DamagedRecord("its tenant record fails its checksum")
    _magic, version, flags, _zero, salt, lora = RECORD_FIELDS.unpack(raw[:RECORD_FIELDS.size])
    if version != RECORD_VERSION:
        raise DamagedRecord(f"its tenant record is of version {version}, which this kvtier does not read")
    return Record(flags, salt, lora)


def decode_record(raw: bytes | memoryview) -> Record | None:
    """The record in ``raw`` (at least :data:`RECORD_BYTES` bytes); ``None`` when unknown (absent,
    another version, or a checksum mismatch: :func:`read_record` tells those apart)."""
    try:
        return read_record(raw)
    except DamagedRecord:
        return None


def note_verified(records: dict[bytes, RecordedTenant] | None, namespace: bytes, key: bytes,
                  raw: bytes | memoryview | None) -> None:
    """A value of chunk ``key`` in ``namespace`` whose digest covers the tenant record ``raw``
    (:data:`RECORD_BYTES` bytes; ``None``: its format has none) was verified: keep the record in
    ``records`` (:data:`kvtier.core.tenant.TenantRecords`; ``None``: the caller does not collect
    them).  An absent record (unknown) or one that fails its own check (:class:`DamagedRecord`) is
    not kept: the chunk's tenant stays unknown.  Call it only after verification passed; readers
    of one dict note distinct keys."""
    if records is None or raw is None:
        return
    raw = bytes(raw[:RECORD_BYTES])
    if decode_record(raw) is not None:
        records[bytes(key)] = RecordedTenant(bytes(namespace), raw)


# ---- reading a value ------------------------------------------------------------------------
class Envelope(EnvelopeWriter):
    """Writes (:class:`~kvtier.core.sealing.EnvelopeWriter`, whose arguments these are) and
    verifies envelopes of one namespace."""

    def hasher(self, fields: bytes | memoryview) -> Hasher:
        """A streaming digest of the kind this envelope writes, already fed ``fields``: feed it the
        stored payload in order (the disk tier hashes slices while they move)."""
        if self.mac_key is None:
            return xxhash.xxh3_128(fields)
        return Mac(self.mac_key, fields)

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
        ctx = codecs.CodecContext(self.namespace, header.record or UNKNOWN_RECORD, self.keyring,
                                  lambda _stored: bytes(value[:DIGEST_OFFSET]))
        try:
            chain.decode_into(stored, out, ctx)
        except codecs.CodecError as exc:
            self.stats.failed(isinstance(exc, codecs.DecryptError))
            raise (ForeignValue if isinstance(exc, codecs.ForeignKeyError) else EnvelopeError)(str(exc)) from None
        self.stats.decoded(stored.nbytes, out.nbytes, time.perf_counter() - t0)

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
                    header_bytes: int) -> tuple[EnvelopeHeader, Hasher | None, RecordedTenant | None]:
        """A streamed read's header in one call: decoded, refused unless an envelope or chunk file of ``header_bytes``,
        :meth:`check` ed; an envelope's hasher fed its fields (``None``: a chunk file's covers the payload alone); and
        the tenant its record names, for the caller to keep once the digest verified (:func:`note_verified`'s rule)."""
        header = decode_header(raw)
        if header.header_bytes != header_bytes or header.format not in (FORMAT, FORMAT_CHUNK_FILE):
            raise ChunkFormatError(f"not a chunk file ({header.format}, {header.header_bytes}-byte header)")
        self.check(header, key, original_bytes)
        rec = header.record  # absent (all zero) or failing its own check: the tenant stays unknown
        tenant = None if rec is None or decode_record(rec) is None else RecordedTenant(self.namespace, rec)
        return header, (self.hasher(raw[:DIGEST_OFFSET]) if header.format == FORMAT else None), tenant

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
