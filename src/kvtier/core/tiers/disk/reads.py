"""The disk tier's reads: whole chunk files verified while they move, of the length the caller
expects (``get_into``, the store's fixed-length path) or of any length (``get``, ``read_into``),
and ranged reads of a payload (``get_range``).

:class:`DiskReads` is that part of :class:`~kvtier.core.tiers.disk.tier.DiskTier`, over the state
the tier holds (declared here; the tier sets it).

- A whole read (:meth:`DiskReads.get_into`, :meth:`DiskReads.read_into`, :meth:`DiskReads.get`)
  checks the header (an envelope, or a legacy version-2 chunk file), the file's size against it,
  and the digest over header fields and payload, computed while the bytes move
  (:mod:`kvtier.core.tiers.disk.chunkio`).  A file that fails is counted in ``corrupt``, logged
  and removed: ``CORRUPT`` from ``get_into``, ``None`` from the others.
- A ranged read (:meth:`DiskReads.get_range`) reads the header block and then only the range,
  with ``pread`` at the payload's offset (4096) plus ``offset``, buffered (a range is rarely
  block-aligned).  The header is checked as in a whole read (and a file that fails is removed),
  but **the range's bytes are not verified**: the digest covers the whole payload and envelope
  version 1 has no per-range digest (:mod:`kvtier.core.tiers.valueread`).
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import numpy as np

from kvtier.core import codecs, envelope
from kvtier.core.errors import length_problem
from kvtier.core.keys import ChunkKey
from kvtier.core.tenant import TenantRecords, note_verified
from kvtier.core.tiers.base import GetResult
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES, ChunkFormatError, PayloadHasher
from kvtier.core.tiers.disk.chunkio import ChunkIO
from kvtier.core.tiers.disk.recoded import Recoded, read_recoded
from kvtier.core.tiers.valueread import check_range, check_room, payload_range

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class DiskReads:
    """The reading part of a :class:`~kvtier.core.tiers.disk.tier.DiskTier` (see the module docstring)."""

    namespace: bytes
    envelope: envelope.Envelope
    _io: ChunkIO
    _lock: threading.Lock
    _bad: set[ChunkKey]
    _sealed_away: set[ChunkKey]
    _writing: set[ChunkKey]

    def _file(self, key: ChunkKey) -> str:
        raise NotImplementedError

    def _forget(self, key: ChunkKey) -> None:
        raise NotImplementedError

    def _quarantine(self, key: ChunkKey, path: Path, reason: str) -> None:
        raise NotImplementedError

    def _fall_back(self, exc: OSError) -> bool:
        raise NotImplementedError

    def get_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> GetResult:
        got = self._read(key, dst, records, True)
        return got if isinstance(got, GetResult) else GetResult.HIT

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

    def _read(self, key: ChunkKey, dst: memoryview | None, records: TenantRecords | None,
              exact: bool) -> GetResult | memoryview:
        """:meth:`_read_verified` with the fall-back to buffered I/O; ``MISS``/``CORRUPT`` or the payload."""
        path = self._file(key)
        if key in self._bad or key in self._sealed_away:  # counted once already, when it was found unusable
            return GetResult.MISS
        try:
            try:
                return self._read_verified(key, path, dst, records, exact)
            except OSError as exc:
                if not self._fall_back(exc):
                    raise
                return self._read_verified(key, path, dst, records, exact)
        except envelope.ForeignValue:  # another engine's master key (counted by the envelope): a miss,
            with self._lock:           # the file kept for it, no longer indexed nor offered
                self._forget(key)
                self._sealed_away.add(key)
            return GetResult.MISS
        except FileNotFoundError:
            with self._lock:
                if key not in self._writing:  # removed by another process (a write in flight is not)
                    self._forget(key)
            return GetResult.MISS
        except (ChunkFormatError, OSError) as exc:
            self._quarantine(key, Path(path), str(exc))
            return GetResult.CORRUPT

    def _read_verified(self, key: ChunkKey, path: str, dst: memoryview | None, records: TenantRecords | None,
                       exact: bool) -> memoryview:
        """Read ``key``'s payload into ``dst`` (``exact``: exactly its length; else at least it, or
        a new buffer for ``None``) and return it; raises ChunkFormatError unless every check passes.
        The file is an envelope (:mod:`kvtier.core.envelope`) or a legacy version-2 chunk file
        (:mod:`kvtier.core.legacyformats`).  Then its tenant record goes into ``records``
        (:func:`kvtier.core.tenant.note_verified`: only one that passes its own check).

        Raises:
            BufferTooSmall: not ``exact`` and ``dst`` is shorter than the file's payload.
        """
        io = self._io
        record: bytes | None = None
        # O_NONBLOCK: a FIFO or device planted at a chunk's path must not hang the caller
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | io.open_flags)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ChunkFormatError("not a regular file")
            if not self.envelope.chain.passthrough or (exact and dst is not None and
                                                       st.st_size - HEADER_BYTES != dst.nbytes):
                return self._read_recoded(key, path, st.st_size, dst, records, exact)
            given = dst  # a file of another chain is decoded into the caller's buffer as given
            if not exact:  # a short file fails its header check below
                dst = check_room(max(st.st_size - HEADER_BYTES, 0), dst)

            def check(raw: memoryview, payload_bytes: int) -> tuple[bytes, envelope.Hasher]:
                nonlocal record
                header = envelope.decode_header(raw)
                if header.header_bytes != HEADER_BYTES or header.format not in (envelope.FORMAT,
                                                                                envelope.FORMAT_CHUNK_FILE):
                    raise ChunkFormatError(f"not a chunk file ({header.format}, {header.header_bytes}-byte header)")
                # another namespace or key, a layout or codec this kvtier does not read, or another
                # chunk size (config, geometry): never a partial fill
                self.envelope.check(header, key, out.nbytes if exact else None)
                if problem := length_problem(payload_bytes + header.header_bytes, header.header_bytes,
                                                      header.stored_bytes, "the chunk file"):
                    raise ChunkFormatError(problem)
                if header.stored_bytes != header.original_bytes or (
                        header.codecs != self.envelope.chain.ids and not codecs.chain_of(header.codecs).passthrough):
                    raise Recoded("its codec chain changes the payload")  # read whole, then decoded
                record = header.record
                if header.format == envelope.FORMAT_CHUNK_FILE:
                    return header.digest, PayloadHasher()
                return header.digest, self.envelope.hasher(raw[:envelope.DIGEST_OFFSET])

            assert dst is not None
            out = memoryview(np.frombuffer(dst, dtype=np.uint8).data)
            try:
                if not io.read_chunk(fd, out, st.st_size, check):
                    raise ChunkFormatError("payload checksum mismatch")
            except Recoded:  # written under another chain than this tier's (a config change)
                return self._read_recoded(key, path, st.st_size, given, records, exact)
        finally:
            os.close(fd)
        note_verified(records, self.namespace, key, record)
        return out[:st.st_size - HEADER_BYTES]

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
            if problem := length_problem(st.st_size, HEADER_BYTES, header.stored_bytes, "the chunk file"):
                raise ChunkFormatError(problem)
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
