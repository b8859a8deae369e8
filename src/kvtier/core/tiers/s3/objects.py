"""One namespace's objects in the s3 tier's bucket, and the event loop their requests run on.

The tier's data path (:mod:`kvtier.core.tiers.s3.tier`), its conditional-put probe
(:mod:`kvtier.core.tiers.s3.conditional`) and its space accounting (:mod:`kvtier.core.tiers.s3.space`)
all reach the bucket through one :class:`S3Objects`:

- object keys are built here only: ``<prefix><chunk key hex>``, the prefix being
  ``<s3_key_prefix><namespace hex>[-<keyspace>]/`` (the tier's module docstring, "Keys");
- every request runs on one asyncio loop on a thread of its own (``kvtier-s3-io``), at most
  ``concurrency`` in flight, one gate shared by all callers;
- :meth:`S3Objects.close` cancels what is in flight, so no thread waits on a stopped loop.

Thread-safe: :meth:`S3Objects.run` and :meth:`S3Objects.delete` may be called from any thread;
the ``async`` methods run on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvtier.core.keys import KEY_BYTES, ChunkKey

log = logging.getLogger(__name__)
T = TypeVar("T")
CALL_BOUND_S = 300.0
"""Longest a thread waits for one call on the tier's event loop, seconds (far above any caller's
deadline: a bound on the wrapper's thread, not a deadline anyone is served by)."""
DELETE_BATCH = 1000
"""Keys per bulk delete (S3 ``DeleteObjects`` takes at most 1000)."""


