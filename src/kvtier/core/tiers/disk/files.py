"""The disk tier's files as this process keeps them: set-up, the index rebuilt at start, crash-safe
writes, deletes and accounting (:class:`DiskFiles`, the cold part of
:class:`~kvtier.core.tiers.disk.tier.DiskTier`; a hit's reads are in that module).

- **Crash-safe writes**: a chunk is written to a temporary file in the same directory and
  renamed into place (``os.replace`` is atomic on POSIX), so a reader never sees a half-written
  chunk under its final name; with ``fsync=True`` it is also durable across power loss.  The
  checksum is computed while the bytes move, not after (:mod:`kvtier.core.tiers.disk.chunkio`).
- **Restart recovery**: the index (key → file size) is rebuilt by scanning the namespace
  directory at start, so a restarted engine still hits.  Temporary files a crashed writer left
  are removed at once (every writer holds a lock the kernel drops when it dies,
  :class:`~kvtier.core.tiers.disk.scan.WriterLock`), so a restart right after a SIGKILL
  mid-write counts nothing twice and leaves nothing uncounted.  With a key ring (``encryption``
  configured) the start-up scan also reads each file's header block and key id: a file sealed
  under a master key the ring does not hold is not indexed (never offered, never evicted, not
  counted in ``capacity_bytes``), counted once as a decrypt failure and left in place
  (:mod:`kvtier.core.tiers.disk.directory`); without a ring the start-up stays a listing, and such
  a file is found by its first read, counted, and then treated the same way.
- **Capacity** is accounted over the files this process knows (headers included), so engines
  that rescan one directory bound it together by the smallest ``disk_gib`` among them.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtier.core import envelope
from kvtier.core.codecsettings import NO_CODECS, CodecArgs
from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.tenant import Writer
from kvtier.core.tiers.base import GetResult, PutResult, Tier, writers
from kvtier.core.tiers.disk.check import namespace_not_a_directory
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.core.tiers.disk.chunkio import DEFAULT_SLICE_BYTES, ChunkIO, helper_threads
from kvtier.core.tiers.disk.directory import STALE_TMP_S
from kvtier.core.tiers.disk.iomode import IO_MODES, IOMode, resolve_io
from kvtier.core.tiers.disk.reset import apply_pending_reset, reset_marked
from kvtier.core.tiers.disk.scan import (
    ShardWatch,
    WriterLock,
    indexed_files,
    remove_dead_writer_locks,
    sealed_key_id,
    tmp_name,
)
from kvtier.core.tiers.loglimit import CauseLimiter, warn_unusable

log = logging.getLogger(__name__)
WRITE_WARNING_INTERVAL_S = 10.0
"""At most one warning line per this many seconds about failed chunk writes (a full disk fails
every write: one line per chunk was thousands per second); the redis tier's rule (``_fault``)."""


