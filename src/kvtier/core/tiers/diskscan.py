"""Finding chunk files in the disk tier's directory that another process wrote or removed.

The disk tier's index is rebuilt from its directory at start; a process sharing the directory
(a ``kv_consumer`` next to a producer) learns of later files through
:meth:`~kvtier.core.tiers.disk.DiskTier.rescan`, which uses these pieces:

- :class:`ShardWatch` says which of the 256 shard directories changed since they were last
  listed, by their modification time (a directory's mtime changes when an entry is added,
  renamed in or removed; POSIX ``rename(2)``/``unlink(2)``).  An unchanged shard costs one
  ``stat``, so a round over an idle directory costs 256 ``stat`` calls, not a listing of every
  file.  A shard whose mtime is less than :data:`RACY_NS` old is listed again next round:
  timestamps come from a coarse clock (a few ms), so a change in the same tick as the listing
  would otherwise go unseen (the "racily clean" case git's index handles the same way).
- :func:`indexed_files` is the scan at start (every chunk file, oldest first; crash leftovers removed).
- :func:`chunk_names` lists one shard's chunk files by name only (no ``stat`` per file).
- :func:`header_bytes` reads and checks one file's header block (namespace, key, length
  against the file's size) before a file is adopted; its payload checksum is checked when it is
  read, as for every chunk, so a damaged payload is still a counted miss then.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.chunkfile import HEADER_BYTES, ChunkFormatError, decode_header

SUFFIX = ".kvc"
RACY_NS = 2_000_000_000
"""A shard directory modified less than this long ago (ns) is listed again on the next round."""


@dataclass
class RescanResult:
    """What one :meth:`~kvtier.core.tiers.disk.DiskTier.rescan` round did.

    Attributes:
        adopted: keys of valid files now in the index (written by another process).
        gone: keys dropped from the index because their files were removed.
        corrupt: files whose header failed the checks (counted in the tier's ``corrupt``, removed).
        shards_listed: shard directories listed (the others had not changed).
        more: the round stopped at its bound of new files; the next one continues.
    """

    adopted: list[ChunkKey] = field(default_factory=list)
    gone: list[ChunkKey] = field(default_factory=list)
    corrupt: int = 0
    shards_listed: int = 0
    more: bool = False


class ShardWatch:
    """Modification times of the shard directories ``root/00`` … ``root/ff`` as last listed."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._seen: dict[int, int] = {}

    def changed(self) -> list[tuple[int, str, int]]:
        """``(shard, path, mtime_ns)`` of each shard directory not listed since its last change."""
        out = []
        for shard in range(256):
            path = f"{self.root}{os.sep}{shard:02x}"
            try:
                mtime = os.stat(path).st_mtime_ns
            except OSError:
                continue
            if self._seen.get(shard) != mtime:
                out.append((shard, path, mtime))
        return out

    def listed(self, shard: int, mtime_ns: int) -> None:
        """Shard ``shard`` was listed completely at modification time ``mtime_ns``."""
        if time.time_ns() - mtime_ns >= RACY_NS:
            self._seen[shard] = mtime_ns
        else:
            self._seen.pop(shard, None)

    def forget(self) -> None:
        """List every shard on the next round (the directory was recreated)."""
        self._seen.clear()


def indexed_files(directory: Path, key_bytes: int, stale_tmp_s: float) -> list[tuple[ChunkKey, int]]:
    """``(key, file bytes)`` of every chunk file under ``directory``, oldest first (by mtime).

    Only regular files named ``<key hex[:2]>/<key hex>.kvc`` are chunks; anything else is not ours
    to count.  Temporary files (``*.tmp``) older than ``stale_tmp_s`` are crash leftovers and are
    removed (a fresh one may belong to a live process sharing the directory).
    """
    found: list[tuple[float, ChunkKey, int]] = []
    for sub in directory.iterdir() if directory.exists() else ():
        if not sub.is_dir():
            continue
        for entry in os.scandir(sub):
            if entry.name.endswith(".tmp"):
                try:
                    if time.time() - entry.stat().st_mtime > stale_tmp_s:
                        os.unlink(entry.path)
                except OSError:
                    pass
                continue
            name = entry.name[:-len(SUFFIX)]
            if not entry.name.endswith(SUFFIX) or name[:2] != sub.name or len(name) != 2 * key_bytes:
                continue
            try:
                key = ChunkKey(bytes.fromhex(name))
                st = entry.stat(follow_symlinks=False)
            except (ValueError, OSError):
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime, key, st.st_size))
    found.sort(key=lambda item: item[0])  # the store's policy sees them in that order
    return [(key, size) for _mtime, key, size in found]


def chunk_names(path: str, shard: int, key_bytes: int) -> set[ChunkKey]:
    """Keys of the files named ``<key hex>.kvc`` in shard directory ``path`` (names only)."""
    prefix = f"{shard:02x}"
    keys: set[ChunkKey] = set()
    try:
        entries = os.scandir(path)
    except OSError:
        return keys
    with entries:
        for entry in entries:
            name = entry.name
            if not name.endswith(SUFFIX) or len(name) != 2 * key_bytes + len(SUFFIX) or not name.startswith(prefix):
                continue
            try:
                keys.add(ChunkKey(bytes.fromhex(name[:-len(SUFFIX)])))
            except ValueError:
                continue
    return keys


def header_bytes(path: str, namespace: bytes, key: ChunkKey) -> int:
    """Size in bytes of the chunk file at ``path`` once its header block checks out.

    Raises:
        ChunkFormatError: not a regular file, or a header that is short, of another format,
            namespace or key, or whose length disagrees with the file's size.
        FileNotFoundError: the file was removed meanwhile.
        OSError: it cannot be read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ChunkFormatError("not a regular file")
        header = decode_header(os.pread(fd, HEADER_BYTES, 0))
    finally:
        os.close(fd)
    if header.namespace != namespace or header.key != key:
        raise ChunkFormatError("chunk belongs to another namespace or key")
    if header.length != st.st_size - HEADER_BYTES:
        raise ChunkFormatError(f"payload is {st.st_size - HEADER_BYTES} bytes on disk, header says {header.length}")
    return int(st.st_size)