class S3Objects:
    """The objects under ``prefix`` in the bucket of ``store``, and the loop that sends requests.

    Args:
        store: an obstore ``S3Store`` on the bucket (:func:`kvtier.core.tiers.s3.client.make_store`).
        prefix: the namespace's "directory", ending in ``/``.
        concurrency: requests in flight at most.
    """

    def __init__(self, store: Any, prefix: str, concurrency: int) -> None:
        self.store = store
        self.prefix = prefix
        self.concurrency = concurrency
        self.closed = False
        self.loop = asyncio.new_event_loop()
        self._gate: asyncio.Semaphore | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvtier-s3-io", daemon=True)
        self._thread.start()

    def key(self, chunk: ChunkKey) -> str:
        """The object key of a chunk (the only place keys are built)."""
        return self.prefix + chunk.hex()

    def chunk_of(self, path: str) -> ChunkKey | None:
        """The chunk key of an object of this namespace, or ``None`` for any other object."""
        name = path[len(self.prefix):] if path.startswith(self.prefix) else ""
        if len(name) != 2 * KEY_BYTES:
            return None
        try:
            return ChunkKey(bytes.fromhex(name))
        except ValueError:
            return None

    def run(self, make: Callable[[], Coroutine[Any, Any, T]], timeout_s: float | None = None) -> T:
        """Run a coroutine on the loop and wait for it, at most ``timeout_s`` (default
        :data:`CALL_BOUND_S`: the wrapper bounds the caller's own wait far below it; this bounds
        the wrapper's thread, which :meth:`close` also releases by cancelling what is in flight).

        Raises:
            RuntimeError: the tier is closed.
            TimeoutError / CancelledError: the bound passed, or :meth:`close` cancelled the call.
        """
        if self.closed:
            raise RuntimeError("the s3 tier is closed")
        future = asyncio.run_coroutine_threadsafe(make(), self.loop)
        return future.result(timeout=CALL_BOUND_S if timeout_s is None else timeout_s)

    def requests(self) -> asyncio.Semaphore:
        """The gate of requests in flight: at most ``concurrency``, shared by all callers (on the loop)."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.concurrency)
        return self._gate

    async def each(self, fn: Callable[[Any], Awaitable[T]], items: Sequence[Any]) -> list[T]:
        """``fn(item)`` for every item, at most ``concurrency`` at once (shared by all callers)."""
        gate = self.requests()

        async def one(item: Any) -> T:
            async with gate:
                return await fn(item)
        return list(await asyncio.gather(*(one(i) for i in items)))

    def wake(self, events: Sequence[asyncio.Event]) -> None:
        """Set ``events`` (waited on by coroutines on the loop) from any thread; nothing once the
        loop is closed (nothing waits on it)."""
        def set_all() -> None:
            for event in events:
                event.set()
        try:
            self.loop.call_soon_threadsafe(set_all)
        except RuntimeError:  # the loop is closed: nothing waits on it
            pass

    async def head(self, path: str) -> dict[str, Any] | None:
        """The object's metadata (obstore's ``ObjectMeta``), or ``None`` if it is absent."""
        import obstore

        try:
            return dict(await obstore.head_async(self.store, path))
        except FileNotFoundError:
            return None

    async def read_range(self, path: str, start: int, end: int) -> bytes | None:
        """The object's bytes ``start..end`` (``start < end``, within the object), ``None`` if it
        is absent: a ranged ``GET``; from a gateway that ignores ``Range`` and answers the whole
        object (``rclone serve s3``: obstore then refuses a "non-partial response"), the object's
        bytes streamed up to ``end``, the rest not read."""
        import obstore

        async with self.requests():
            try:
                try:
                    return bytes(await obstore.get_range_async(self.store, path, start=start, end=end))
                except Exception as exc:
                    if "non-partial" not in str(exc):
                        raise
                got = await obstore.get_async(self.store, path)
                data = bytearray()
                async for part in got.stream(min_chunk_size=min(end, 1 << 20)):
                    data += part
                    if len(data) >= end:
                        break
                return bytes(data[start:end])
            except FileNotFoundError:
                return None

    async def head_and_range(self, path: str, size: int, start: int, end: int) -> tuple[int, bytes, bytes] | None:
        """``(size, the first HEADER bytes, bytes start..end)`` of an object of ``size`` bytes (both
        clipped at its end, read in parallel), ``None`` if it vanished meanwhile."""
        from kvtier.core.envelope import FIXED_BYTES

        async def nothing() -> bytes:
            return b""
        end = min(end, size)
        head, data = await asyncio.gather(self.read_range(path, 0, min(FIXED_BYTES, size)) if size else nothing(),
                                          self.read_range(path, start, end) if start < end else nothing())
        return None if head is None or data is None else (size, head, data)

    def delete(self, paths: list[str]) -> None:
        """Delete objects (bulk ``DeleteObjects`` of up to :data:`DELETE_BATCH`; a missing one is no error)."""
        import obstore

        async def delete(batch: list[str]) -> None:
            await obstore.delete_async(self.store, batch)

        batches = [paths[i:i + DELETE_BATCH] for i in range(0, len(paths), DELETE_BATCH)]
        if batches:
            self.run(lambda: self.each(delete, batches))

    async def list(self, limit: int) -> list[tuple[ChunkKey, int, float]]:
        """This namespace's objects (key, bytes, mtime), at most ``limit``; other objects skipped."""
        import obstore

        out: list[tuple[ChunkKey, int, float]] = []
        async for page in obstore.list(self.store, self.prefix.rstrip("/"), chunk_size=1000):
            for meta in page:
                key = self.chunk_of(meta["path"])
                if key is not None:
                    out.append((key, int(meta["size"]), meta["last_modified"].timestamp()))
            if len(out) >= limit:
                break
        return out

    async def _cancel_in_flight(self) -> None:
        """Cancel every request still running on the loop (at :meth:`close`), so no thread waits
        on a loop that has stopped."""
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=2.0) if tasks else None

    def close(self) -> None:
        """Refuse further calls, cancel the requests in flight and stop the loop (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:  # a request hung on a stalled server must not keep its waiting thread (and the process) alive
            asyncio.run_coroutine_threadsafe(self._cancel_in_flight(), self.loop).result(timeout=5.0)
        except Exception:  # closing: the loop is stopped below either way
            log.debug("s3 tier: cancelling in-flight requests at close did not finish", exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
