"""S3 object-store shared tier (AWS S3, MinIO, Ceph RGW, Cloudflare R2, any S3 API) on obstore.

- **One object per chunk**, written whole with one ``PUT`` (never multipart): the same value as
  the redis tier's, the value envelope (:mod:`kvtier.core.envelope`: a header with namespace digest,
  key, lengths, codec chain, the writer's tenant record, XXH3 checksum or keyed BLAKE3 MAC with
  ``shared_secret``, then the payload; :mod:`kvtier.core.tiers.sharedvalue`).
  A ``PUT`` is atomic in S3: a reader sees no object, the old one or the whole new one, never a
  part (AWS S3 user guide, "Amazon S3 data consistency model"); a read still verifies everything,
  and a short body, a foreign namespace or a digest mismatch is a counted ``CORRUPT`` miss and the
  object is deleted.
- **Keys**: ``<s3_key_prefix><namespace hex>[-<keyspace>]/<chunk key hex>``.  The key space of
  ``shared_secret`` (:func:`~kvtier.core.tiers.sharedvalue.keyspace`) keeps engines under
  different secrets apart, as in the redis tier; a LIST of one namespace's "directory" never
  lists another's.
- **Batches in parallel**: ``contains_many`` is one ``HEAD`` per chunk (:meth:`.space.S3Space.lookup`), ``get_many`` one ``GET``
  per chunk and ``put_many`` one ``PUT`` per chunk, at most ``s3_concurrency`` requests in flight
  (one asyncio loop on the tier's own thread drives them all).
- **Writes never replace an object** (chunk bytes never change under their key).  With
  ``s3_conditional_put`` each ``PUT`` carries ``If-None-Match: *`` and a server that honours it
  answers ``412`` on an existing key: that chunk is ``PRESENT``, with no ``HEAD`` first.  The
  first write asks the server whether it does (:mod:`kvtier.core.tiers.s3.conditional`: ``rclone
  serve s3`` does not); where it does not, or without ``s3_conditional_put`` (for a gateway that
  answers ``501``), a ``HEAD`` goes before each ``PUT``.  A ``412`` comes after the chunk's bytes
  were sent, where a ``HEAD`` costs one round trip: the saving holds while most chunks written
  are new (a chunk is written again when another engine computed and saved it too).
- **Behind the wrapper, the data path is the tier's own** (it implements the wrapper's
  :class:`~kvtier.core.tiers.split.SplitTier`): a read's bodies are buffers obstore allocated
  for the call, verified and copied once into the caller's buffers on the caller's thread after
  the fetch returned in time; a write's objects (header + payload, the one copy a write needs)
  are encoded on the caller's thread while the probe or the ``HEAD`` requests are on the wire.
- **Deadlines, breaker, metrics**: the factory wraps this tier in
  :class:`~kvtier.core.tiers.guarded.GuardedTier` (``shared_deadline_s`` for lookups and
  deletes, ``shared_transfer_deadline_s`` for reads and writes, ``s3_breaker_*``).  This class
  raises on a fault; a ``403`` (``PermissionDeniedError``) is a refusal that fails the call but
  leaves the breaker closed, as a full Redis's ``-OOM`` does.
- **Expiry and capacity** (:mod:`kvtier.core.tiers.s3.space`): the bucket evicts nothing by
  itself.  With ``s3_ttl_s`` an object older than the TTL (by its ``Last-Modified``) is a miss,
  and a background sweep deletes expired objects (a bucket lifecycle rule does the same at day
  granularity: docs/s3.md); with ``s3_capacity_gib`` the sweep re-counts the namespace and the
  oldest objects past the cap are deleted, each checked by a ``HEAD`` first.
- **Requests**: every request runs on one asyncio loop on the tier's own thread, through
  :class:`~kvtier.core.tiers.s3.objects.S3Objects` (where object keys are built).

Thread-safe.  Numbers: :meth:`S3Tier.wire_stats` (bytes, seconds, corrupt values; the wrapper
adds errors, skipped calls and the breaker).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

from kvtier.core.codecsettings import NO_CODECS, CodecArgs
from kvtier.core.keys import ChunkKey
from kvtier.core.stats import WireCounters, WireStats
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.base import ClearResult, GetResult, PutResult, Tier, TierUsage, writers
from kvtier.core.tiers.buffers import BufferPool
from kvtier.core.tiers.loglimit import CauseLimiter, held_back
from kvtier.core.tiers.s3.client import s3_cause
from kvtier.core.tiers.s3.conditional import ConditionalPut
from kvtier.core.tiers.s3.objects import S3Objects
from kvtier.core.tiers.s3.space import S3Space
from kvtier.core.tiers.sealedaway import SealedAway
from kvtier.core.tiers.sharedreads import SharedReads
from kvtier.core.tiers.sharedvalue import HEADER_BYTES, ValueCodec, keyspace, verify_into
from kvtier.core.tiers.split import PutStream, WriteAbandoned, split_get

log = logging.getLogger(__name__)
ENCODE_BUFFER_BYTES = 256 << 20
"""Bytes of encoded-object buffers kept for reuse between writes (:mod:`kvtier.core.tiers.buffers`:
a fresh 32 MiB buffer costs ~4x the copy into it)."""


class S3Tier(SharedReads, Tier):
    """Chunks as objects in one S3 bucket (see the module docstring).  Raises on a fault: use it
    behind :class:`~kvtier.core.tiers.guarded.GuardedTier` (:func:`kvtier.core.tiers.s3.factory.from_config` does).

    Args:
        store: an obstore ``S3Store`` on the bucket (:func:`kvtier.core.tiers.s3.client.make_store`).
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
        codec_args: the envelope's ``chain`` and ``keyring`` (:func:`kvtier.core.codecsettings.envelope_args`).
    """

    name = "s3"
    shared = True
    describe_error = staticmethod(s3_cause)  # GuardedTier's log lines: the short cause, not obstore's debug dump

    def __init__(self, store: Any, namespace: bytes, secret: bytes | None, key_prefix: str, concurrency: int,
                 capacity_bytes: int | None = None, ttl_s: int | None = None, sweep_interval_s: float = 300.0,
                 conditional_put: bool = True, where: str = "s3", produce_wait_s: float = 5.0,
                 codec_args: CodecArgs | None = None) -> None:
        super().__init__()
        from obstore.exceptions import AlreadyExistsError, PermissionDeniedError, PreconditionError

        self.refusal_errors: tuple[type[BaseException], ...] = (PermissionDeniedError,)
        self._exists_errors = (AlreadyExistsError, PreconditionError)
        self.store = store
        self.codec = ValueCodec(namespace, secret, **(codec_args or NO_CODECS))
        self.sealed_away = SealedAway(self.codec.envelope.keyring, self.codec.envelope.stats)
        space = keyspace(secret).rstrip(":")
        self.prefix = f"{key_prefix}{namespace.hex()}{'-' + space if space else ''}/"
        self.concurrency, self.conditional_put, self.where = concurrency, conditional_put, where
        self.produce_wait_s = produce_wait_s
        self.encode_buffers = BufferPool(ENCODE_BUFFER_BYTES)
        self.wire, self._lock, self._warnings = WireCounters(), threading.Lock(), CauseLimiter()
        self.objects = S3Objects(store, self.prefix, concurrency)
        """The namespace's objects and the event loop their requests run on."""
        self.conditional = ConditionalPut(self.objects, conditional_put, self._exists_errors, where, self._log_fault)
        """Whether the server honours ``If-None-Match: *`` (asked by the first write)."""
        self.space = S3Space(self.objects, capacity_bytes, ttl_s, sweep_interval_s, self._log_fault)
        """The count of the namespace's objects, the TTL, the cap and the sweep thread."""

    @property
    def conditional_honoured(self) -> bool | None:
        """:attr:`ConditionalPut.honoured <kvtier.core.tiers.s3.conditional.ConditionalPut.honoured>`
        (settable: the benches force a write path)."""
        return self.conditional.honoured

    @conditional_honoured.setter
    def conditional_honoured(self, honoured: bool | None) -> None:
        self.conditional.honoured = honoured

    @property
    def sweeps(self) -> int:
        """Sweeps done (:meth:`sweep`)."""
        return self.space.sweeps

    def sweep(self) -> None:
        """One pass of :meth:`S3Space.sweep <kvtier.core.tiers.s3.space.S3Space.sweep>` (expiry and
        the cap; raises what it raises)."""
        self.space.sweep()

    def object_key(self, key: ChunkKey) -> str:
        """The object key of a chunk (:meth:`S3Objects.key <kvtier.core.tiers.s3.objects.S3Objects.key>`)."""
        return self.objects.key(key)

    # ---- Tier contract ---------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        return self.space.lookup(keys, [self.object_key(k) for k in keys], self.sealed_away)

    def get_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> GetResult:
        return self.get_many([key], [dst], records)[0]

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview],
                 records: TenantRecords | None = None) -> list[GetResult]:
        """:meth:`fetch_many` then :meth:`finish_get` on this thread, corrupt objects deleted (the
        wrapper splits the two halves over its thread and the caller's)."""
        if not keys:
            return []
        return split_get(self, keys, dsts, lambda: self.fetch_many(keys), self.delete_many, records)

    def fetch_many(self, keys: Sequence[ChunkKey]) -> tuple[list[Any], float]:
        """(:class:`~kvtier.core.tiers.split.SplitTier`) One parallel ``GET`` per key: each body
        (a buffer obstore allocated for this call) or ``None`` where there is no live object, and
        when the fetch started.  An object past ``s3_ttl_s`` is not read but deleted here (a fault
        of that delete is logged; the sweep deletes it later)."""
        import obstore

        t0 = time.perf_counter()
        expired: list[str] = []

        async def fetch(path: str) -> Any:
            try:
                got = await obstore.get_async(self.store, path)
                if self.space.expired(got.meta["last_modified"].timestamp()):
                    expired.append(path)  # a miss, deleted below
                    return None
                return await got.bytes_async()
            except FileNotFoundError:
                return None

        async def fetch_all() -> list[Any]:
            values = await self.objects.each(fetch, [self.object_key(k) for k in keys])
            if expired:
                await self.space.delete_expired(expired)
            return values

        return (self.objects.run(fetch_all) if keys else []), t0

    def finish_get(self, keys: Sequence[ChunkKey], fetched: tuple[list[Any], float],
                   dsts: Sequence[memoryview], records: TenantRecords | None = None) -> list[GetResult]:
        """(:class:`~kvtier.core.tiers.split.SplitTier`) Verify each body of :meth:`fetch_many`
        and copy its payload into ``dsts[i]``: ``HIT``; no live object: ``MISS``; short, foreign
        or failing its digest: ``CORRUPT`` (counted; the caller deletes it).  Each hit's tenant
        record goes into ``records``.  No network."""
        values, t0 = fetched
        done = verify_into(self.codec, keys, values, dsts, f"kvtier {self.name} tier ({self.where})", self.space.forget,
                           records)
        with self._lock:
            self.corrupt += done.corrupt
        self.wire.corrupt(done.corrupt)
        self.wire.moved("read", done.payload_bytes, time.perf_counter() - t0)
        return done.results

    def fetch_head_and(self, key: ChunkKey, start: int, end: int) -> tuple[int, bytes, bytes] | None:
        """A ``HEAD`` (absent or past ``s3_ttl_s``: ``None``), then two ranged ``GET`` in parallel."""
        path = self.object_key(key)

        async def fetch() -> tuple[int, bytes, bytes] | None:
            async with self.objects.requests():
                meta = await self.space.head(path)
            return None if meta is None else await self.objects.head_and_range(path, int(meta["size"]), start, end)
        return self.objects.run(fetch)

    def fetch_range(self, key: ChunkKey, start: int, end: int) -> bytes | None:
        return self.objects.run(lambda: self.objects.read_range(self.object_key(key), start, end))

    def lost(self, key: ChunkKey) -> None:
        self.space.forget(key)

    def ask_conditional(self) -> bool:
        """Whether the server honours ``If-None-Match: *`` (asked once, then remembered:
        :attr:`conditional_honoured`; :mod:`kvtier.core.tiers.s3.conditional`); ``False`` without
        ``s3_conditional_put``.

        Raises:
            obstore.exceptions.BaseError: the server failed or refused (nothing remembered).
        """
        return self.conditional_put and self.objects.run(self.conditional.ask)

    def put(self, key: ChunkKey, data: memoryview | bytes, tenant: Writer | None = None) -> PutResult:
        return self.put_many([key], [data], [tenant])[0]

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                 tenants: Sequence[Writer | None] | None = None) -> list[PutResult]:
        """:meth:`stream_put` on this thread alone: every object encoded, then sent."""
        if not keys:
            return []
        stream = self.stream_put(keys, datas, tenants)
        try:
            stream.produce(time.perf_counter() + self.produce_wait_s)
            return stream.send()
        finally:
            stream.abandon()

    def stream_put(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                   tenants: Sequence[Writer | None] | None = None) -> PutStream:
        """One whole-object ``PUT`` per chunk (parallel), as a
        :class:`~kvtier.core.tiers.split.PutStream`.  A chunk already stored is ``PRESENT`` and
        keeps its object (chunk bytes never change under their key): with ``s3_conditional_put``
        on a server that honours ``If-None-Match: *`` the server's ``412`` says so; otherwise a
        ``HEAD`` before each ``PUT`` does (module docstring, "Writes never replace an object").

        ``produce`` (the caller's thread) encodes every object, header + payload: the one copy a
        write needs, so ``send`` never reads ``datas`` and the caller may reuse them once
        ``put_many`` returns.  ``send``'s probe or ``HEAD`` requests go out meanwhile; each ``PUT``
        waits for the encoded objects at most ``produce_wait_s`` (``abandon`` ends the wait).  Each
        header carries the tenant record of ``tenants[i]`` (``None``: unknown)."""
        import obstore

        paths = [self.object_key(k) for k in keys]
        sizes = [memoryview(d).nbytes for d in datas]
        who = writers(tenants, len(keys))
        values: list[bytearray | memoryview] = []
        encoded = [asyncio.Event() for _ in keys]  # set on the loop: by produce as each object is encoded, or by abandon
        abandoned = threading.Event()
        exists_errors = self._exists_errors
        pool = self.encode_buffers
        wake = self.objects.wake

        async def write(i: int, head_first: bool) -> tuple[str, float]:
            gate = self.objects.requests()  # held for each request, never while waiting for produce
            reusable = True  # False while a PUT may still read the object (a cancelled call's may)
            try:
                if head_first:
                    async with gate:
                        meta = await self.space.head(paths[i])
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
            head_first = not (self.conditional_put and await self.conditional.ask())
            return list(await asyncio.gather(*(write(i, head_first) for i in range(len(keys)))))

        def produce(_deadline: float) -> None:
            # Each PUT starts as soon as its own object is encoded (the next is encoded meanwhile).
            for i, (key, data, writer) in enumerate(zip(keys, datas, who, strict=True)):
                if abandoned.is_set():
                    return
                values.append(self.codec.encode(key, data, pool.take(self.codec.value_bytes(sizes[i])), writer=writer))
                wake(encoded[i:i + 1])

        def send() -> list[PutResult]:
            t0 = time.perf_counter()
            outcomes = self.objects.run(write_all)
            return self._written_now(keys, sizes, outcomes, t0)

        def abandon() -> None:
            abandoned.set()
            wake(encoded)
        return PutStream(send, produce, abandon)

    def _written_now(self, keys: Sequence[ChunkKey], payload_bytes: list[int], outcomes: list[tuple[str, float]],
                     t0: float) -> list[PutResult]:
        """Account one written batch (``outcomes``: ``("stored" | "present", mtime)`` per chunk)."""
        self.space.add(keys, [HEADER_BYTES + n for n in payload_bytes], [mtime for _, mtime in outcomes])
        stored_bytes = sum(n for n, (outcome, _) in zip(payload_bytes, outcomes, strict=True) if outcome == "stored")
        self.wire.moved("write", stored_bytes, time.perf_counter() - t0)
        self.space.fit()
        return [PutResult.STORED if o == "stored" else PutResult.PRESENT for o, _ in outcomes]

    def delete(self, key: ChunkKey) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """``HEAD`` then delete: ``True`` for each key whose object was there."""
        if not keys:
            return []
        paths = [self.object_key(k) for k in keys]
        for key in keys:
            self.space.forget(key)
        metas = self.objects.run(lambda: self.objects.each(self.space.head, paths))
        there = [p for p, m in zip(paths, metas, strict=True) if m is not None]
        self.objects.delete(there)
        return [m is not None for m in metas]

    def clear(self) -> ClearResult:
        """Delete every object of this tier's namespace (and key space) in the bucket, never
        another's; ``ok`` is ``False`` if the server did not list and delete them within
        :data:`~kvtier.core.tiers.s3.space.CLEAR_DEADLINE_S`."""
        try:
            found = self.space.clear()
        except Exception as exc:  # noqa: BLE001 - any fault: the reset reports it, never raises
            self._log_fault("clear", exc)
            return ClearResult([], False, f"the S3 server at {self.where} did not list and delete the "
                                          f"namespace's objects ({s3_cause(exc)})")
        return ClearResult(found)

    # ---- the rest of the contract ----------------------------------------------------------------
    def indexed(self, key: ChunkKey) -> bool:
        """Whether this process wrote (or counted) ``key`` and has not seen it vanish (no network)."""
        return self.space.indexed(key)

    def keys(self) -> list[ChunkKey]:
        return self.space.keys()

    def stored_bytes(self, payload_bytes: int) -> int:
        return payload_bytes + HEADER_BYTES

    def usage(self) -> TierUsage:
        return self.space.usage()

    def check(self) -> None:
        self.space.check()

    def wire_stats(self) -> WireStats:
        return self.wire.snapshot(0, 0)

    def _log_fault(self, op: str, exc: BaseException) -> None:
        if (held := self._warnings.admit(cause := s3_cause(exc))) is not None:  # each cause once per 10 s
            log.warning("kvtier s3 tier (%s): %s failed (%s)%s", self.where, op, cause, held_back(held))

    def close(self) -> None:
        if self.objects.closed:
            return
        self.space.stop()
        self.objects.close()
