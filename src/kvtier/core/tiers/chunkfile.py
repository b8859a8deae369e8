"""On-disk encoding of one chunk: a fixed header followed by the payload.

Layout (little-endian), 80 bytes of header then ``length`` bytes of payload::

    offset  size  field
    0       4     magic  b"KVTC"
    4       2     format version (1)
    6       2     header size (80)
    8       16    namespace digest
    24      16    chunk key
    40      8     payload length, bytes
    48      16    XXH3-128 of the payload
    64      8     XXH3-64 of bytes 0..63 (header checksum)
    72      8     reserved (zero)

Encoding is separate from placement (:mod:`kvtier.core.tiers.disk` decides where files live),
as python-diskcache separates ``Disk`` from ``Cache``.  XXH3 is used for checksums because it
runs faster than the page cache delivers bytes, so verifying every load costs little.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from kvtier.core.errors import ChunkFormatError

MAGIC = b"KVTC"
VERSION = 1
_HEAD = struct.Struct("<4sHH16s16sQ16s")  # 64 bytes, covered by the header checksum
HEADER_BYTES = 80


class ChunkHeader(NamedTuple):
    """Decoded header fields."""

    version: int
    namespace: bytes
    key: bytes
    length: int
    payload_digest: bytes


def payload_digest(payload: memoryview | bytes) -> bytes:
    """XXH3-128 digest of ``payload`` (16 bytes)."""
    return xxhash.xxh3_128_digest(payload)


def encode_header(namespace: bytes, key: bytes, payload: memoryview | bytes) -> bytes:
    """The 80-byte header for ``payload`` (``len(payload)`` bytes) under ``namespace``/``key``."""
    head = _HEAD.pack(MAGIC, VERSION, HEADER_BYTES, namespace, key, memoryview(payload).nbytes,
                      payload_digest(payload))
    return head + xxhash.xxh3_64_digest(head) + bytes(8)


def decode_header(raw: bytes) -> ChunkHeader:
    """Parse and verify a header.

    Raises:
        ChunkFormatError: short, wrong magic, unknown version, or header checksum mismatch.
    """
    if len(raw) < HEADER_BYTES:
        raise ChunkFormatError(f"header truncated ({len(raw)} of {HEADER_BYTES} bytes)")
    head = raw[:_HEAD.size]
    magic, version, header_bytes, namespace, key, length, digest = _HEAD.unpack(head)
    if magic != MAGIC:
        raise ChunkFormatError("not a kvtier chunk file (bad magic)")
    if version != VERSION or header_bytes != HEADER_BYTES:
        raise ChunkFormatError(f"unsupported chunk format version {version}")
    if xxhash.xxh3_64_digest(head) != raw[_HEAD.size:_HEAD.size + 8]:
        raise ChunkFormatError("header checksum mismatch")
    if any(raw[_HEAD.size + 8:HEADER_BYTES]):
        raise ChunkFormatError("reserved header bytes are not zero")
    return ChunkHeader(version, namespace, key, length, digest)
