"""A disk tier's index kept in step with its directory when the directory changes under it:
files other processes sharing it wrote or removed (the rescan), every file of the namespace
removed (``clear``, a reset), the directory gone (deleted by hand: made again).

:class:`DirectorySync` is that part of :class:`~kvtier.core.tiers.disk.tier.DiskTier`.  The rescan
(the capability ``rescannable``, :class:`kvtier.core.tiers.base.Rescannable`):
:meth:`~DirectorySync.scan` lists the shard directories that changed and checks new files' headers
with no lock held, then :meth:`~DirectorySync.adopt` changes the index (the store runs it under its
own lock).  The pieces it uses (listing, header checks, writer locks) are
:mod:`kvtier.core.tiers.disk.scan`'s.

A file sealed under a master key this process's key ring does not hold (another engine's key, a
key rotated out, or any encrypted file when no ring is configured; issue 36) is never indexed,
so never offered by a lookup nor evicted: its key is remembered in the tier's ``_sealed_away``
set (bounded by the files in the directory; forgotten when a listing no longer finds the file,
or on ``clear``), counted once in the tier's codec numbers as a decrypt failure, and the file is
left in place for the engines that hold the key (``kvtier purge --key-id`` removes it).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from kvtier.core import envelope
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.base import ClearResult
from kvtier.core.tiers.disk.chunkfile import ChunkFormatError
from kvtier.core.tiers.disk.reset import remove_chunk_files, unmark_reset
from kvtier.core.tiers.disk.scan import (
    RescanResult,
    ShardWatch,
    WriterLock,
    chunk_names,
    header_bytes,
    remove_if_dead,
)

log = logging.getLogger(__name__)
RESCAN_MAX_NEW = 4096
"""Header checks of new files per :meth:`DirectorySync.rescan` round at most (the rest wait a round)."""
STALE_TMP_S = 120.0
"""A temporary file whose writer has no lock file (an older kvtier's) is a crash leftover once
older than this (seconds); one of a writer whose lock is free is one at once."""


class DirectorySync:
    """The directory-facing part of a :class:`~kvtier.core.tiers.disk.tier.DiskTier`, over the
    index state the tier holds (declared here; the tier sets it and defines the three index helpers)."""

    namespace: bytes
    dir: Path
    generation: int
    _root: str
    _lock: threading.Lock
    _key_to_size: dict[ChunkKey, int]
    _used: int
    capacity_bytes: int
    _foreign: int
    _bad: set[ChunkKey]
    _sealed_away: set[ChunkKey]
    envelope: envelope.Envelope
    _writing: set[ChunkKey]
    _removed: set[ChunkKey] | None
    _unlinking: dict[ChunkKey, int]
    _tmp_shards: set[int]
    _watch: ShardWatch
    _writer: WriterLock
    _recreate_failed: str | None

    _file: Callable[[ChunkKey], str]  # declared, not defined: DiskTier's (kvtier.core.tiers.disk.tier, .files)
    _forget: Callable[[ChunkKey], None]
    _quarantine: Callable[[ChunkKey, Path, str], None]

    def rescan(self, max_new: int = RESCAN_MAX_NEW) -> RescanResult:
        """:meth:`scan` then :meth:`adopt` (for a tier used without a store)."""
        return self.adopt(self.scan(max_new))

    def scan(self, max_new: int = RESCAN_MAX_NEW) -> RescanResult:
        """Find chunk files other processes wrote since the index was built, and indexed ones
        they removed; the index does not change (see :meth:`adopt`).

        Lists only the shard directories that changed since their last listing
        (:class:`~kvtier.core.tiers.disk.scan.ShardWatch`), and those that held a live writer's
        temporary file last time.  A file not in the index has its header block read and checked
        (namespace, key, length against its size; at most ``max_new`` files per call, the rest on
        the next); one whose header fails is counted in ``corrupt`` and removed, as a failed read
        is.  Temporary files of crashed writers are removed.  The payload checksum is checked
        when the chunk is read, as always.  Thread-safe; the I/O runs outside every lock.

        Returns:
            the candidates (``found``, ``missing``) and what the scan itself did.
        """
        result = RescanResult(generation=self.generation)
        budget = max(max_new, 0)
        changed: list[tuple[int, str, int | None]] = list(self._watch.changed())
        listed = {shard for shard, _path, _mtime in changed}  # and those holding a live writer's temporary file:
        changed += [(shard, f"{self._root}{os.sep}{shard:02x}", None) for shard in sorted(self._tmp_shards - listed)]
        if not changed:
            return result
        with self._lock:
            self._removed = set()
            by_shard: dict[int, set[ChunkKey]] = {shard: set() for shard, _path, _mtime in changed}
            for key in self._key_to_size:  # one pass over the index (a key's shard is its first byte)
                if key[0] in by_shard:
                    by_shard[key[0]].add(key)
            sealed: dict[int, set[ChunkKey]] = {shard: set() for shard in by_shard}
            for key in self._sealed_away:
                if key[0] in sealed:
                    sealed[key[0]].add(key)
        liveness: dict[str, bool | None] = {}
        found: list[tuple[ChunkKey, int, float] | None] = []  # None: a file whose header failed
        for shard, path, mtime in changed:
            on_disk, tmps = chunk_names(path, shard, len(self.namespace))
            result.shards_listed += 1
            live_tmp = False
            for tmp in tmps:
                removed = remove_if_dead(self.dir, tmp, liveness, STALE_TMP_S)
                result.dead_tmp_removed += removed
                live_tmp = live_tmp or not removed
            (self._tmp_shards.add if live_tmp else self._tmp_shards.discard)(shard)
            indexed = by_shard[shard]
            result.missing += [k for k in indexed - on_disk if not os.path.lexists(self._file(k))]
            result.sealed_gone += [k for k in sealed[shard] - on_disk if not os.path.lexists(self._file(k))]
            new = [k for k in on_disk - indexed - sealed[shard] if k not in self._bad]
            complete = len(new) <= budget
            for key in new[:budget]:
                self._check_new(key, found, result)
            budget -= min(len(new), budget)
            if mtime is None:
                continue
            if complete:
                self._watch.listed(shard, mtime)
            else:
                result.more = True
        result.corrupt = sum(1 for item in found if item is None)
        # oldest first, as at start-up, so the policy's order follows the files' ages
        result.found = [(key, size) for key, size, _mtime in sorted((i for i in found if i), key=lambda i: i[2])]
        return result

    def adopt(self, result: RescanResult) -> RescanResult:
        """Index the files :meth:`scan` found and forget the keys whose files it missed, unless
        this process changed them since (wrote, removed or is writing them, or the directory was
        recreated); fills ``result.adopted`` and ``result.gone``.  Files sealed under a key this
        process does not hold are remembered instead (each counted once as a decrypt failure).
        Thread-safe; no I/O."""
        with self._lock:
            removed, self._removed = self._removed or set(), None
            if result.generation != self.generation:
                result.found, result.missing, result.sealed_away = [], [], []
                return result
            self._sealed_away.difference_update(result.sealed_gone)
            newly = [(key, kid) for key, kid in result.sealed_away
                     if key not in self._key_to_size and key not in self._sealed_away and key not in removed]
            self._sealed_away.update(key for key, _kid in newly)
            for key, size in result.found:
                if key in self._key_to_size or key in self._bad or key in removed or key in self._unlinking:
                    continue  # (this process's own file, on its way in or out)
                self._key_to_size[key] = size
                self._used += size
                self._foreign += 1
                result.adopted.append(key)
            for key in result.missing:
                if key in self._key_to_size and key not in self._writing and key not in removed:
                    self._forget(key)
                    result.gone.append(key)
        self.sealed_away_found([kid for _key, kid in newly], "found by a rescan")
        return result

    def sealed_away_found(self, key_ids: list[bytes], when: str) -> None:
        """Count and log files (one master key id each) sealed under keys this process does not hold."""
        for _ in key_ids:
            self.envelope.stats.failed(True)
        if key_ids:
            ids = ", ".join(sorted({k.hex() for k in key_ids}))
            log.warning("kvtier disk tier: %d chunk files in %s (%s) are sealed under master key %s, which this "
                        "kvtier does not hold: not served, counted as decrypt failures and left in place for "
                        "the engines that hold it (kvtier purge --key-id %s removes them)",
                        len(key_ids), self.dir, when, ids, ids.split(", ")[0])

    def sealed_room_check(self, sealed_bytes: int) -> None:
        """Warn when files sealed under master keys this process lacks (``sealed_bytes``, left in place,
        never evicted here) leave the directory's filesystem too little room for ``capacity_bytes``:
        past the free space every write fails (ENOSPC), however much of its size the tier shows free
        (seen after a master key was replaced without ``previous_key_files``)."""
        if sealed_bytes <= 0:
            return
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            return
        if free + self._used >= self.capacity_bytes:
            return
        log.warning("kvtier disk tier: the chunk files sealed under master keys this kvtier does not hold take "
                    "%s in %s; with %s free and %s of its own files the tier can hold %s of its %s (disk_gib), so "
                    "writes past that fail: add the old key to encryption.previous_key_files, remove the files "
                    "(kvtier purge --key-id), or lower disk_gib", _mib(sealed_bytes), self.dir, _mib(free),
                    _mib(self._used), _mib(free + self._used), _mib(self.capacity_bytes))

    def unopenable(self, key_id: bytes | None) -> bool:
        """Whether a value sealed under master key ``key_id`` (``None``: not encrypted) cannot open here."""
        ring = self.envelope.keyring
        return key_id is not None and (ring is None or ring.find(key_id) is None)

    def _check_new(self, key: ChunkKey, found: list[tuple[ChunkKey, int, float] | None],
                   result: RescanResult) -> None:
        """Append ``(key, bytes, mtime)`` of ``key``'s file to ``found`` if its header checks out
        (to ``result.sealed_away`` instead when it is sealed under a key this process does not
        hold); quarantine it (and append ``None``) if not."""
        path = self._file(key)
        try:
            head = header_bytes(path, self.namespace, key)
        except FileNotFoundError:
            return
        except (ChunkFormatError, OSError) as exc:
            self._quarantine(key, Path(path), str(exc))
            found.append(None)
            return
        if head.key_id is not None and self.unopenable(head.key_id):
            result.sealed_away.append((key, head.key_id))
            return
        found.append((key, head.size, head.mtime))

    def _recreate_locked(self) -> str:
        """The tier's directory vanished (deleted by hand, or a file put in its place): forget the index
        and make it again.  Returns ``""`` when it is there again, else why it cannot be made (each
        write fails until it can: a write error the caller counts).  Logs once per episode (and again
        when the reason changes), not once per write: a file in its place fails every write."""
        if self._recreate_failed is None:
            log.warning("kvtier disk tier: directory %s vanished; recreating it and forgetting %d indexed chunks",
                        self.dir, len(self._key_to_size))
        # writes in flight keep their reservations: one that lands after the directory is made
        # again is a file the index must count; one that fails forgets its key itself
        writing = {k: self._key_to_size[k] for k in self._writing if k in self._key_to_size}
        self._key_to_size.clear()
        self._key_to_size.update(writing)
        self._used = sum(writing.values())
        self._foreign = 0
        self._sealed_away.clear()
        self._watch.forget()
        self._tmp_shards.clear()
        self.generation += 1
        try:
            for i in range(256):
                (self.dir / f"{i:02x}").mkdir(parents=True, exist_ok=True)
            self._writer.release()  # its lock file went with the directory
            self._writer = WriterLock(self.dir)
        except OSError as exc:
            why = ("a file is in its place" if os.path.lexists(self.dir) and not self.dir.is_dir()
                   else exc.strerror or str(exc))
            if why != self._recreate_failed:
                log.warning("kvtier disk tier: cannot recreate %s (%s); chunk writes fail, counted as write "
                            "errors, until it can be made", self.dir, why)
            self._recreate_failed = why
            return why
        if self._recreate_failed is not None:
            log.warning("kvtier disk tier: directory %s made again after %s", self.dir, self._recreate_failed)
        self._recreate_failed = None
        return ""

    def clear(self) -> ClearResult:
        """Forget the index and remove every chunk file of the namespace, other processes' too
        (:func:`~kvtier.core.tiers.disk.reset.remove_chunk_files`), then the reset marker; the keys
        returned are the index's and the files'.  A scan
        running meanwhile adopts nothing (the generation changes).  A write in flight may land
        after: the store removes it (:mod:`kvtier.core.mover`)."""
        with self._lock:
            known = list(self._key_to_size)
            self._key_to_size.clear()
            self._used = 0
            self._foreign = 0
            self._bad.clear()
            self._sealed_away.clear()
            self._watch.forget()
            self.generation += 1
        result = remove_chunk_files(self.dir, len(self.namespace))
        if result.ok:
            unmark_reset(self.dir)
        # the index's keys too: files another process (a reset hook) removed first were still this tier's
        return result._replace(keys=list(dict.fromkeys((*known, *result.keys))))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"
