"""The value formats kvtier wrote before the envelope (:mod:`kvtier.core.envelope`): still read,
never written by a tier.

Two formats, each with its byte layout below; :func:`kvtier.core.envelope.decode_header` reads
them (and the envelope) by their magic.

**Chunk file, version 2** (magic ``b"KVTC"``; the disk tier's files): a 4096-byte header block,
then ``length`` bytes of payload at offset 4096 (little-endian)::

    offset  size  field
    0       4     magic  b"KVTC"
    4       2     format version (2)
    6       2     header block size (4096)
    8       16    namespace digest
    24      16    chunk key
    40      8     payload length, bytes
    48      16    XXH3-128 of the payload
    64      8     XXH3-64 of bytes 0..63 (header checksum)
    72      128   tenant record (:mod:`kvtier.core.tenant`, 48 bytes then zero; all zero: unknown),
                  not covered by the header checksum: it has its own
    200     3896  reserved (zero)

Version 1 of the chunk file (an 80-byte header) was dropped before the envelope: it is refused
("unsupported chunk format version 1"), a counted miss.

**Shared value, versions 1 and 2** (magic ``b"KVTR"``; the redis and s3 tiers' values)::

    offset  size  field
    0       4     magic  b"KVTR"
    4       2     format version (1 or 2)
    6       1     digest kind: 0 = XXH3-128 checksum, 1 = keyed BLAKE3-128 MAC
    7       1     reserved (zero)
    8       16    namespace digest
    24      16    chunk key
    40      8     payload length, bytes
    48      48    (version 2 only) tenant record
    96 / 48 16    digest of the bytes before it followed by the payload

so version 2 has a 112-byte header and version 1 a 64-byte one.  The MAC key is the envelope's
(:func:`kvtier.core.envelope.mac_key`).
"""

from __future__ import annotations

import hmac
import struct
from typing import NamedTuple

import blake3
import xxhash

from kvtier.core.errors import ChunkFormatError
from kvtier.core.sealing import RECORD_BYTES

CHUNK_MAGIC = b"KVTC"
CHUNK_VERSION = 2
CHUNK_HEADER_BYTES = 4096
_CHUNK_HEAD = struct.Struct("<4sHH16s16sQ16s")  # 64 bytes, covered by the header checksum
_CHUNK_SUMMED = _CHUNK_HEAD.size + 8
CHUNK_TENANT_OFFSET = _CHUNK_SUMMED
CHUNK_TENANT_BYTES = 128
_CHUNK_RESERVED = CHUNK_TENANT_OFFSET + CHUNK_TENANT_BYTES
_CHUNK_ZEROS = bytes(CHUNK_HEADER_BYTES - _CHUNK_RESERVED)

VALUE_MAGIC = b"KVTR"
VALUE_V1, VALUE_V2 = 1, 2
VALUE_DIGEST_BYTES = 16
_VALUE_FIELDS = struct.Struct("<4sHBB16s16sQ")  # 48 bytes
VALUE_RECORD_OFFSET = _VALUE_FIELDS.size
VALUE_V2_HEADER_BYTES = _VALUE_FIELDS.size + RECORD_BYTES + VALUE_DIGEST_BYTES
VALUE_V1_HEADER_BYTES = _VALUE_FIELDS.size + VALUE_DIGEST_BYTES


class ChunkFileHeader(NamedTuple):
    """A chunk file's (version 2) header fields; ``tenant`` is its 128-byte record area."""

    namespace: bytes
    key: bytes
    length: int
    payload_digest: bytes
    tenant: bytes


def encode_chunk_header(namespace: bytes, key: bytes, length: int, digest: bytes, record: bytes = b"") -> bytes:
    """The 4096-byte version-2 header block of a payload of ``length`` bytes whose XXH3-128 is
    ``digest`` (for read-compatibility tests: no tier writes it any more)."""
    if len(record) > CHUNK_TENANT_BYTES:
        raise ValueError(f"tenant record of {len(record)} bytes exceeds {CHUNK_TENANT_BYTES}")
    head = _CHUNK_HEAD.pack(CHUNK_MAGIC, CHUNK_VERSION, CHUNK_HEADER_BYTES, namespace, key, length, digest)
    return head + xxhash.xxh3_64_digest(head) + record + bytes(CHUNK_TENANT_BYTES - len(record)) + _CHUNK_ZEROS


