"""The disk tier's chunk file: the value envelope (:mod:`kvtier.core.envelope`) with its header
padded to a 4096-byte block, then the payload.

A file is ``HEADER_BYTES`` (4096) of header block, the envelope's 128 header bytes followed by
zero padding, then the stored payload from offset 4096: the payload starts on a 4096-byte boundary
so that it can be read and written with ``O_DIRECT`` straight into and out of page-aligned
buffers (the cpu tier's pages); 4096 bytes is the largest logical block size of common NVMe and
SATA devices (Linux ``/sys/block/*/queue/logical_block_size``).  The envelope's digest (XXH3-128
of its header fields and the payload) is computed while the bytes move
(:mod:`kvtier.core.tiers.disk.chunkio`).

Files the release before the envelope wrote (chunk file version 2, magic ``b"KVTC"``, the same
4096-byte header block and payload offset, :mod:`kvtier.core.legacyformats`) are still read and
verified; version 1 files (an 80-byte header) are refused as "unsupported chunk format version 1",
a counted miss (and removed).

:func:`decode_header` reads either kind of header block (the disk tier's rescan, ``kvtier purge``);
:func:`encode_header` writes only a legacy version-2 block, for read-compatibility tests.
"""

from __future__ import annotations

from typing import NamedTuple

import xxhash

from kvtier.core import envelope, legacyformats
from kvtier.core.errors import ChunkFormatError

__all__ = ["HEADER_BYTES", "VERSION", "ChunkFormatError", "ChunkHeader", "PayloadHasher", "decode_header",
           "encode_header", "payload_digest"]

MAGIC = legacyformats.CHUNK_MAGIC
VERSION = legacyformats.CHUNK_VERSION
"""The last chunk-file format version (2).  It stays 2 under the envelope: it is folded into the
namespace identity (:mod:`kvtier.integrations.vllm.identity`), and the envelope names its own
version, so changing it would orphan every stored file rather than read it."""
HEADER_BYTES = envelope.DISK_HEADER_BYTES
"""Bytes of the header block = offset of the payload in the file (4096, both formats)."""
assert HEADER_BYTES == legacyformats.CHUNK_HEADER_BYTES
TENANT_OFFSET = envelope.RECORD_OFFSET
"""Offset of the tenant record in the header block this kvtier writes (an envelope's)."""
LEGACY_TENANT_OFFSET = legacyformats.CHUNK_TENANT_OFFSET
"""Offset of the tenant record in a version-2 chunk file's header block (72)."""
PayloadHasher = xxhash.xxh3_128
"""Streaming XXH3-128 (a version-2 file's payload digest): ``h = PayloadHasher(); h.update(slice); h.digest()``."""


class ChunkHeader(NamedTuple):
    """Decoded header fields of a chunk file of either format.

    Attributes:
        version: 2 for a legacy chunk file; ``0x100 + envelope version`` for an envelope.
        namespace / key: 16-byte namespace digest and chunk key.
        length: payload bytes as stored in the file.
        payload_digest: the stored digest (a legacy file: of the payload alone; an envelope: of
            its header fields and the payload).
        tenant: the tenant record (all zero: unknown).
    """

    version: int
    namespace: bytes
    key: bytes
    length: int
    payload_digest: bytes
    tenant: bytes = bytes(legacyformats.CHUNK_TENANT_BYTES)


def payload_digest(payload: memoryview | bytes) -> bytes:
    """XXH3-128 digest of ``payload`` (16 bytes); equal to a :class:`PayloadHasher` fed the same bytes."""
    return xxhash.xxh3_128_digest(payload)


def encode_header(namespace: bytes, key: bytes, length: int, digest: bytes, tenant: bytes = b"") -> bytes:
    """A legacy version-2 header block (no tier writes one any more: for read-compatibility tests)."""
    return legacyformats.encode_chunk_header(namespace, key, length, digest, tenant)


def decode_header(raw: bytes | memoryview) -> ChunkHeader:
    """Parse and check a chunk file's header block, envelope or legacy version 2 (``raw`` holds at
    least :data:`HEADER_BYTES` bytes).

    Raises:
        ChunkFormatError: short, wrong magic, unknown version (including version 1 files), a
            legacy header checksum mismatch, non-zero reserved or padding bytes, or an envelope
            whose payload does not start at :data:`HEADER_BYTES`.
    """
    view = memoryview(raw).cast("B")
    if view.nbytes < HEADER_BYTES and bytes(view[:4]) == envelope.MAGIC:
        raise ChunkFormatError(f"header truncated ({view.nbytes} of {HEADER_BYTES} bytes)")
    head = envelope.decode_header(view)
    if head.format == envelope.FORMAT_CHUNK_FILE:
        return ChunkHeader(VERSION, head.namespace, head.key, head.stored_bytes, head.digest,
                           bytes(view[LEGACY_TENANT_OFFSET:LEGACY_TENANT_OFFSET + legacyformats.CHUNK_TENANT_BYTES]))
    if head.format != envelope.FORMAT:
        raise ChunkFormatError("not a kvtier chunk file (bad magic)")
    if head.header_bytes != HEADER_BYTES:
        raise ChunkFormatError(f"envelope header of {head.header_bytes} bytes, a chunk file's is {HEADER_BYTES}")
    return ChunkHeader(0x100 + envelope.VERSION, head.namespace, head.key, head.stored_bytes, head.digest,
                       head.record or b"")
