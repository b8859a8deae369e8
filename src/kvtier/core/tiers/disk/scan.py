"""Finding chunk files in the disk tier's directory that another process wrote or removed.

The disk tier's index is rebuilt from its directory at start; a process sharing the directory
(a ``kv_consumer`` next to a producer) learns of later files through
:meth:`~kvtier.core.tiers.disk.tier.DiskTier.rescan`, which uses these pieces:

- :class:`ShardWatch` says which of the 256 shard directories changed since they were last
  listed, by their modification time (a directory's mtime changes when an entry is added,
  renamed in or removed; POSIX ``rename(2)``/``unlink(2)``).  An unchanged shard costs one
  ``stat``, so a round over an idle directory costs 256 ``stat`` calls, not a listing of every
  file.  A shard whose mtime is less than :data:`RACY_NS` old is listed again next round:
  timestamps come from a coarse clock (a few ms), so a change in the same tick as the listing
  would otherwise go unseen (the "racily clean" case git's index handles the same way).
- :func:`indexed_files` is the scan at start (every chunk file, oldest first; crash leftovers removed).
- :func:`chunk_names` lists one shard's chunk files by name only (no ``stat`` per file), and the
  temporary files in it.
- :class:`WriterLock` and :func:`writer_alive` tell a temporary file of a live writer from one a
  crashed writer left: every writing process holds an exclusive ``flock(2)`` on its own lock file
  ``.writers/<writer id>.lock`` for its whole life, and names its temporary files
  ``<key hex>.kvc.<writer id>.<thread>.tmp``.  The kernel drops the lock when the process dies,
  however it dies (SIGKILL included), so a lock file that can be locked belongs to a dead writer
  and its temporary files are removed at once, whatever their age (PIDs are reused and differ
  between containers sharing a directory; a lock is neither).  A temporary file whose writer has
  no lock file (written by an older kvtier) is removed once older than ``stale_tmp_s``.
- :func:`header_bytes` reads and checks one file's header block (namespace, key, length
  against the file's size) before a file is adopted, and the master key id of an encrypted one
  (:mod:`kvtier.core.keyids`: a file sealed under a key this process does not hold is not adopted,
  and left in place); its payload checksum is checked when it is read, as for every chunk, so a
  damaged payload is still a counted miss then.  :func:`sealed_key_id` reads that key id alone
  (the start-up scan of a tier with a key ring).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from kvtier.core import keyids
from kvtier.core.encryption import KEY_ID_BYTES
from kvtier.core.errors import length_problem
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES, ChunkFormatError, decode_header

SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
WRITERS_DIR = ".writers"
"""Directory (inside a namespace directory) of the writers' lock files."""
RACY_NS = 2_000_000_000
"""A shard directory modified less than this long ago (ns) is listed again on the next round."""


@dataclass
class RescanResult:
    """What one :meth:`~kvtier.core.tiers.disk.tier.DiskTier.rescan` round did.

    Attributes:
        adopted: keys of valid files now in the index (written by another process).
        gone: keys dropped from the index because their files were removed.
        corrupt: files whose header failed the checks (counted in the tier's ``corrupt``, removed).
        shards_listed: shard directories listed (the others had not changed).
        more: the round stopped at its bound of new files; the next one continues.
        dead_tmp_removed: temporary files of crashed writers removed.
        found: ``(key, file bytes)`` of header-checked files :meth:`~kvtier.core.tiers.disk.tier.DiskTier.scan`
            found, oldest first, that :meth:`~kvtier.core.tiers.disk.tier.DiskTier.adopt` has still to index.
        missing: indexed keys whose files the scan did not find (forgotten by ``adopt``).
        generation: the tier's generation when the scan started (``adopt`` drops a stale scan).
        sealed_away: ``(key, master key id)`` of header-checked files sealed under a key this
            process's ring does not hold: ``adopt`` remembers them (not indexed, left in place) and
            counts each once as a decrypt failure.
        sealed_gone: remembered such keys whose files the scan did not find (forgotten by ``adopt``).
    """

    adopted: list[ChunkKey] = field(default_factory=list)
    gone: list[ChunkKey] = field(default_factory=list)
    corrupt: int = 0
    shards_listed: int = 0
    more: bool = False
    dead_tmp_removed: int = 0
    found: list[tuple[ChunkKey, int]] = field(default_factory=list)
    missing: list[ChunkKey] = field(default_factory=list)
    generation: int = 0
    sealed_away: list[tuple[ChunkKey, bytes]] = field(default_factory=list)
    sealed_gone: list[ChunkKey] = field(default_factory=list)


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


