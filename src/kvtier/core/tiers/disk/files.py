"""One chunk file of the disk tier read and checked against its envelope, or written as one.

A file is a value envelope (:mod:`kvtier.core.envelope`) whose header is padded to
:data:`~kvtier.core.tiers.disk.chunkfile.HEADER_BYTES`, or a legacy version-2 chunk file
(:mod:`kvtier.core.legacyformats`); the bytes move through a
:class:`~kvtier.core.tiers.disk.chunkio.ChunkIO`, which hashes them while they move.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np

from kvtier.core import envelope
from kvtier.core.keys import ChunkKey
from kvtier.core.tenant import Writer
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES, ChunkFormatError, PayloadHasher
from kvtier.core.tiers.disk.chunkio import ChunkIO


def read_verified(io: ChunkIO, env: envelope.Envelope, key: ChunkKey, path: str, dst: memoryview) -> bytes | None:
    """Read ``key``'s payload from the file at ``path`` into ``dst`` (its length is the chunk's).

    Returns:
        the tenant record of the file's header (``None``: none recorded), for
        :func:`kvtier.core.tenant.note_verified`.

    Raises:
        ChunkFormatError: unless every check passes (a regular file, an envelope of this
            namespace, key and length with a length-preserving codec chain, the payload's digest).
        OSError: the file cannot be opened or read (``FileNotFoundError``: it is gone).
    """
    record: bytes | None = None
    # O_NONBLOCK: a FIFO or device planted at a chunk's path must not hang the caller
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | io.open_flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ChunkFormatError("not a regular file")

        def check(raw: memoryview, payload_bytes: int) -> tuple[bytes, envelope.Hasher]:
            nonlocal record
            header = envelope.decode_header(raw)
            if header.header_bytes != HEADER_BYTES or header.format not in (envelope.FORMAT,
                                                                            envelope.FORMAT_CHUNK_FILE):
                raise ChunkFormatError(f"not a chunk file ({header.format}, {header.header_bytes}-byte header)")
            # another namespace or key, a layout or codec this kvtier does not read, or another
            # chunk size (config, geometry): never a partial fill
            env.check(header, key, out.nbytes)
            if header.stored_bytes != payload_bytes:
                raise ChunkFormatError(f"payload is {payload_bytes} bytes on disk, header says {header.stored_bytes}")
            if header.stored_bytes != header.original_bytes:
                raise ChunkFormatError(f"codec chain {list(header.codecs)} changes the payload's length; "
                                       "the disk tier reads only length-preserving chains")
            record = header.record
            if header.format == envelope.FORMAT_CHUNK_FILE:
                return header.digest, PayloadHasher()
            return header.digest, env.hasher(raw[:envelope.DIGEST_OFFSET])

        out = memoryview(np.frombuffer(dst, dtype=np.uint8).data)
        if not io.read_chunk(fd, out, st.st_size, check):
            raise ChunkFormatError("payload checksum mismatch")
    finally:
        os.close(fd)
    return record


def write_file(io: ChunkIO, env: envelope.Envelope, key: ChunkKey, tmp: Path, payload: memoryview,
               writer: Writer | None, fsync: bool) -> None:
    """Write ``payload`` as ``key``'s envelope (``writer``'s tenant record in its header) to the new
    file ``tmp`` (created or truncated, mode 0644), fsynced when ``fsync``.

    Raises:
        OSError: the file cannot be created or written.
    """
    fields = env.fields(key, payload.nbytes, payload.nbytes, env.record(writer))

    def digest_of(body: memoryview) -> bytes:
        h = env.hasher(fields)
        h.update(body)
        return h.digest()

    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | io.open_flags, 0o644)
    try:
        io.write_chunk(fd, payload, lambda digest: env.finish(fields, digest), digest_of)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
