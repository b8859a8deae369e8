"""The disk tier's read of a chunk file whose codec chain changes the payload (compressed,
encrypted: issue 36): the whole file read into one buffer, then verified and decoded into the
caller's buffer by the envelope (:meth:`kvtier.core.envelope.Envelope.open_into`,
:func:`kvtier.core.tiers.valueread.open_value`).  Files of a passthrough chain never come here:
they move straight into the caller's buffer (:mod:`kvtier.core.tiers.disk.chunkio`).
"""

from __future__ import annotations

import os

from kvtier.core import envelope
from kvtier.core.errors import ChunkFormatError
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.core.tiers.valueread import open_value

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class Recoded(ChunkFormatError):
    """The file's codec chain changes its payload: read it with :func:`read_recoded`."""


def read_recoded(env: envelope.Envelope, key: ChunkKey, path: str, file_bytes: int, dst: memoryview | None,
                 exact: bool) -> tuple[memoryview, bytes | None]:
    """The verified, decoded payload of the chunk file at ``path`` (``file_bytes`` long) in ``dst``
    (``exact``: exactly the original length; else at least it, ``None``: a new buffer) and its
    tenant record.  Buffered I/O (the stored bytes go to the codec, not to the caller).

    Raises:
        ChunkFormatError: not an envelope chunk file, truncated, or the envelope refuses it
            (another namespace or key, a digest mismatch, a codec or decryption that fails).
        BufferTooSmall: not ``exact`` and ``dst`` is shorter than the payload.
        OSError: the read failed.
    """
    raw = memoryview(bytearray(file_bytes))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    try:
        got = os.preadv(fd, [raw], 0)
    finally:
        os.close(fd)
    if got != file_bytes:
        raise ChunkFormatError(f"file truncated ({got} of {file_bytes} bytes)")
    header = envelope.decode_header(raw)
    if header.format != envelope.FORMAT or header.header_bytes != HEADER_BYTES:
        raise ChunkFormatError(f"not a chunk file ({header.format}, {header.header_bytes}-byte header)")
    if exact:
        assert dst is not None
        out = memoryview(dst).cast("B")
        return out, env.open_into(key, raw, out)
    opened = open_value(env, key, raw, dst)
    return opened.payload, opened.record
