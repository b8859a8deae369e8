"""Disk tier: one file per chunk under ``root/<namespace hex>/<key hex[:2]>/<key hex>.kvc``.

- **Crash-safe writes**: a chunk is written to a temporary file in the same directory and
  renamed into place (``os.replace`` is atomic on POSIX), so a reader never sees a half-written
  chunk under its final name; with ``fsync=True`` it is also durable across power loss.
- **Verified reads**: every file carries a header (format version, namespace, key, length) and
  an XXH3-128 checksum of the payload (:mod:`kvtier.core.tiers.chunkfile`).  A torn, truncated,
  foreign-namespace or corrupt file is a miss: it is counted in ``corrupt``, logged, and removed.
- **Restart recovery**: the index (key → file size) is rebuilt by scanning the namespace
  directory at start, so a restarted engine still hits.  Stale temporary files are removed.
- **Shared directory**: several processes may point at the same directory (two engines, or a
  prefill and a decode instance).  A key missing from this process's index is looked up on the
  filesystem before being called a miss, and a file another process deleted is a miss.  Capacity
  is accounted per process, over the files it knows.

Thread-safety: ``get_into`` and ``put`` do their I/O without a lock and may run concurrently on
different keys; the index is guarded by a lock.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path

import numpy as np

from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.base import Tier, TierUsage
from kvtier.core.tiers.chunkfile import (
    HEADER_BYTES,
    ChunkFormatError,
    decode_header,
    encode_header,
    payload_digest,
)

log = logging.getLogger(__name__)
SUFFIX = ".kvc"
STALE_TMP_S = 120.0
"""A temporary file older than this (seconds) at start-up is a crash leftover and is removed."""


class DiskTier(Tier):
    """Chunk files in a directory, within ``capacity_bytes`` (headers included).

    Args:
        root: directory of the tier (created if missing).
        namespace: 16-byte namespace digest; files of other namespaces are never returned.
        capacity_bytes: bytes of chunk files this process may hold.
        fsync: fsync each file before renaming it into place.

    Raises:
        OSError: the directory cannot be created.
    """

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], namespace: bytes, capacity_bytes: int,
                 fsync: bool = False) -> None:
        self.namespace = namespace
        self.dir = Path(root) / namespace.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = max(capacity_bytes, 0)
        self.fsync = fsync
        self.corrupt = 0
        self._lock = threading.Lock()
        self._key_to_size: dict[ChunkKey, int] = {}
        self._used = 0
        self._adopted = 0  # files indexed after start (written by other processes)
        self._bad: set[ChunkKey] = set()  # unusable entries that could not be removed
        self.generation = 0  # bumped when the directory vanished and the index was dropped
        self._rebuild_index()
        for i in range(256):  # fan-out directories made once, not on the write path
            shard = self.dir / f"{i:02x}"
            shard.mkdir(exist_ok=True)
            if not os.access(shard, os.W_OK | os.X_OK):
                raise ConfigError(f"disk tier directory {str(shard)!r} is not writable by this process; "
                                  "fix its permissions or choose another disk_path")

    # ---- paths and index -----------------------------------------------------------------
    def path(self, key: ChunkKey) -> Path:
        """File path of ``key``."""
        h = key.hex()
        return self.dir / h[:2] / (h + SUFFIX)

    def _rebuild_index(self) -> None:
        found: list[tuple[float, ChunkKey, int]] = []
        for sub in self.dir.iterdir() if self.dir.exists() else ():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(".tmp"):
                    # left by a crash mid-write; a fresh one may belong to a live process sharing the directory
                    try:
                        if time.time() - entry.stat().st_mtime > STALE_TMP_S:
                            _unlink(Path(entry.path))
                    except OSError:
                        pass
                    continue
                name = entry.name[:-len(SUFFIX)]
                # only <key[:2]>/<key>.kvc regular files are chunks; anything else is not ours to count
                if not entry.name.endswith(SUFFIX) or name[:2] != sub.name or len(name) != 2 * len(self.namespace):
                    continue
                try:
                    key = ChunkKey(bytes.fromhex(name))
                    st = entry.stat(follow_symlinks=False)
                except (ValueError, OSError):
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort(key=lambda item: item[0])  # oldest first: the store's policy sees them in that order
        for _mtime, key, size in found:
            self._key_to_size[key] = size
            self._used += size

    def _adopt(self, key: ChunkKey) -> bool:
        """Index a file written by another process; caller holds the lock."""
        try:
            size = self.path(key).stat().st_size
        except OSError:
            return False
        self._key_to_size[key] = size
        self._used += size
        self._adopted += 1
        return True

    def _forget(self, key: ChunkKey) -> None:
        size = self._key_to_size.pop(key, None)
        if size is not None:
            self._used -= size

    # ---- Tier contract -------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            if key in self._bad:
                return False
            return key in self._key_to_size or self._adopt(key)

    def indexed(self, key: ChunkKey) -> bool:
        """Whether ``key`` is in this process's index (no filesystem access)."""
        return key in self._key_to_size

    def file_bytes(self, payload_bytes: int) -> int:
        """Bytes on disk of a chunk of ``payload_bytes``."""
        return payload_bytes + HEADER_BYTES

    def get_into(self, key: ChunkKey, dst: memoryview) -> bool:
        path = self.path(key)
        if key in self._bad:
            return False
        try:
            # O_NONBLOCK: a FIFO or device planted at a chunk's path must not hang the caller
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise ChunkFormatError("not a regular file")
            with os.fdopen(fd, "rb", buffering=0) as f:
                header = decode_header(f.read(HEADER_BYTES))
                if header.namespace != self.namespace or header.key != key:
                    raise ChunkFormatError("chunk belongs to another namespace or key")
                out = np.frombuffer(dst, dtype=np.uint8)
                if header.length > out.size:
                    raise ChunkFormatError(f"payload of {header.length} bytes exceeds the {out.size}-byte buffer")
                view = memoryview(out.data)[:header.length]
                got = f.readinto(view)
                if got != header.length or f.read(1):
                    size = os.fstat(f.fileno()).st_size - HEADER_BYTES
                    raise ChunkFormatError(f"payload is {size} bytes on disk, header says {header.length}")
                if payload_digest(view) != header.payload_digest:
                    raise ChunkFormatError("payload checksum mismatch")
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return False
        except (ChunkFormatError, OSError) as exc:
            self._quarantine(key, path, str(exc))
            return False
        return True

    def _quarantine(self, key: ChunkKey, path: Path, reason: str) -> None:
        removed = _unlink(path)
        if not removed and path.exists():
            self._bad.add(key)  # remembered, so it is counted and logged once, not on every load
        log.warning("kvtier disk tier: chunk %s is unusable (%s); treated as a miss%s", path, reason,
                    " and removed" if removed else "")
        with self._lock:
            self.corrupt += 1
            self._forget(key)

    def put(self, key: ChunkKey, data: memoryview | bytes) -> bool:
        payload = memoryview(data).cast("B")
        size = self.file_bytes(payload.nbytes)
        with self._lock:
            if key in self._key_to_size:
                return True
            if self._used + size > self.capacity_bytes:
                return False
            self._key_to_size[key] = size  # reserve room while writing
            self._used += size
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                header = encode_header(self.namespace, key, payload)
                written = os.writev(fd, [header, payload])
                while written < size:  # short writes are rare but legal
                    rest = (header + bytes(payload))[written:]
                    written += os.write(fd, rest)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            _unlink(tmp)
            with self._lock:
                self._forget(key)
                if not self.dir.is_dir():
                    self._recreate_locked()
                    return False
            log.warning("kvtier disk tier: writing %s failed (%s); chunk not stored", path, exc.strerror)
            return False
        return True

    def _recreate_locked(self) -> None:
        """The tier's directory vanished (deleted by hand): forget the index and make it again."""
        log.warning("kvtier disk tier: directory %s vanished; recreating it and forgetting %d indexed chunks",
                    self.dir, len(self._key_to_size))
        self._key_to_size.clear()
        self._used = 0
        self.generation += 1
        try:
            for i in range(256):
                (self.dir / f"{i:02x}").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("kvtier disk tier: cannot recreate %s (%s)", self.dir, exc.strerror)

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            known = key in self._key_to_size
            self._forget(key)
        return _unlink(self.path(key)) or known

    def keys(self) -> list[ChunkKey]:
        """Keys in this process's index."""
        with self._lock:
            return list(self._key_to_size)

    def usage(self) -> TierUsage:
        with self._lock:
            used = min(self._used, self.capacity_bytes)
            return TierUsage(used, self.capacity_bytes - used, self.capacity_bytes, len(self._key_to_size))

    def usage_exact(self) -> int:
        """Bytes of the indexed chunk files (may exceed capacity right after start, see the store's trim)."""
        with self._lock:
            return self._used

    def check(self) -> None:
        """Assert index accounting: used bytes equal the indexed sizes and stay within capacity."""
        with self._lock:
            assert self._used == sum(self._key_to_size.values()), "disk tier used bytes drifted from its index"
            assert self._adopted or self._used <= self.capacity_bytes, \
                f"disk tier over capacity: {self._used} > {self.capacity_bytes} bytes"


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("kvtier disk tier: cannot remove %s (%s); it will be ignored", path, exc.strerror)
        return False
