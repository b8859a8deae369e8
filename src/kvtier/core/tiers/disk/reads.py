"""The disk tier's reads off a hit's path: whole chunk files of any length (``get``,
``read_into``: the blob verbs), files whose codec chain changes the payload (read whole, then
decoded), and ranged reads of a payload (``get_range``).

:class:`DiskReads` is that part of :class:`~kvtier.core.tiers.disk.tier.DiskTier`, over the state
the tier holds (declared here; the tier sets it).  The fixed-length read a hit runs
(``get_into``) and the verified read under all of these (``_read``, :func:`~kvtier.core.tiers.disk.tier.read_chunk`)
are in :mod:`kvtier.core.tiers.disk.tier`.

- A whole read (:meth:`DiskReads.read_into`, :meth:`DiskReads.get`) checks the header (an
  envelope, or a legacy version-2 chunk file), the file's size against it, and the digest over
  header fields and payload, computed while the bytes move.  A file that fails is counted in
  ``corrupt``, logged and removed: ``None``.
- A ranged read (:meth:`DiskReads.get_range`) reads the header block and then only the range,
  with ``pread`` at the payload's offset (4096) plus ``offset``, buffered (a range is rarely
  block-aligned).  The header is checked as in a whole read (and a file that fails is removed),
  but **the range's bytes are not verified**: the digest covers the whole payload and envelope
  version 1 has no per-range digest (:mod:`kvtier.core.tiers.valueread`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from kvtier.core import envelope
from kvtier.core.envelope import note_verified
from kvtier.core.errors import length_problem
from kvtier.core.keys import ChunkKey
from kvtier.core.tenant import TenantRecords
from kvtier.core.tiers.base import GetResult
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES, ChunkFormatError
from kvtier.core.tiers.disk.recoded import read_recoded
from kvtier.core.tiers.valueread import check_range, payload_range

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class DiskReads:
    """The variable-length and ranged reads of a :class:`~kvtier.core.tiers.disk.tier.DiskTier` (see
    the module docstring)."""

    namespace: bytes
    envelope: envelope.Envelope
    _bad: set[ChunkKey]
    _sealed_away: set[ChunkKey]
    # declared, not defined: the tier's (kvtier.core.tiers.disk.tier and .files)
    _file: Callable[[ChunkKey], str]
    _quarantine: Callable[[ChunkKey, Path, str], None]
    _read: Callable[[ChunkKey, memoryview | None, TenantRecords | None, bool], GetResult | memoryview]

    def read_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> int | None:
        """The verified payload of any length into ``dst[:length]``; its length, or ``None``.

        Raises:
            BufferTooSmall: ``dst`` is shorter than the file's payload (nothing read).
        """
        got = self._read(key, dst, records, False)
        return None if isinstance(got, GetResult) else got.nbytes

    def get(self, key: ChunkKey, records: TenantRecords | None = None) -> bytes | None:
        """The verified payload of any length, or ``None``."""
        got = self._read(key, None, records, False)
        return None if isinstance(got, GetResult) else bytes(got)

    def _read_recoded(self, key: ChunkKey, path: str, file_bytes: int, dst: memoryview | None,
                      records: TenantRecords | None, exact: bool) -> memoryview:
        """A file whose codec chain changes the payload, read whole and decoded (:mod:`.recoded`)."""
        out, record = read_recoded(self.envelope, key, path, file_bytes, dst, exact)
        note_verified(records, self.namespace, key, record)
        return out

    def get_range(self, key: ChunkKey, offset: int, length: int) -> bytes | None:
        """``payload[offset:offset + length]`` (clipped at its end), the header checked and the
        bytes NOT verified (see the module docstring); ``None`` if absent or the header fails
        (the file is then removed, as on a whole read).

        Raises:
            ValueError: a negative ``offset`` or ``length``.
        """
        check_range(offset, length)
        if key in self._bad or key in self._sealed_away:
            return None
        path = self._file(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
        except OSError:  # absent (removed by another process), or not openable: a miss either way
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ChunkFormatError("not a regular file")
            header = envelope.decode_header(os.pread(fd, HEADER_BYTES, 0))
            if header.header_bytes != HEADER_BYTES:
                raise ChunkFormatError(f"not a chunk file ({header.format}, {header.header_bytes}-byte header)")
            if st.st_size != HEADER_BYTES + header.stored_bytes:
                raise ChunkFormatError(length_problem(st.st_size, HEADER_BYTES, header.stored_bytes, "the chunk file")
                                       or "")
            where = payload_range(self.envelope, header, key, offset, length)
            if where is None:  # a chain that changes the payload: the whole value, verified, sliced
                whole = self.get(key)
                return None if whole is None else whole[offset:offset + length]
            start, end = where
            got = os.pread(fd, end - start, start) if end > start else b""
            if len(got) != end - start:
                raise ChunkFormatError(f"file truncated ({len(got)} of {end - start} bytes of a range)")
            return got
        except (ChunkFormatError, OSError) as exc:
            self._quarantine(key, Path(path), str(exc))
            return None
        finally:
            os.close(fd)

