"""The s3 tier's space: which objects of the namespace it counts, their bytes, expiry and the cap.

The bucket evicts nothing by itself (docs/s3.md, "Expiry and capacity"):

- **Index**: key -> (object bytes, ``Last-Modified``), oldest first: what this process wrote, and
  with a cap what the last sweep listed.  Each object is counted once, by key, whoever wrote it.
  Without a cap only the most recent :data:`WRITTEN_KEYS_MAX` keys are remembered (``indexed``,
  ``keys``).
- **Expiry** (``ttl_s``): an object older than the TTL (by its ``Last-Modified``) is a miss
  (:meth:`S3Space.expired`), and a background sweep every ``sweep_interval_s`` LISTs the
  namespace and deletes expired objects.
- **Capacity** (``capacity_bytes``): the same pass re-counts the namespace (so the count starts
  from what the bucket holds and includes other engines' objects), and the oldest objects past
  the cap are deleted; before each delete a ``HEAD`` checks that the object was not rewritten
  since it was counted, so one engine never deletes another's fresh object on an old count.

Thread-safe (one lock over the index and the count).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.base import TierUsage
from kvtier.core.tiers.s3.objects import DELETE_BATCH, S3Objects
from kvtier.core.tiers.sealedaway import LOOKUP_HEAD_BYTES, SealedAway

WRITTEN_KEYS_MAX = 1 << 16
"""Keys remembered without a capacity cap (``indexed``/``keys``), most recent kept."""
CLEAR_DEADLINE_S = 60.0
"""Longest a clear (a reset) lists and deletes a namespace's objects, seconds (and a sweep's LIST)."""
SWEEP_MAX_OBJECTS = 1_000_000
"""Objects one sweep lists at most (a larger namespace is swept in part each interval)."""
EVICT_PASSES = 4
"""Eviction passes at most per call (each a HEAD batch of the victims, then one delete)."""
REWRITTEN_S = 1.0
"""An object whose ``Last-Modified`` is at least this much newer than counted was rewritten: kept.
``Last-Modified`` has one-second resolution (an HTTP date), so a chunk this process stored is
counted at the whole second it was stored in (the engine's and the server's clocks kept in sync)."""


class S3Space:
    """The count of one namespace's objects, its TTL and its cap (see the module docstring).

    Args:
        objects: the namespace's objects (the tier's, shared with its data path).
        capacity_bytes: cap on the namespace's objects (object bytes: header + payload), or ``None``.
        ttl_s: seconds an object lives, or ``None``.
        sweep_interval_s: seconds between background sweeps; the sweep thread
            (``kvtier-s3-sweep``) runs only with a TTL or a cap.
        log_fault: ``(operation, exception)`` -> logs a failed request (the tier's rate-limited line).
    """

    def __init__(self, objects: S3Objects, capacity_bytes: int | None, ttl_s: int | None, sweep_interval_s: float,
                 log_fault: Callable[[str, BaseException], None]) -> None:
        self.objects = objects
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.sweep_interval_s = sweep_interval_s
        self._log_fault = log_fault
        self.sweeps = 0
        self.sweep_errors = 0
        self.expired_deleted = 0
        self.evicted = 0
        self._lock = threading.Lock()
        self._index: OrderedDict[ChunkKey, tuple[int, float]] = OrderedDict()  # key -> (bytes, mtime), oldest first
        self._used = 0
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        if capacity_bytes is not None or ttl_s is not None:
            self._sweeper = threading.Thread(target=self._sweep_loop, name="kvtier-s3-sweep", daemon=True)
            self._sweeper.start()

    def expired(self, mtime: float) -> bool:
        """Whether an object last modified at ``mtime`` (seconds since the epoch) is past the TTL."""
        return self.ttl_s is not None and time.time() - mtime > self.ttl_s

    async def head(self, path: str) -> dict[str, Any] | None:
        """The object's metadata, or ``None`` if it is absent (or expired)."""
        meta = await self.objects.head(path)
        if meta is None or self.expired(meta["last_modified"].timestamp()):
            return None
        return meta

    def lookup(self, keys: Sequence[ChunkKey], paths: Sequence[str], sealed: SealedAway) -> list[bool]:
        """Which of ``keys`` (objects ``paths``) are live: a ``HEAD`` each (in parallel); with a key
        ring, then a ranged ``GET`` of each live value's head, a value sealed under a key the ring
        lacks answering absent (:mod:`kvtier.core.tiers.sealedaway`).  Raises on a fault."""
        if not sealed.reads_heads:
            metas = self.objects.run(lambda: self.objects.each(self.head, paths))
            return [m is not None for m in metas]

        async def one(path: str) -> bytes | None:
            async with self.objects.requests():
                meta = await self.head(path)
            size = 0 if meta is None else int(meta["size"])
            return await self.objects.read_range(path, 0, min(LOOKUP_HEAD_BYTES, size)) if size else None

        async def heads() -> list[bytes | None]:  # each request takes the gate itself
            return list(await asyncio.gather(*(one(p) for p in paths)))
        return sealed.openable(keys, self.objects.run(heads))

    async def delete_expired(self, paths: list[str]) -> None:
        """Delete objects a read found past the TTL (bulk deletes one after another, on the loop).
        A fault is logged, never raised: the object stays, and the sweep or the next read deletes it."""
        import obstore

        try:
            for i in range(0, len(paths), DELETE_BATCH):
                await obstore.delete_async(self.objects.store, paths[i:i + DELETE_BATCH])
        except Exception as exc:  # noqa: BLE001 - the object stays; the sweep or the next read deletes it
            self._log_fault("delete", exc)

    # ---- the index -------------------------------------------------------------------------------
    def add(self, keys: Sequence[ChunkKey], object_bytes: Sequence[int], mtimes: Sequence[float]) -> None:
        """Count written objects (each key once, whoever wrote it); without a cap, keep the most
        recent :data:`WRITTEN_KEYS_MAX` keys.  :meth:`fit` then evicts past the cap."""
        with self._lock:
            for key, size, mtime in zip(keys, object_bytes, mtimes, strict=True):
                if key not in self._index:  # counted once per key, whoever wrote it
                    self._index[key] = (size, mtime)
                    self._used += size
            self._trim_unbounded()

    def _trim_unbounded(self) -> None:
        """Without a cap, remember at most :data:`WRITTEN_KEYS_MAX` keys (the lock is held)."""
        if self.capacity_bytes is not None:
            return
        while len(self._index) > WRITTEN_KEYS_MAX:
            _, (size, _mtime) = self._index.popitem(last=False)
            self._used -= size

    def forget(self, key: ChunkKey) -> None:
        """Stop counting ``key`` (its object was deleted or found corrupt)."""
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._used -= entry[0]

    def clear(self) -> list[ChunkKey]:
        """Forget the count, then delete every object of the namespace (a reset) within
        :data:`CLEAR_DEADLINE_S` for the LIST: the chunk keys deleted.

        Raises:
            Exception: the server failed (obstore's errors), or the LIST ran past its deadline.
        """
        with self._lock:
            self._index.clear()
            self._used = 0
        found = self.objects.run(lambda: self.objects.list(SWEEP_MAX_OBJECTS), CLEAR_DEADLINE_S)
        self.objects.delete([self.objects.key(k) for k, _, _ in found])
        return [k for k, _, _ in found]

    def indexed(self, key: ChunkKey) -> bool:
        """Whether ``key`` is counted (written or listed, and not seen to vanish; no network)."""
        with self._lock:
            return key in self._index

    def keys(self) -> list[ChunkKey]:
        """The counted keys, oldest first."""
        with self._lock:
            return list(self._index)

    def usage(self) -> TierUsage:
        """Bytes counted, bytes free under the cap (0 without one), the cap (or the count), objects."""
        with self._lock:
            used, n = self._used, len(self._index)
        if self.capacity_bytes is None:
            return TierUsage(used, 0, used, n)
        return TierUsage(used, max(self.capacity_bytes - used, 0), max(self.capacity_bytes, used), n)

    def check(self) -> None:
        """Assert the counted bytes are the sum of the index's."""
        with self._lock:
            assert self._used == sum(size for size, _ in self._index.values()), \
                "s3 tier counted bytes drifted from its index"

    # ---- expiry and capacity ---------------------------------------------------------------------
    def _sweep_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception as exc:  # noqa: BLE001 - a failed pass is logged; the next one tries again
                self.sweep_errors += 1
                self._log_fault("sweep", exc)
            self._stop.wait(self.sweep_interval_s)

    def stop(self) -> None:
        """End the sweep thread after its current pass (it is not waited for)."""
        self._stop.set()

    def sweep(self) -> None:
        """One pass: LIST the namespace, delete objects past the TTL, re-count it and delete the
        oldest past the cap.  Runs on the sweep thread (and in tests).

        Raises:
            Exception: the server failed (obstore's errors); the count is left as it was.
        """
        started = time.time()
        found = self.objects.run(lambda: self.objects.list(SWEEP_MAX_OBJECTS), CLEAR_DEADLINE_S)
        expired = [k for k, _, mtime in found if self.expired(mtime)]
        if expired:
            self.objects.delete([self.objects.key(k) for k in expired])
            self.expired_deleted += len(expired)
        gone = set(expired)
        if self.capacity_bytes is not None:
            with self._lock:
                listed = {k: (size, mtime) for k, size, mtime in sorted(found, key=lambda f: f[2]) if k not in gone}
                # keys written while the LIST ran are kept; everything else is as the bucket says
                fresh = {k: v for k, v in self._index.items() if k not in listed and v[1] >= int(started)}
                self._index = OrderedDict(list(listed.items()) + list(fresh.items()))
                self._used = sum(size for size, _ in self._index.values())
            if self._used > self.capacity_bytes:
                self._evict_past_cap()
        else:
            for key in expired:
                self.forget(key)
        self.sweeps += 1

    def fit(self) -> None:
        """Past the cap (after :meth:`add`): delete the oldest objects until the namespace fits."""
        if self.capacity_bytes is not None and self._used > self.capacity_bytes:
            self._evict_past_cap()

    def _evict_past_cap(self) -> None:
        """Delete the oldest objects until the namespace fits the cap; one rewritten since it was
        counted (``Last-Modified`` newer) is kept and counted as new instead, and the next oldest
        is taken in its place (at most :data:`EVICT_PASSES` passes, so a bucket rewritten as fast
        as it is trimmed cannot hold the caller)."""
        assert self.capacity_bytes is not None
        for _ in range(EVICT_PASSES):
            with self._lock:
                excess = self._used - self.capacity_bytes
                victims: list[tuple[ChunkKey, float]] = []
                for key, (size, mtime) in self._index.items():
                    if excess <= 0:
                        break
                    victims.append((key, mtime))
                    excess -= size
            if not victims:
                return
            paths = [self.objects.key(k) for k, _ in victims]
            metas = self.objects.run(lambda paths=paths: self.objects.each(self.head, paths))  # type: ignore[misc]
            doomed = []
            kept = 0
            with self._lock:
                for (key, mtime), meta in zip(victims, metas, strict=True):
                    now_mtime = meta["last_modified"].timestamp() if meta is not None else None
                    if now_mtime is not None and now_mtime >= mtime + REWRITTEN_S and key in self._index:
                        self._index[key] = (self._index[key][0], now_mtime)
                        self._index.move_to_end(key)
                        kept += 1
                        continue
                    doomed.append(key)
                    entry = self._index.pop(key, None)
                    if entry is not None:
                        self._used -= entry[0]
            self.objects.delete([self.objects.key(k) for k in doomed])
            self.evicted += len(doomed)
            if not kept:
                return
