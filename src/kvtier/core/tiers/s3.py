"""S3 object-store shared tier (AWS S3, MinIO, Ceph RGW, Cloudflare R2, any S3 API) on obstore.

- **One object per chunk**, written whole with one ``PUT`` (never multipart): the same value as
  the redis tier's, a header (format version, namespace digest, key, length, the writer's tenant
  record, XXH3 checksum or keyed BLAKE3 MAC with ``shared_secret``) then the payload (:mod:`kvtier.core.tiers.sharedvalue`).
  A ``PUT`` is atomic in S3: a reader sees no object, the old one or the whole new one, never a
  part (AWS S3 user guide, "Amazon S3 data consistency model"); a read still verifies everything,
  and a short body, a foreign namespace or a digest mismatch is a counted ``CORRUPT`` miss and the
  object is deleted.
- **Keys**: ``<s3_key_prefix><namespace hex>[-<keyspace>]/<chunk key hex>``.  The key space of
  ``shared_secret`` (:func:`~kvtier.core.tiers.sharedvalue.keyspace`) keeps engines under
  different secrets apart, as in the redis tier; a LIST of one namespace's "directory" never
  lists another's.
- **Batches in parallel**: ``contains_many`` is one ``HEAD`` per chunk, ``get_many`` one ``GET``
  per chunk and ``put_many`` one ``PUT`` per chunk, at most ``s3_concurrency`` requests in flight
  (one asyncio loop on the tier's own thread drives them all).
- **Writes never replace an object** (chunk bytes never change under their key).  With
  ``s3_conditional_put`` each ``PUT`` carries ``If-None-Match: *`` and the server refuses one on an
  existing key (``412 Precondition Failed``; AWS S3 user guide, "Add preconditions to S3
  operations with conditional requests"): that chunk is ``PRESENT``, with no ``HEAD`` first.  Not
  every gateway honours the header (``rclone serve s3`` v1.75 replaces the object and answers
  ``200``), so the first write of a tier asks the server once: it creates a probe object under the
  namespace (a name that is no chunk key), creates it again and deletes it; a server that accepts
  the second create ignores the header, and the tier then sends a ``HEAD`` before each ``PUT``, as
  it does without ``s3_conditional_put`` (which writes with no header, for a gateway that answers
  ``501`` to it).  A ``412`` comes after the chunk's bytes were sent, where a ``HEAD`` would have
  cost one round trip: the saving holds while most chunks written are new (a chunk is written
  again when another engine computed and saved it too).
- **Behind the wrapper, the data path is the tier's own** (it implements the wrapper's
  :class:`~kvtier.core.tiers.guarded.SplitTier`): a read's bodies are buffers obstore allocated
  for the call, verified and copied once into the caller's buffers on the caller's thread after
  the fetch returned in time; a write's objects (header + payload, the one copy a write needs)
  are encoded on the caller's thread while the probe or the ``HEAD`` requests are on the wire.
- **Deadlines, breaker, metrics**: the factory wraps this tier in
  :class:`~kvtier.core.tiers.guarded.GuardedTier` (``shared_deadline_s`` for lookups and
  deletes, ``shared_transfer_deadline_s`` for reads and writes, ``s3_breaker_*``).  This class
  raises on a fault; a ``403`` (``PermissionDeniedError``) is a refusal that fails the call but
  leaves the breaker closed, as a full Redis's ``-OOM`` does.
- **Expiry and capacity**: the bucket evicts nothing by itself.  With ``s3_ttl_s`` an object
  older than the TTL (by its ``Last-Modified``) is a miss, and a background sweep every
  ``s3_sweep_interval_s`` LISTs the namespace and deletes expired objects (a bucket lifecycle
  rule, where the server has them, does the same at day granularity: docs/s3.md).  With
  ``s3_capacity_gib`` the same pass re-counts the namespace (so the count starts from what the
  bucket holds and includes other engines' objects, once each: objects are counted by key), and
  the oldest objects past the cap are deleted; before each delete a ``HEAD`` checks that the
  object was not rewritten since it was counted, so one engine never deletes another's fresh
  object on an old count.

Thread-safe.  Numbers: :meth:`S3Tier.wire_stats` (bytes, seconds, corrupt values; the wrapper
adds errors, skipped calls and the breaker).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from kvtier.core import tenant
from kvtier.core.errors import ConfigError
from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.stats import WireCounters, WireStats
from kvtier.core.tiers.base import ClearResult, GetResult, PutResult, Tier, TierUsage
from kvtier.core.tiers.breaker import CircuitBreaker
from kvtier.core.tiers.buffers import BufferPool
from kvtier.core.tiers.guarded import GuardedTier, PutStream, WriteAbandoned, split_get
from kvtier.core.tiers.s3client import (
    brief,
    http_refusal,
    make_store,
    not_implemented,
    read_credentials,
    where,
)
from kvtier.core.tiers.s3settings import S3Settings, s3_settings
from kvtier.core.tiers.sharedvalue import HEADER_BYTES, ValueCodec, keyspace, shared_secret, verify_into

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.factory import TierContext

log = logging.getLogger(__name__)
T = TypeVar("T")
GiB = 1 << 30
WRITTEN_KEYS_MAX = 1 << 16
"""Keys remembered without a capacity cap (``indexed``/``keys``), most recent kept."""
ENCODE_BUFFER_BYTES = 256 << 20
"""Bytes of encoded-object buffers kept for reuse between writes (:mod:`kvtier.core.tiers.buffers`:
a fresh 32 MiB buffer costs ~4x the copy into it)."""
CLEAR_DEADLINE_S = 60.0
"""Longest a clear (a reset) lists and deletes a namespace's objects, seconds."""
CALL_BOUND_S = 300.0
"""Longest a thread waits for one call on the tier's event loop, seconds (far above any caller's
deadline: a bound on the wrapper's thread, not a deadline anyone is served by)."""
SWEEP_MAX_OBJECTS = 1_000_000
"""Objects one sweep lists at most (a larger namespace is swept in part each interval)."""
EVICT_PASSES = 4
"""Eviction passes at most per call (each a HEAD batch of the victims, then one delete)."""
DELETE_BATCH = 1000
"""Keys per bulk delete (S3 ``DeleteObjects`` takes at most 1000)."""
PROBE_NAME = "kvtier-conditional-put-probe-"
"""Start of the probe object's name (under the namespace; never a chunk key, which is 32 hex
digits, so sweeps, clears and purges pass it by)."""
REWRITTEN_S = 1.0
"""An object whose ``Last-Modified`` is at least this much newer than counted was rewritten: kept.
``Last-Modified`` has one-second resolution (an HTTP date), so a chunk this process stored is
counted at the whole second it was stored in (the engine's and the server's clocks kept in sync)."""