def chunk_entries(directory: Path, key_bytes: int, problem: Callable[[str], None]) -> Iterator[os.DirEntry[str]]:
    """Every chunk file ``<key hex>.kvc`` in the 256 shard directories of namespace directory
    ``directory`` (names of another length or suffix are skipped; a missing shard is empty); a
    shard that cannot be listed is passed to ``problem`` as one sentence and skipped."""
    name_len = 2 * key_bytes + len(SUFFIX)
    for shard in range(256):
        try:
            entries = os.scandir(directory / f"{shard:02x}")
        except FileNotFoundError:
            continue
        except OSError as exc:
            problem(f"cannot list {directory / f'{shard:02x}'} ({exc.strerror})")
            continue
        with entries:
            for entry in entries:
                if len(entry.name) == name_len and entry.name.endswith(SUFFIX):
                    yield entry


def indexed_files(directory: Path, key_bytes: int, stale_tmp_s: float) -> tuple[list[tuple[ChunkKey, int]], int]:
    """``(key, file bytes)`` of every chunk file under ``directory``, oldest first (by mtime), and
    the number of crash leftovers removed.

    Only regular files named ``<key hex[:2]>/<key hex>.kvc`` are chunks; anything else is not ours
    to count.  Temporary files (``*.tmp``) of a dead writer are removed at once; those of a writer
    without a lock file once older than ``stale_tmp_s`` (see :func:`writer_alive`); those of a live
    writer (another process sharing the directory) are left to it.
    """
    found: list[tuple[float, ChunkKey, int]] = []
    liveness: dict[str, bool | None] = {}
    removed = 0
    for sub in directory.iterdir() if directory.exists() else ():
        if len(sub.name) != 2 or not sub.is_dir():
            continue
        for entry in os.scandir(sub):
            if entry.name.endswith(TMP_SUFFIX):
                removed += remove_if_dead(directory, entry.path, liveness, stale_tmp_s)
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
    return [(key, size) for _mtime, key, size in found], removed


def tmp_name(final_name: str, writer_id: str, thread_id: int) -> str:
    """Name of the temporary file a writer writes ``final_name`` into."""
    return f"{final_name}.{writer_id}.{thread_id}{TMP_SUFFIX}"


def tmp_writer(name: str) -> str | None:
    """The writer id in a temporary file's name (``<key hex>.kvc.<writer id>.<thread>.tmp``)."""
    parts = name.split(".")
    return parts[2] if len(parts) == 5 and parts[1] == SUFFIX[1:] and parts[4] == TMP_SUFFIX[1:] else None


