"""On-disk encoding of one chunk: a fixed header block followed by the payload.

Layout (little-endian), format version 2: a 4096-byte header block, then ``length`` bytes of
payload starting at offset 4096.  The header block holds::

    offset  size  field
    0       4     magic  b"KVTC"
    4       2     format version (2)
    6       2     header block size (4096)
    8       16    namespace digest
    24      16    chunk key
    40      8     payload length, bytes
    48      16    XXH3-128 of the payload
    64      8     XXH3-64 of bytes 0..63 (header checksum)
    72      128   tenant record (:mod:`kvtier.core.tenant`; zero when unknown), not covered by
                  the header checksum: it has its own
    200     3896  reserved (zero)

The payload starts on a 4096-byte boundary so that it can be read and written with ``O_DIRECT``
straight into and out of page-aligned buffers (the cpu tier's pages); 4096 bytes is the largest
logical block size of common NVMe and SATA devices (Linux ``/sys/block/*/queue/logical_block_size``).

Version 1 (an 80-byte header, payload at offset 80) is no longer read: such a file fails
:func:`decode_header` with "unsupported chunk format version 1", which the disk tier counts as a
miss (and removes), never as an error.

Encoding is separate from placement (:mod:`kvtier.core.tiers.disk` decides where files live and
how they are read), as python-diskcache separates ``Disk`` from ``Cache``.  XXH3 is used for
checksums because it runs faster than the page cache delivers bytes; its streaming form
(:class:`PayloadHasher`) gives the same digest as the one-shot form, so a payload can be hashed
slice by slice while the next slice is read or written.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from kvtier.core.errors import ChunkFormatError

MAGIC = b"KVTC"
VERSION = 2
HEADER_BYTES = 4096
"""Bytes of the header block = offset of the payload in the file."""
_HEAD = struct.Struct("<4sHH16s16sQ16s")  # 64 bytes, covered by the header checksum
_SUMMED = _HEAD.size + 8
TENANT_OFFSET = _SUMMED
"""Offset of the tenant record in the header block (:mod:`kvtier.core.tenant`)."""
TENANT_BYTES = 128
"""Bytes kept for the tenant record (offsets 72..199); the record itself may be shorter."""
_RESERVED = TENANT_OFFSET + TENANT_BYTES
_ZEROS = bytes(HEADER_BYTES - _RESERVED)
_NO_TENANT = bytes(TENANT_BYTES)
PayloadHasher = xxhash.xxh3_128
"""Streaming XXH3-128: ``h = PayloadHasher(); h.update(slice); ...; h.digest()``."""


class ChunkHeader(NamedTuple):
    """Decoded header fields."""

    version: int
    namespace: bytes
    key: bytes
    length: int
    payload_digest: bytes
    tenant: bytes = _NO_TENANT
    """The :data:`TENANT_BYTES` of the tenant record area (all zero: unknown)."""


def payload_digest(payload: memoryview | bytes) -> bytes:
    """XXH3-128 digest of ``payload`` (16 bytes); equal to a :class:`PayloadHasher` fed the same bytes."""
    return xxhash.xxh3_128_digest(payload)


def encode_header(namespace: bytes, key: bytes, length: int, digest: bytes, tenant: bytes = b"") -> bytes:
    """The 4096-byte header block for a payload of ``length`` bytes whose XXH3-128 is ``digest``,
    with the tenant record ``tenant`` (at most :data:`TENANT_BYTES`; ``b""``: unknown)."""
    if len(tenant) > TENANT_BYTES:
        raise ValueError(f"tenant record of {len(tenant)} bytes exceeds {TENANT_BYTES}")
    head = _HEAD.pack(MAGIC, VERSION, HEADER_BYTES, namespace, key, length, digest)
    return head + xxhash.xxh3_64_digest(head) + tenant + bytes(TENANT_BYTES - len(tenant)) + _ZEROS


def decode_header(raw: bytes | memoryview) -> ChunkHeader:
    """Parse and verify a header block (``raw`` holds at least :data:`HEADER_BYTES` bytes).

    Raises:
        ChunkFormatError: short, wrong magic, unknown version (including version 1 files),
            header checksum mismatch, or non-zero reserved bytes.
    """
    raw = memoryview(raw)
    if raw.nbytes < _HEAD.size:
        raise ChunkFormatError(f"header truncated ({raw.nbytes} of {HEADER_BYTES} bytes)")
    magic, version, header_bytes, namespace, key, length, digest = _HEAD.unpack(raw[:_HEAD.size])
    if magic != MAGIC:
        raise ChunkFormatError("not a kvtier chunk file (bad magic)")
    if version != VERSION or header_bytes != HEADER_BYTES:
        raise ChunkFormatError(f"unsupported chunk format version {version}")
    if raw.nbytes < HEADER_BYTES:
        raise ChunkFormatError(f"header truncated ({raw.nbytes} of {HEADER_BYTES} bytes)")
    if xxhash.xxh3_64_digest(raw[:_HEAD.size]) != raw[_HEAD.size:_SUMMED]:
        raise ChunkFormatError("header checksum mismatch")
    if bytes(raw[_RESERVED:HEADER_BYTES]) != _ZEROS:  # a copy compares with memcmp: 15x faster than memoryview ==
        raise ChunkFormatError("reserved header bytes are not zero")
    return ChunkHeader(version, namespace, key, length, digest, bytes(raw[TENANT_OFFSET:_RESERVED]))