def _is_missing(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError)


class S3Tier(Tier):
    """Chunks as objects in one S3 bucket (see the module docstring).  Raises on a fault: use it
    behind :class:`~kvtier.core.tiers.guarded.GuardedTier` (:func:`from_config` does).

    Args:
        store: an obstore ``S3Store`` on the bucket (:func:`kvtier.core.tiers.s3client.make_store`).
        namespace: 16-byte namespace digest.
        secret: shared secret bytes (keyed MAC) or ``None``.
        key_prefix: prefix of every object key (empty or ending in ``/``).
        concurrency: requests in flight at most.
        capacity_bytes: cap on the namespace's objects (value bytes), or ``None``.
        ttl_s: seconds an object lives, or ``None``.
        sweep_interval_s: seconds between background sweeps (with a TTL or a cap).
        conditional_put: write with ``If-None-Match: *``.
        where: endpoint/bucket/prefix, for log lines.
        produce_wait_s: longest a write waits for the caller's thread to encode its objects,
            seconds (:meth:`stream_put`); the wrapper's abandon ends the wait sooner.
    """

    name = "s3"
    shared = True

    def __init__(self, store: Any, namespace: bytes, secret: bytes | None, key_prefix: str, concurrency: int,
                 capacity_bytes: int | None = None, ttl_s: int | None = None, sweep_interval_s: float = 300.0,
                 conditional_put: bool = True, where: str = "s3", produce_wait_s: float = 5.0) -> None:
        super().__init__()
        from obstore.exceptions import AlreadyExistsError, PermissionDeniedError, PreconditionError

        self.refusal_errors: tuple[type[BaseException], ...] = (PermissionDeniedError,)
        self._exists_errors = (AlreadyExistsError, PreconditionError)
        self.store = store
        self.codec = ValueCodec(namespace, secret)
        space = keyspace(secret).rstrip(":")
        self.prefix = f"{key_prefix}{namespace.hex()}{'-' + space if space else ''}/"
        self.concurrency = concurrency
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.sweep_interval_s = sweep_interval_s
        self.conditional_put = conditional_put
        self.conditional_honoured: bool | None = None if conditional_put else False
        """Whether the server refuses a ``PUT`` with ``If-None-Match: *`` on an existing key:
        ``None`` until the first write asks it (:meth:`_ask_conditional`), ``False`` without
        ``s3_conditional_put``; while not ``True`` each ``PUT`` follows a ``HEAD``."""
        self._probe_lock: asyncio.Lock | None = None
        self.where = where
        self.produce_wait_s = produce_wait_s
        self.encode_buffers = BufferPool(ENCODE_BUFFER_BYTES)
        self.wire = WireCounters()
        self.sweeps = 0
        self.sweep_errors = 0
        self.expired_deleted = 0
        self.evicted = 0
        self._lock = threading.Lock()
        self._index: OrderedDict[ChunkKey, tuple[int, float]] = OrderedDict()  # key -> (bytes, mtime), oldest first
        self._used = 0
        self._closed = False
        self._stop = threading.Event()
        self._last_error = 0.0
        self._loop = asyncio.new_event_loop()
        self._gate: asyncio.Semaphore | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-s3-io", daemon=True)
        self._thread.start()
        self._sweeper: threading.Thread | None = None
        if capacity_bytes is not None or ttl_s is not None:
            self._sweeper = threading.Thread(target=self._sweep_loop, name="kvtier-s3-sweep", daemon=True)
            self._sweeper.start()

    # ---- keys and the event loop ---------------------------------------------------------------
    def object_key(self, key: ChunkKey) -> str:
        """The object key of a chunk (the only place keys are built)."""
        return self.prefix + key.hex()

    def _chunk_of(self, path: str) -> ChunkKey | None:
        """The chunk key of an object of this namespace, or ``None`` for any other object."""
        name = path[len(self.prefix):] if path.startswith(self.prefix) else ""
        if len(name) != 2 * KEY_BYTES:
            return None
        try:
            return ChunkKey(bytes.fromhex(name))
        except ValueError:
            return None

    def _run(self, make: Callable[[], Coroutine[Any, Any, T]], timeout_s: float | None = None) -> T:
        """Run a coroutine on the tier's loop and wait for it, at most ``timeout_s`` (default
        :data:`CALL_BOUND_S`: the wrapper bounds the caller's own wait far below it; this bounds
        the wrapper's thread, which :meth:`close` also releases by cancelling what is in flight).

        Raises:
            RuntimeError: the tier is closed.
            TimeoutError / CancelledError: the bound passed, or :meth:`close` cancelled the call.
        """
        if self._closed:
            raise RuntimeError("the s3 tier is closed")
        future = asyncio.run_coroutine_threadsafe(make(), self._loop)
        return future.result(timeout=CALL_BOUND_S if timeout_s is None else timeout_s)

    async def _cancel_in_flight(self) -> None:
        """Cancel every request still running on the loop (at :meth:`close`), so no thread waits
        on a loop that has stopped."""
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=2.0) if tasks else None

    def _requests(self) -> asyncio.Semaphore:
        """The gate of requests in flight: at most ``concurrency``, shared by all callers (on the loop)."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.concurrency)
        return self._gate

    async def _each(self, fn: Callable[[Any], Awaitable[T]], items: Sequence[Any]) -> list[T]:
        """``fn(item)`` for every item, at most ``concurrency`` at once (shared by all callers)."""
        gate = self._requests()

        async def one(item: Any) -> T:
            async with gate:
                return await fn(item)
        return list(await asyncio.gather(*(one(i) for i in items)))

    async def _head(self, path: str) -> dict[str, Any] | None:
        """The object's metadata, or ``None`` if it is absent (or expired)."""
        import obstore

        try:
            meta = await obstore.head_async(self.store, path)
        except FileNotFoundError:
            return None
        if self._expired(meta["last_modified"].timestamp()):
            return None
        return dict(meta)

    def _expired(self, mtime: float) -> bool:
        return self.ttl_s is not None and time.time() - mtime > self.ttl_s

    # ---- Tier contract ---------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        metas = self._run(lambda: self._each(self._head, [self.object_key(k) for k in keys]))
        return [m is not None for m in metas]

    def get_into(self, key: ChunkKey, dst: memoryview) -> GetResult:
        return self.get_many([key], [dst])[0]

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview]) -> list[GetResult]:
        """:meth:`fetch_many` then :meth:`finish_get` on this thread, corrupt objects deleted (the
        wrapper splits the two halves over its thread and the caller's)."""
        if not keys:
            return []
        return split_get(self, keys, dsts, lambda: self.fetch_many(keys), self.delete_many)

    def fetch_many(self, keys: Sequence[ChunkKey]) -> tuple[list[Any], float]:
        """(:class:`~kvtier.core.tiers.guarded.SplitTier`) One parallel ``GET`` per key: each body
        (a buffer obstore allocated for this call) or ``None`` where there is no live object, and
        when the fetch started.  An object past ``s3_ttl_s`` is not read but deleted here (a fault
        of that delete is logged; the sweep deletes it later)."""
        import obstore

        t0 = time.perf_counter()
        expired: list[str] = []

        async def fetch(path: str) -> Any:
            try:
                got = await obstore.get_async(self.store, path)
                if self._expired(got.meta["last_modified"].timestamp()):
                    expired.append(path)  # a miss, deleted below
                    return None
                return await got.bytes_async()
            except FileNotFoundError:
                return None

        async def fetch_all() -> list[Any]:
            values = await self._each(fetch, [self.object_key(k) for k in keys])
            if expired:
                try:
                    for i in range(0, len(expired), DELETE_BATCH):
                        await obstore.delete_async(self.store, expired[i:i + DELETE_BATCH])
                except Exception as exc:  # noqa: BLE001 - the object stays; the sweep or the next read deletes it
                    self._log_fault("delete", exc)
            return values

        return (self._run(fetch_all) if keys else []), t0

    def finish_get(self, keys: Sequence[ChunkKey], fetched: tuple[list[Any], float],
                   dsts: Sequence[memoryview]) -> list[GetResult]:
        """(:class:`~kvtier.core.tiers.guarded.SplitTier`) Verify each body of :meth:`fetch_many`
        and copy its payload into ``dsts[i]``: ``HIT``; no live object: ``MISS``; short, foreign
        or failing its digest: ``CORRUPT`` (counted; the caller deletes it).  No network."""
        values, t0 = fetched
        done = verify_into(self.codec, keys, values, dsts, f"kvtier {self.name} tier ({self.where})", self._forget)
        with self._lock:
            self.corrupt += done.corrupt
        self.wire.corrupt(done.corrupt)
        self.wire.moved("read", done.payload_bytes, time.perf_counter() - t0)
        return done.results

    async def _ask_conditional(self) -> bool:
        """Whether the server honours ``If-None-Match: *`` (:attr:`conditional_honoured`), asked
        once per tier: create a probe object, create it again (a server that honours the header
        refuses), delete it.  A fault raises (the write fails as any would) and the next write asks
        again.

        Raises:
            obstore.exceptions.BaseError: the server failed or refused the first create.
        """
        import obstore

        if self.conditional_honoured is not None:
            return self.conditional_honoured
        if self._probe_lock is None:
            self._probe_lock = asyncio.Lock()
        async with self._probe_lock:
            if self.conditional_honoured is not None:  # another batch asked meanwhile
                return self.conditional_honoured
            path = f"{self.prefix}{PROBE_NAME}{uuid.uuid4().hex[:16]}"
            try:
                try:
                    async with self._requests():
                        await obstore.put_async(self.store, path, b"kvtier probe", use_multipart=False, mode="create")
                except Exception as exc:
                    if not not_implemented(exc):
                        raise
                    log.warning("kvtier s3 tier (%s): the server answers 501 Not Implemented to If-None-Match: *; "
                                "each write HEADs its object first and PUTs without the header (set "
                                "s3_conditional_put: false to skip this probe)", self.where)
                    self.conditional_honoured = False
                    return False
                try:
                    async with self._requests():
                        await obstore.put_async(self.store, path, b"kvtier probe", use_multipart=False, mode="create")
                    honoured = False
                except self._exists_errors:
                    honoured = True
            finally:
                try:
                    async with self._requests():
                        await obstore.delete_async(self.store, path)
                except Exception as exc:  # noqa: BLE001 - a left-over probe object is a few bytes no sweep counts
                    self._log_fault("delete of the conditional-put probe", exc)
            if not honoured:
                log.warning("kvtier s3 tier (%s): the server ignores If-None-Match: * (a second conditional PUT "
                            "replaced the object); each write HEADs its object first, one round trip more per "
                            "chunk (AWS S3 honours the header; rclone serve s3 does not)", self.where)
            self.conditional_honoured = honoured
            return honoured

    def ask_conditional(self) -> bool:
        """Whether the server honours ``If-None-Match: *`` (asked once, then remembered:
        :attr:`conditional_honoured`); ``False`` without ``s3_conditional_put``.

        Raises:
            obstore.exceptions.BaseError: the server failed or refused (nothing remembered).
        """
        return self.conditional_put and self._run(self._ask_conditional)

    def put(self, key: ChunkKey, data: memoryview | bytes) -> PutResult:
        return self.put_many([key], [data])[0]

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes]) -> list[PutResult]:
        """:meth:`stream_put` on this thread alone: every object encoded, then sent."""
        if not keys:
            return []
        stream = self.stream_put(keys, datas)
        try:
            stream.produce(time.perf_counter() + self.produce_wait_s)
            return stream.send()
        finally:
            stream.abandon()

    def stream_put(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes]) -> PutStream:
        """One whole-object ``PUT`` per chunk (parallel), as a
        :class:`~kvtier.core.tiers.guarded.PutStream`.  A chunk already stored is ``PRESENT`` and
        keeps its object (chunk bytes never change under their key): with ``s3_conditional_put``
        on a server that honours ``If-None-Match: *`` the server's ``412`` says so; otherwise a
        ``HEAD`` before each ``PUT`` does (module docstring, "Writes never replace an object").

        ``produce`` (the caller's thread) encodes every object, header + payload: the one copy a
        write needs, so ``send`` never reads ``datas`` and the caller may reuse them once
        ``put_many`` returns.  ``send``'s probe or ``HEAD`` requests go out meanwhile; each ``PUT``
        waits for the encoded objects at most ``produce_wait_s`` (``abandon`` ends the wait).  Each
        header carries the tenant record of :func:`kvtier.core.tenant.current` on the calling thread
        (set by the store's writer)."""
        import obstore

        paths = [self.object_key(k) for k in keys]
        sizes = [memoryview(d).nbytes for d in datas]
        writer = tenant.current()  # the store's writer thread: produce may run elsewhere
        values: list[bytearray | memoryview] = []
        encoded = [asyncio.Event() for _ in keys]  # set on the loop: by produce as each object is encoded, or by abandon
        abandoned = threading.Event()
        exists_errors = self._exists_errors
        pool = self.encode_buffers

        def wake(events: Sequence[asyncio.Event]) -> None:
            def set_all() -> None:
                for event in events:
                    event.set()
            try:
                self._loop.call_soon_threadsafe(set_all)
            except RuntimeError:  # the loop is closed: nothing waits on it
                pass

        async def write(i: int, head_first: bool) -> tuple[str, float]:
            gate = self._requests()  # held for each request, never while waiting for produce
            reusable = True  # False while a PUT may still read the object (a cancelled call's may)
            try:
                if head_first:
                    async with gate:
                        meta = await self._head(paths[i])
                    if meta is not None:
                        return "present", meta["last_modified"].timestamp()
                try:
                    await asyncio.wait_for(encoded[i].wait(), self.produce_wait_s)
                except TimeoutError:
                    raise WriteAbandoned(f"the objects of {len(keys)} chunks were not encoded in time") from None
                if abandoned.is_set():  # the caller stopped waiting (or produce failed): no new PUT
                    raise WriteAbandoned(f"the write of {len(keys)} chunks was abandoned")
                # a server that ignores If-None-Match (or refuses it) gets a plain PUT after the HEAD
                mode: Literal["create", "overwrite"] = "overwrite" if head_first else "create"
                async with gate:
                    reusable = False
                    try:
                        await obstore.put_async(self.store, paths[i], values[i], use_multipart=False, mode=mode)
                    except exists_errors:  # 412: there already (its Last-Modified unknown: counted as now)
                        reusable = True
                        return "present", float(int(time.time()))
                    except Exception:  # the request ended with an error: it reads the object no more
                        reusable = True
                        raise
                    reusable = True
                return "stored", float(int(time.time()))  # whole seconds, as Last-Modified
            finally:  # no request reads the encoded object any more: its buffer is reused
                if reusable and i < len(values):
                    pool.give([values[i]])

        async def write_all() -> list[tuple[str, float]]:
            head_first = not (self.conditional_put and await self._ask_conditional())
            return list(await asyncio.gather(*(write(i, head_first) for i in range(len(keys)))))

        def produce(_deadline: float) -> None:
            # Each PUT starts as soon as its own object is encoded (the next is encoded meanwhile).
            for i, (key, data) in enumerate(zip(keys, datas, strict=True)):
                if abandoned.is_set():
                    return
                values.append(self.codec.encode(key, data, pool.take(HEADER_BYTES + sizes[i]), writer=writer))
                wake(encoded[i:i + 1])

        def send() -> list[PutResult]:
            t0 = time.perf_counter()
            outcomes = self._run(write_all)
            return self._written_now(keys, sizes, outcomes, t0)

        def abandon() -> None:
            abandoned.set()
            wake(encoded)
        return PutStream(send, produce, abandon)

    def _written_now(self, keys: Sequence[ChunkKey], payload_bytes: list[int], outcomes: list[tuple[str, float]],
                     t0: float) -> list[PutResult]:
        """Account one written batch (``outcomes``: ``("stored" | "present", mtime)`` per chunk)."""
        sizes = [HEADER_BYTES + n for n in payload_bytes]
        stored_bytes = 0
        with self._lock:
            for key, (outcome, mtime), size in zip(keys, outcomes, sizes, strict=True):
                if key not in self._index:  # counted once per key, whoever wrote it
                    self._index[key] = (size, mtime)
                    self._used += size
                if outcome == "stored":
                    stored_bytes += size - HEADER_BYTES
            self._trim_unbounded()
        self.wire.moved("write", stored_bytes, time.perf_counter() - t0)
        if self.capacity_bytes is not None and self._used > self.capacity_bytes:
            self._evict_past_cap()
        return [PutResult.STORED if o == "stored" else PutResult.PRESENT for o, _ in outcomes]

    def _trim_unbounded(self) -> None:
        """Without a cap, remember at most :data:`WRITTEN_KEYS_MAX` keys (the lock is held)."""
        if self.capacity_bytes is not None:
            return
        while len(self._index) > WRITTEN_KEYS_MAX:
            _, (size, _mtime) = self._index.popitem(last=False)
            self._used -= size

    def delete(self, key: ChunkKey) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """``HEAD`` then delete: ``True`` for each key whose object was there."""
        if not keys:
            return []
        paths = [self.object_key(k) for k in keys]
        for key in keys:
            self._forget(key)
        metas = self._run(lambda: self._each(self._head, paths))
        there = [p for p, m in zip(paths, metas, strict=True) if m is not None]
        self._delete_paths(there)
        return [m is not None for m in metas]

    def _delete_paths(self, paths: list[str]) -> None:
        """Delete objects (bulk ``DeleteObjects`` of up to :data:`DELETE_BATCH`; a missing one is no error)."""
        import obstore

        async def delete(batch: list[str]) -> None:
            await obstore.delete_async(self.store, batch)

        batches = [paths[i:i + DELETE_BATCH] for i in range(0, len(paths), DELETE_BATCH)]
        if batches:
            self._run(lambda: self._each(delete, batches))

    def _forget(self, key: ChunkKey) -> None:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._used -= entry[0]

    async def _list(self, limit: int) -> list[tuple[ChunkKey, int, float]]:
        """This namespace's objects (key, bytes, mtime), at most ``limit``; other objects skipped."""
        import obstore

        out: list[tuple[ChunkKey, int, float]] = []
        async for page in obstore.list(self.store, self.prefix.rstrip("/"), chunk_size=1000):
            for meta in page:
                key = self._chunk_of(meta["path"])
                if key is not None:
                    out.append((key, int(meta["size"]), meta["last_modified"].timestamp()))
            if len(out) >= limit:
                break
        return out

    def clear(self) -> ClearResult:
        """Delete every object of this tier's namespace (and key space) in the bucket, never
        another's; ``ok`` is ``False`` if the server did not list and delete them within
        :data:`CLEAR_DEADLINE_S`."""
        with self._lock:
            self._index.clear()
            self._used = 0
        try:
            found = self._run(lambda: self._list(SWEEP_MAX_OBJECTS), CLEAR_DEADLINE_S)
            self._delete_paths([self.object_key(k) for k, _, _ in found])
        except Exception as exc:  # noqa: BLE001 - any fault: the reset reports it, never raises
            self._log_fault("clear", exc)
            return ClearResult([], False, f"the S3 server at {self.where} did not list and delete the "
                                          f"namespace's objects ({type(exc).__name__})")
        return ClearResult([k for k, _, _ in found])

    # ---- expiry and capacity ---------------------------------------------------------------------
    def _sweep_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception as exc:  # noqa: BLE001 - a failed pass is logged; the next one tries again
                self.sweep_errors += 1
                self._log_fault("sweep", exc)
            self._stop.wait(self.sweep_interval_s)

    def sweep(self) -> None:
        """One pass: LIST the namespace, delete objects past the TTL, re-count it and delete the
        oldest past the cap.  Runs on the sweep thread (and in tests).

        Raises:
            Exception: the server failed (obstore's errors); the count is left as it was.
        """
        started = time.time()
        found = self._run(lambda: self._list(SWEEP_MAX_OBJECTS), CLEAR_DEADLINE_S)
        expired = [k for k, _, mtime in found if self._expired(mtime)]
        if expired:
            self._delete_paths([self.object_key(k) for k in expired])
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
                self._forget(key)
        self.sweeps += 1

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
            paths = [self.object_key(k) for k, _ in victims]
            metas = self._run(lambda paths=paths: self._each(self._head, paths))  # type: ignore[misc]
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
            self._delete_paths([self.object_key(k) for k in doomed])
            self.evicted += len(doomed)
            if not kept:
                return

    # ---- the rest of the contract ----------------------------------------------------------------
    def indexed(self, key: ChunkKey) -> bool:
        """Whether this process wrote (or counted) ``key`` and has not seen it vanish (no network)."""
        with self._lock:
            return key in self._index

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._index)

    def stored_bytes(self, payload_bytes: int) -> int:
        return payload_bytes + HEADER_BYTES

    def usage(self) -> TierUsage:
        with self._lock:
            used, n = self._used, len(self._index)
        if self.capacity_bytes is None:
            return TierUsage(used, 0, used, n)
        return TierUsage(used, max(self.capacity_bytes - used, 0), max(self.capacity_bytes, used), n)

    def check(self) -> None:
        with self._lock:
            assert self._used == sum(size for size, _ in self._index.values()), \
                "s3 tier counted bytes drifted from its index"

    def wire_stats(self) -> WireStats:
        return self.wire.snapshot(0, 0)

    def _log_fault(self, op: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_error > 10.0:  # one line per 10 s
            self._last_error = now
            log.warning("kvtier s3 tier (%s): %s failed (%s: %s)", self.where, op, type(exc).__name__, brief(str(exc)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        try:  # a request hung on a stalled server must not keep its waiting thread (and the process) alive
            asyncio.run_coroutine_threadsafe(self._cancel_in_flight(), self._loop).result(timeout=5.0)
        except Exception:  # closing: the loop is stopped below either way
            log.debug("s3 tier: cancelling in-flight requests at close did not finish", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def check(config: KVTierConfig) -> list[tuple[str, str]]:
    """What start-up would refuse, read as it reads it: no bucket, plain HTTP without
    ``s3_allow_http``, unreadable credentials (the file, or half of the environment pair), the
    shared secret file; ``(config key, message)`` each."""
    settings = s3_settings(config)
    problems: list[tuple[str, str]] = []
    if not settings.s3_bucket:
        message = "the s3 tier has s3_endpoint_url but no s3_bucket; name the bucket (created beforehand)"
        problems.append(("s3_bucket", message))
    if (refusal := http_refusal(settings)) is not None:
        problems.append(("s3_allow_http", refusal))
    for name, read in (("s3_credentials_file", lambda: read_credentials(settings)),
                       ("shared_secret_file", lambda: shared_secret(config))):
        try:
            read()
        except ConfigError as exc:
            problems.append((name, str(exc)))
    return problems


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a URL's host name) is this host: ``localhost``, all of 127.0.0.0/8, ``::1``."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def advice(config: KVTierConfig) -> list[tuple[str, str]]:
    """Warnings about a configuration the tier starts with (registry ``advice``): a plain
    ``http://`` endpoint beyond this host without ``shared_secret``/``shared_secret_file`` sends
    the chunks in clear and lets any client that can write to the bucket plant KV the engines
    accept (the checksum catches corruption, not forgery; docs/s3.md "Servers").  Reads the
    configuration alone: ``(config key, message)`` each."""
    from urllib.parse import urlsplit

    from kvtier.core.config import redact_url

    url = s3_settings(config).s3_endpoint_url
    if not url or not url.startswith("http://") or config.shared_secret or config.shared_secret_file:
        return []
    host = urlsplit(url).hostname or ""
    if is_loopback_host(host):
        return []
    return [("s3_endpoint_url", (f"s3_endpoint_url {redact_url(url)} is plain HTTP to {host}, beyond this host, "
             "without a shared_secret: chunks cross the network in clear and any client that can write to the "
             "bucket can plant KV the engines accept; use https:// and set shared_secret_file to a secret of "
             "16+ characters that every engine of the cache shares"))]


def configured(config: KVTierConfig) -> bool:
    """Whether ``config`` asks for the s3 tier (``s3_bucket`` or ``s3_endpoint_url`` set)."""
    settings = s3_settings(config)
    return bool(settings.s3_bucket or settings.s3_endpoint_url)


def _tier(config: KVTierConfig, settings: S3Settings, namespace: bytes, sweep: bool = True) -> S3Tier:
    """The bare tier; ``sweep=False``: no expiry, no cap, no sweep thread (a reset's short-lived tier)."""
    store = make_store(settings, config.shared_transfer_deadline_s)
    capacity = None if settings.s3_capacity_gib is None or not sweep else int(settings.s3_capacity_gib * GiB)
    return S3Tier(store, namespace, shared_secret(config), settings.s3_key_prefix, settings.s3_concurrency,
                  capacity, settings.s3_ttl_s if sweep else None, settings.s3_sweep_interval_s,
                  settings.s3_conditional_put, where(settings), config.shared_transfer_deadline_s)


def from_config(ctx: TierContext) -> GuardedTier | None:
    """The s3 tier behind :class:`~kvtier.core.tiers.guarded.GuardedTier`, or ``None`` without
    ``s3_bucket``/``s3_endpoint_url``.  The server need not be up: an unreachable one is a run of
    misses until it answers.

    Raises:
        ConfigError: obstore missing, no bucket, plain HTTP without ``s3_allow_http``, or
            unreadable credentials or secret file.
    """
    config = ctx.config
    settings = s3_settings(config)
    if not configured(config):
        return None
    inner = _tier(config, settings, ctx.namespace)
    return GuardedTier(inner, config.shared_deadline_s, config.shared_transfer_deadline_s, config.io_threads,
                       config.shared_queue_depth,
                       CircuitBreaker(settings.s3_breaker_failures, settings.s3_breaker_probe_s),
                       registry=ctx.registry, where=inner.where)


def reset(config: KVTierConfig, namespace: bytes) -> ClearResult:
    """Delete namespace ``namespace``'s objects from the configured bucket from outside any store
    (a tier made for the purpose, then closed); nothing to do without the s3 tier configured."""
    settings = s3_settings(config)
    if not configured(config):
        return ClearResult([])
    try:
        tier = _tier(config, settings, namespace, sweep=False)
    except ConfigError as exc:
        return ClearResult([], False, str(exc))
    try:
        return tier.clear()
    finally:
        tier.close()