class WriterLock:
    """This process's writer identity in one namespace directory: an exclusive ``flock`` on
    ``.writers/<writer id>.lock`` held until :meth:`release` or the process's death.

    Raises:
        OSError: the lock file cannot be created.
    """

    def __init__(self, directory: Path) -> None:
        writers = directory / WRITERS_DIR
        writers.mkdir(exist_ok=True)
        self.writer_id = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path = writers / f"{self.writer_id}.lock"
        # read-only: flock needs no write access, and a file open for writing would block a remount read-only
        self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def release(self) -> None:
        """Drop the lock and its file (idempotent; temporary files written later count as a
        lock-less writer's)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)


def writer_alive(directory: Path, writer_id: str) -> bool | None:
    """Whether the writer ``writer_id`` still runs: ``True`` while its lock file is locked,
    ``False`` once it can be locked (the writer died; its lock file is then removed), ``None``
    when it has no lock file (an older kvtier's writer, or one already found dead)."""
    path = directory / WRITERS_DIR / f"{writer_id}.lock"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:
        return True  # cannot tell: never remove what a live writer may be writing
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EWOULDBLOCK: held by its live writer; anything else: cannot tell, so alive
            return True
        try:
            os.unlink(path)
        except OSError:
            pass
        return False
    finally:
        os.close(fd)


DEAD_LOCK_MIN_AGE_S = 60.0
"""A writer's lock file younger than this is left alone by :func:`remove_dead_writer_locks`: it may be a new
writer's, created and not locked yet (:class:`WriterLock` creates the file, then locks it)."""


def remove_dead_writer_locks(directory: Path, min_age_s: float = DEAD_LOCK_MIN_AGE_S) -> int:
    """Remove the lock files (``.writers/<writer id>.lock``, at least ``min_age_s`` old) of writers that
    died; returns how many.  A dead writer's lock file is otherwise removed only when one of its temporary
    files is found (:func:`remove_if_dead`), so each SIGKILLed, OOM-killed or crashed process that was
    not mid-write would leave its own for good.  Run after the start-up scan removed the dead writers'
    temporary files, so no temporary file loses the lock file that tells it is dead."""
    removed = 0
    now = time.time()
    try:
        entries = list(os.scandir(directory / WRITERS_DIR))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.endswith(".lock"):
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime < min_age_s:
                continue
        except OSError:
            continue
        removed += writer_alive(directory, entry.name[:-len(".lock")]) is False
    return removed


def remove_if_dead(directory: Path, path: str, liveness: dict[str, bool | None], stale_tmp_s: float) -> int:
    """Remove the temporary file ``path`` if its writer is dead (or lock-less and the file older
    than ``stale_tmp_s``); 1 if removed.  ``liveness`` caches :func:`writer_alive` per writer id."""
    writer = tmp_writer(os.path.basename(path))
    alive = None
    if writer is not None:
        if writer not in liveness:
            liveness[writer] = writer_alive(directory, writer)
        alive = liveness[writer]
    try:
        if alive is False or (alive is None and time.time() - os.stat(path).st_mtime > stale_tmp_s):
            os.unlink(path)
            return 1
    except OSError:
        pass
    return 0


def chunk_names(path: str, shard: int, key_bytes: int) -> tuple[set[ChunkKey], list[str]]:
    """Keys of the files named ``<key hex>.kvc`` in shard directory ``path`` (names only), and the
    paths of the temporary files there."""
    prefix = f"{shard:02x}"
    keys: set[ChunkKey] = set()
    tmps: list[str] = []
    try:
        entries = os.scandir(path)
    except OSError:
        return keys, tmps
    with entries:
        for entry in entries:
            name = entry.name
            if name.endswith(TMP_SUFFIX):
                tmps.append(entry.path)
                continue
            if not name.endswith(SUFFIX) or len(name) != 2 * key_bytes + len(SUFFIX) or not name.startswith(prefix):
                continue
            try:
                keys.add(ChunkKey(bytes.fromhex(name[:-len(SUFFIX)])))
            except ValueError:
                continue
    return keys, tmps


class FileHead(NamedTuple):
    """What :func:`header_bytes` found of one chunk file.

    Attributes:
        size: the file's bytes.
        mtime: its modification time, s.
        key_id: the master key id of an encrypted file (:func:`kvtier.core.keyids.key_id_of`),
            ``None`` for a file that is not encrypted.
    """

    size: int
    mtime: float
    key_id: bytes | None


HEAD_READ_BYTES = HEADER_BYTES + KEY_ID_BYTES
"""Bytes read of a chunk file to check it before adopting it: the header block and the key id."""


def _head(fd: int) -> bytes:
    """The header block and an encrypted payload's key id (:data:`HEAD_READ_BYTES`; fewer at a short file's end)."""
    return os.pread(fd, HEAD_READ_BYTES, 0)


def header_bytes(path: str, namespace: bytes, key: ChunkKey) -> FileHead:
    """Size in bytes, modification time (s) and master key id (encrypted files) of the chunk file
    at ``path`` once its header block checks out.

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
        raw = _head(fd)
        header = decode_header(raw)
    finally:
        os.close(fd)
    if header.namespace != namespace or header.key != key:
        raise ChunkFormatError("chunk belongs to another namespace or key")
    if problem := length_problem(int(st.st_size), HEADER_BYTES, header.length, "the chunk file"):
        raise ChunkFormatError(problem)
    return FileHead(int(st.st_size), st.st_mtime, keyids.key_id_of(raw))


def sealed_key_id(path: str) -> bytes | None:
    """The master key id of the encrypted chunk file at ``path`` (its header block and the first
    bytes of its payload, nothing verified), ``None`` when it is not an encrypted envelope or
    cannot be read (a damaged file is then found, counted and removed by its first read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        return keyids.key_id_of(_head(fd))
    except OSError:
        return None
    finally:
        os.close(fd)