class DiskFiles(Tier):
    """Chunk files in a directory, within ``capacity_bytes`` (headers included): the state of a
    :class:`~kvtier.core.tiers.disk.tier.DiskTier` and its verbs off a hit's path.

    Args:
        root: directory of the tier (created if missing).
        namespace: 16-byte namespace digest; files of other namespaces are never returned.
        capacity_bytes: bytes of chunk files this process may hold.
        fsync: fsync each file before renaming it into place.
        io: ``"buffered"`` (through the page cache), ``"direct"`` (``O_DIRECT``; buffered where
            the filesystem refuses it) or ``"auto"`` (chosen by measurement,
            :func:`~kvtier.core.tiers.disk.iomode.measure_direct`).  The mode in use is ``io_mode``.
        io_threads: chunks read or written at once by ``get_many``/``put_many``, and helper
            threads that read ahead and hash (:class:`~kvtier.core.tiers.disk.chunkio.ChunkIO`).
        slice_bytes: bytes per read slice (a multiple of 4096).
        codec_args: the envelope's ``chain`` and ``keyring`` (:func:`kvtier.core.codecsettings.envelope_args`;
            identity by default: payloads move between the file and the caller's memory, no copy).

    Raises:
        OSError: the directory cannot be created.
        ConfigError: a shard directory cannot be made or written, or the reset a marker says is pending
            cannot be applied (:func:`~kvtier.core.tiers.disk.reset.apply_pending_reset`).
        ValueError: unknown ``io`` or a bad ``slice_bytes``.
    """

    # what the tier's other parts give (declared, not defined here: DiskTier's own, and its other bases')
    _file: Callable[[ChunkKey], str]  # the tier's own (kvtier.core.tiers.disk.tier, on a hit's path)
    _pool: Callable[[], ThreadPoolExecutor | None]  # the tier's own
    _recreate_locked: Callable[[], str]  # kvtier.core.tiers.disk.directory's
    unopenable: Callable[[bytes | None], bool]  # kvtier.core.tiers.disk.directory's
    sealed_away_found: Callable[[list[bytes], str], None]  # kvtier.core.tiers.disk.directory's
    sealed_room_check: Callable[[int], None]  # kvtier.core.tiers.disk.directory's

    def __init__(self, root: str | os.PathLike[str], namespace: bytes, capacity_bytes: int,
                 fsync: bool = False, io: IOMode = "buffered", io_threads: int = 1,
                 slice_bytes: int = DEFAULT_SLICE_BYTES, codec_args: CodecArgs | None = None) -> None:
        if io not in IO_MODES:
            raise ValueError(f"disk I/O mode must be one of {', '.join(IO_MODES)}, got {io!r}")
        super().__init__()
        self.namespace = namespace
        self.envelope = envelope.Envelope(namespace, header_bytes=HEADER_BYTES, **(codec_args or NO_CODECS))  # XXH3-128
        self.dir = Path(root) / namespace.hex()
        self._root = str(self.dir)
        if os.path.lexists(self.dir) and not self.dir.is_dir():
            raise ConfigError(namespace_not_a_directory(self.dir))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = max(capacity_bytes, 0)
        self.fsync = fsync
        self.io_threads = max(io_threads, 1)
        self.io_mode, self.io_reason = resolve_io(io, self.dir)
        log.info("kvtier disk tier: %s I/O in %s (%s)", self.io_mode, self.dir, self.io_reason)
        self._io = ChunkIO(self.io_mode == "direct", slice_bytes, helper_threads(self.io_threads),
                           readers=self.io_threads + 1)  # the pool's reads and the caller's own
        self._workers: ThreadPoolExecutor | None = None
        self._closed = False
        self._write_warnings = CauseLimiter(WRITE_WARNING_INTERVAL_S)  # a line per cause per interval
        self._read_warnings = CauseLimiter(WRITE_WARNING_INTERVAL_S)  # unusable chunks found by reads, alike
        self.last_write_error = ""  # why the last chunk write failed ("No space left on device"), "" before any
        self._recreate_failed: str | None = None  # why the vanished directory cannot be made again (None: it can)
        self._lock = threading.Lock()
        self._key_to_size: dict[ChunkKey, int] = {}
        # indexed() is the dict's own membership test, a C call: the index asks it per chunk on the hit path
        self.indexed = self._key_to_size.__contains__  # type: ignore[method-assign,assignment]
        self._used = 0
        self._foreign = 0  # files indexed that this process did not write (start-up scan, rescans)
        self._bad: set[ChunkKey] = set()  # unusable entries that could not be removed
        self._sealed_away: set[ChunkKey] = set()  # files sealed under a master key the ring lacks: left in place
        self._writing: set[ChunkKey] = set()  # indexed before their file is renamed into place
        self._removed: set[ChunkKey] | None = None  # keys written or removed while a scan runs (adopt skips them)
        self._unlinking: dict[ChunkKey, int] = {}  # keys forgotten whose file delete() is still removing: count
        self._tmp_shards: set[int] = set()  # shards holding a live writer's temporary file, listed every round
        self._watch = ShardWatch(self._root)
        self.generation = 0  # bumped when the directory vanished or was cleared, and the index was dropped
        if reset_marked(self.dir):  # a reset was acknowledged and never applied (kvtier.core.tiers.disk.reset)
            apply_pending_reset(self.dir, len(namespace))
        self._rebuild_index()
        for i in range(256):  # fan-out directories made once, not on the write path
            shard = self.dir / f"{i:02x}"
            try:
                shard.mkdir(exist_ok=True)
            except OSError as exc:  # e.g. EROFS: the namespace directory mounted read-only
                raise ConfigError(f"disk tier directory {str(shard)!r} cannot be made ({exc.strerror}); fix the "
                                  "permissions or mount of its directory, or choose another disk_path") from None
            if not os.access(shard, os.W_OK | os.X_OK):
                raise ConfigError(f"disk tier directory {str(shard)!r} is not writable by this process; "
                                  "fix its permissions or choose another disk_path")
        self._writer = WriterLock(self.dir)

    # ---- paths and index -----------------------------------------------------------------
    def path(self, key: ChunkKey) -> Path:
        """File path of ``key``."""
        return Path(self._file(key))

    def _rebuild_index(self) -> None:
        files, removed = indexed_files(self.dir, len(self.namespace), STALE_TMP_S)
        sealed_away: list[bytes] = []  # key ids of files no key of the ring opens
        sealed_bytes = 0
        check = self.envelope.keyring is not None  # no ring: such files are found by their first read
        for key, size in files:  # oldest first
            key_id = sealed_key_id(self._file(key)) if check else None
            if key_id is not None and self.unopenable(key_id):
                self._sealed_away.add(key)
                sealed_away.append(key_id)
                sealed_bytes += size
                continue
            self._key_to_size[key] = size
            self._used += size
        self._foreign = len(files) - len(sealed_away)
        self.sealed_away_found(sealed_away, "at start-up")
        self.sealed_room_check(sealed_bytes)
        dead_locks = remove_dead_writer_locks(self.dir)  # after the scan: their temporary files are gone
        if removed or dead_locks:
            log.info("kvtier disk tier: removed %d temporary files and %d lock files crashed writers left in %s",
                     removed, dead_locks, self.dir)

    def _forget(self, key: ChunkKey) -> None:
        """Drop ``key`` from the index; caller holds the lock."""
        size = self._key_to_size.pop(key, None)
        if size is not None:
            self._used -= size
        if self._removed is not None:
            self._removed.add(key)

    def contains(self, key: ChunkKey) -> bool:
        """Whether ``key`` is in this process's index and readable: no filesystem access, no side
        effect (a file another process wrote is known after the next :meth:`scan`/:meth:`adopt`)."""
        return key in self._key_to_size and key not in self._writing and key not in self._bad


    def indexed(self, key: ChunkKey) -> bool:
        """Whether ``key`` is in this process's index (being written included; no filesystem access)."""
        return key in self._key_to_size

    def file_bytes(self, payload_bytes: int) -> int:
        """Bytes on disk of a chunk of ``payload_bytes``."""
        return payload_bytes + HEADER_BYTES

    def stored_bytes(self, payload_bytes: int) -> int:
        return self.file_bytes(payload_bytes)

    def _fall_back(self, exc: OSError) -> bool:
        """Switch to buffered I/O when O_DIRECT is refused at run time (EINVAL); True if switched."""
        if exc.errno != errno.EINVAL or not self._io.direct:
            return False
        log.warning("kvtier disk tier: %s refused O_DIRECT (%s); using buffered I/O from now on",
                    self.dir, exc.strerror)
        with self._lock:
            if self._io.direct:
                old, self._io = self._io, ChunkIO(False, self._io.slice_bytes, helper_threads(self.io_threads),
                                                  readers=self.io_threads + 1)
                self.io_mode, self.io_reason = "buffered", f"O_DIRECT refused at run time ({exc.strerror})"
                old.close()
        return True

    def _sealed_by_another(self, key: ChunkKey) -> GetResult:
        """A read found ``key`` sealed under a master key this engine lacks (counted by the envelope): a
        miss; the file is kept for its engine, no longer indexed nor offered."""
        with self._lock:
            self._forget(key)
            self._sealed_away.add(key)
        return GetResult.MISS

    def _vanished(self, key: ChunkKey) -> GetResult:
        """A read found ``key``'s file gone: removed by another process (a write in flight is not): a miss."""
        with self._lock:
            if key not in self._writing:
                self._forget(key)
        return GetResult.MISS

    def _quarantine(self, key: ChunkKey, path: Path, reason: str) -> None:
        removed = _unlink(path)
        if not removed and path.exists():
            self._bad.add(key)  # remembered, so it is counted and logged once, not on every load
        warn_unusable(self._read_warnings, log, "kvtier disk tier", str(path), reason,
                      "treated as a miss" + (" and removed" if removed else ""))
        with self._lock:
            self.corrupt += 1
            self._forget(key)

    def put(self, key: ChunkKey, data: memoryview | bytes, tenant: Writer | None = None) -> PutResult:
        """Write ``data`` as an envelope whose header holds ``tenant``'s record (``None``: unknown).
        ``FAILED`` without writing when ``key``'s file is sealed under a master key this process
        does not hold: another engine's value is never replaced (see the module docstring); once
        that file is gone (``kvtier purge --key-id``), the key is written as any other."""
        if key in self._sealed_away:
            if os.path.lexists(self._file(key)):
                return PutResult.FAILED
            with self._lock:
                self._sealed_away.discard(key)
        payload = memoryview(data).cast("B")
        sealed = None
        if not self.envelope.chain.passthrough:  # encoded first: the file's size is the encoded one
            if key in self._key_to_size:
                return PutResult.PRESENT
            sealed = self.envelope.seal(key, payload, tenant)
        size = self.file_bytes(payload.nbytes if sealed is None else sealed.body.nbytes)
        with self._lock:
            if key in self._key_to_size:
                return PutResult.PRESENT
            if key in self._sealed_away:  # found by a rescan meanwhile
                return PutResult.FAILED
            if self._used + size > self.capacity_bytes:
                return PutResult.NO_ROOM
            self._key_to_size[key] = size  # reserve room while writing
            self._used += size
            self._writing.add(key)
        path = self.path(key)
        tmp = path.with_name(tmp_name(path.name, self._writer.writer_id, threading.get_ident()))
        try:
            try:
                self._write_file(key, tmp, payload, tenant, sealed)
            except OSError as exc:
                if not self._fall_back(exc):
                    raise
                self._write_file(key, tmp, payload, tenant, sealed)
            os.replace(tmp, path)
        except OSError as exc:
            if os.path.lexists(tmp):  # not when the open failed (a read-only filesystem answers EROFS, not ENOENT)
                _unlink(tmp)
            with self._lock:
                self._writing.discard(key)
                self._forget(key)
                # the directory vanished under the write: made again (this chunk lost), or not (a file in
                # its place): either way a failed write, counted as one (doctor reads dropped saves beside it)
                why = self._recreate_locked() if not self.dir.is_dir() else ""
                self.write_errors += 1
                self.last_write_error = cause = why or exc.strerror or str(exc)
            if (unlogged := self._write_warnings.admit(cause)) is None:  # this cause logged within the interval
                return PutResult.FAILED
            since = (f"; {unlogged} more chunk writes failed since the last such line" if unlogged else "")
            log.warning("kvtier disk tier: writing %s failed (%s); chunk not stored (at most one such line per "
                        "cause per %.0f s%s)", path, cause, self._write_warnings.interval_s, since)
            return PutResult.FAILED
        with self._lock:
            self._writing.discard(key)
            if self._removed is not None:  # a scan running may have listed the shard before the rename
                self._removed.add(key)
        return PutResult.STORED

    def _write_file(self, key: ChunkKey, tmp: Path, payload: memoryview, writer: Writer | None,
                    sealed: envelope.Sealed | None = None) -> None:
        io = self._io
        env = self.envelope
        if sealed is not None:  # header and encoded body made by the envelope
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | io.open_flags, 0o644)
            try:
                io.write_chunk(fd, sealed.body, lambda _digest: sealed.header, lambda _body: b"")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            return
        fields = env.fields(key, payload.nbytes, payload.nbytes, env.record(writer))

        def digest_of(body: memoryview) -> bytes:
            h = env.hasher(fields)
            h.update(body)
            return h.digest()

        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | io.open_flags, 0o644)
        try:
            io.write_chunk(fd, payload, lambda digest: env.finish(fields, digest), digest_of)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                 tenants: Sequence[Writer | None] | None = None) -> list[PutResult]:
        """Batch :meth:`put`, ``io_threads`` chunks at a time."""
        pool = self._pool()
        if pool is None or len(keys) < 2:
            return super().put_many(keys, datas, tenants)
        return list(pool.map(self.put, keys, datas, writers(tenants, len(keys))))

    def close(self) -> None:
        """Stop the tier's threads (later calls still work, on the calling thread).  Idempotent."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, None
        if workers is not None:
            workers.shutdown(wait=True)
        self._io.close()
        self._writer.release()

    def delete(self, key: ChunkKey) -> bool:
        """Forget ``key`` and remove its file; whether either held it.  The file is removed outside the
        lock, so until it is gone (and then for the scan running meanwhile) the key is marked, and a
        rescan that listed the file does not take it back as another process's (:meth:`adopt`)."""
        with self._lock:
            known = key in self._key_to_size
            self._forget(key)
            self._sealed_away.discard(key)
            self._unlinking[key] = self._unlinking.get(key, 0) + 1
        try:
            return _unlink(self.path(key)) or known
        finally:
            with self._lock:
                left = self._unlinking.pop(key) - 1
                if left:
                    self._unlinking[key] = left
                if self._removed is not None:  # a scan that began before the unlink may have listed the file
                    self._removed.add(key)

    def keys(self) -> list[ChunkKey]:
        """Keys in this process's index."""
        with self._lock:
            return list(self._key_to_size)

    def usage_exact(self) -> int:
        """Bytes of the indexed chunk files (may exceed capacity after the start-up scan or an
        :meth:`adopt` until the store trims it)."""
        with self._lock:
            return self._used

    def check(self) -> None:
        """Assert index accounting: used bytes equal the indexed sizes, and stay within capacity
        unless files this process did not write were indexed (the store trims those)."""
        with self._lock:
            assert self._used == sum(self._key_to_size.values()), "disk tier used bytes drifted from its index"
            assert self._foreign or self._used <= self.capacity_bytes, \
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