def decode_chunk_header(raw: bytes | memoryview) -> ChunkFileHeader:
    """Parse and check a version-2 chunk file header block (at least 4096 bytes of ``raw``).

    Raises:
        ChunkFormatError: short, wrong magic, another version (1 included), header checksum
            mismatch, or non-zero reserved bytes.
    """
    raw = memoryview(raw)
    if raw.nbytes < _CHUNK_HEAD.size:
        raise ChunkFormatError(f"header truncated ({raw.nbytes} of {CHUNK_HEADER_BYTES} bytes)")
    magic, version, header_bytes, namespace, key, length, digest = _CHUNK_HEAD.unpack(raw[:_CHUNK_HEAD.size])
    if magic != CHUNK_MAGIC:
        raise ChunkFormatError("not a kvtier chunk file (bad magic)")
    if version != CHUNK_VERSION or header_bytes != CHUNK_HEADER_BYTES:
        raise ChunkFormatError(f"unsupported chunk format version {version}")
    if raw.nbytes < CHUNK_HEADER_BYTES:
        raise ChunkFormatError(f"header truncated ({raw.nbytes} of {CHUNK_HEADER_BYTES} bytes)")
    if xxhash.xxh3_64_digest(raw[:_CHUNK_HEAD.size]) != raw[_CHUNK_HEAD.size:_CHUNK_SUMMED]:
        raise ChunkFormatError("header checksum mismatch")
    if bytes(raw[_CHUNK_RESERVED:CHUNK_HEADER_BYTES]) != _CHUNK_ZEROS:  # a copy compares with memcmp
        raise ChunkFormatError("reserved header bytes are not zero")
    return ChunkFileHeader(namespace, key, length, digest, bytes(raw[CHUNK_TENANT_OFFSET:_CHUNK_RESERVED]))


class ValueHeader(NamedTuple):
    """A shared value's (version 1 or 2) header fields; ``record`` is ``None`` for version 1."""

    version: int
    kind: int
    namespace: bytes
    key: bytes
    length: int
    header_bytes: int
    record: bytes | None


def decode_value_header(raw: bytes | memoryview) -> ValueHeader:
    """The fields of a version-1 or -2 shared value header (nothing verified: the digest covers
    the payload too).

    Raises:
        ChunkFormatError: short, another magic or version, a non-zero reserved byte or an unknown
            digest kind.
    """
    if len(raw) < VALUE_V1_HEADER_BYTES:
        raise ChunkFormatError(f"value truncated ({len(raw)} bytes, header alone is {VALUE_V1_HEADER_BYTES})")
    magic, version, kind, reserved, namespace, key, length = _VALUE_FIELDS.unpack_from(raw)
    if magic != VALUE_MAGIC or version not in (VALUE_V1, VALUE_V2) or reserved or kind not in (0, 1):
        raise ChunkFormatError("not a kvtier value of a known format version")
    if version == VALUE_V1:
        return ValueHeader(version, kind, namespace, key, length, VALUE_V1_HEADER_BYTES, None)
    if len(raw) < VALUE_V2_HEADER_BYTES:
        raise ChunkFormatError(f"value truncated ({len(raw)} bytes, header alone is {VALUE_V2_HEADER_BYTES})")
    record = bytes(raw[VALUE_RECORD_OFFSET:VALUE_RECORD_OFFSET + RECORD_BYTES])
    return ValueHeader(version, kind, namespace, key, length, VALUE_V2_HEADER_BYTES, record)


def value_digest_ok(value: memoryview, header_bytes: int, mac_key: bytes | None) -> bool:
    """Whether a version-1/-2 value's digest (the last 16 header bytes) matches the bytes before it
    and its payload: XXH3-128, or keyed BLAKE3-128 with ``mac_key``."""
    covered = header_bytes - VALUE_DIGEST_BYTES
    if mac_key is None:
        h = xxhash.xxh3_128(value[:covered])
        h.update(value[header_bytes:])
        expect = h.digest()
    else:
        mac = blake3.blake3(value[:covered], key=mac_key)
        mac.update(value[header_bytes:])
        expect = mac.digest(VALUE_DIGEST_BYTES)
    return hmac.compare_digest(expect, bytes(value[covered:header_bytes]))
