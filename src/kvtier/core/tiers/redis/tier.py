"""Redis / Valkey shared tier (standalone or Cluster) on redis-py.

- **One value per chunk**, written with one ``SET key value EX ttl NX``: the value envelope
  (:mod:`kvtier.core.envelope`: a header with namespace, key, lengths, codec chain, the writer's
  tenant record for ``kvtier purge --salt``/``--lora`` and the digest, then the payload;
  :mod:`kvtier.core.tiers.sharedvalue`).  A read verifies everything; a value that fails is a
  ``CORRUPT`` miss and is deleted.  A key the server evicted on its own (``maxmemory``, TTL) is a plain miss.
- **Keys** are ``<prefix><namespace hex>:<chunk key hex>``, built in one place for every command
  (sglang#17265 applied its prefix to SET/GET but not EXISTS).  No hash tag: in a Cluster the
  chunks of one prefix spread over all slots and shards.
- **Batches**: ``contains_many`` / ``get_many`` send one pipeline (redis-py's Cluster pipeline
  splits it per node), so a step costs one round trip per server, not one per chunk
  (LMCache#1639).  On a standalone server ``put_many`` sends every ``SET`` back to back with
  each value as (header, payload) pieces, never joined, and ``get_many`` receives values
  straight into reused buffers (:mod:`kvtier.core.tiers.redis.stream`).
- **Deadlines, breaker, metrics**: the factory wraps this tier in
  :class:`~kvtier.core.tiers.guarded.GuardedTier` (``shared_deadline_s`` for lookups and
  deletes, ``shared_transfer_deadline_s`` for reads and writes, ``redis_breaker_*``, a clear
  under :data:`~kvtier.core.tiers.redis.clear.CLEAR_DEADLINE_S`).  This class only talks to the
  server and raises on a fault.  Sockets carry connect and read/write timeouts, and redis-py's
  own retries are off: the breaker decides when to try again.  An error *reply* (``-OOM`` from a
  full server under Redis's default ``maxmemory-policy noeviction``, ``-READONLY`` from a
  replica, ``-NOPERM``) is one of :attr:`RedisTier.refusal_errors`: it fails only that call and
  leaves the breaker closed, so reads go on while writes are refused.
- **Behind the wrapper, the data path is the tier's own** (it implements the wrapper's
  :class:`~kvtier.core.tiers.split.SplitTier`):
  values are received into reused read buffers on the wrapper's thread and verified and copied
  into the caller's buffers on the caller's thread, only after the fetch returned in time (bytes
  arriving later are dropped, never copied into a buffer the caller has given back).  A write
  sends the payloads straight from the caller's buffers while the caller's thread takes the
  digests; a write given up at the deadline is abandoned before its next chunk, and a payload
  changed after its digest was taken fails verification on read (a miss, never served).
- **Secrets** (:mod:`kvtier.core.tiers.redis.client`): the password comes from the URL, an environment
  variable or a file; no log line or metric shows it (URLs are redacted).

Thread-safe.  Numbers: :meth:`RedisTier.wire_stats` (bytes, seconds, corrupt values; the wrapper
adds lookups, errors, skipped calls and writes and the breaker: the store's snapshot and its
``kvtier_tier_*`` metrics, and the ``kvtier_tier_call_seconds`` latency histogram).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.core.codecsettings import NO_CODECS, CodecArgs
from kvtier.core.keys import ChunkKey
from kvtier.core.stats import WireCounters, WireStats
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.base import ClearResult, GetResult, PutResult, Tier, TierUsage, writers
from kvtier.core.tiers.buffers import BufferPool
from kvtier.core.tiers.redis import stream as redisstream
from kvtier.core.tiers.redis.clear import clear_namespace
from kvtier.core.tiers.redis.failure import describe_error
from kvtier.core.tiers.sealedaway import LOOKUP_HEAD_BYTES, SealedAway
from kvtier.core.tiers.sharedreads import SharedReads
from kvtier.core.tiers.sharedvalue import HEADER_BYTES, ValueCodec, keyspace, verify_into
from kvtier.core.tiers.split import PutStream, WriteAbandoned, split_get

log = logging.getLogger(__name__)
BATCH_BYTES = 32 << 20
"""Payload bytes of one pipelined write batch (Cluster); encode buffers up to three times this are kept for reuse."""
READ_BUFFER_BYTES = 64 << 20
"""Bytes of read buffers (standalone ``get_many``) kept for reuse."""
WRITTEN_KEYS_MAX = 1 << 16
"""Keys this process remembers having written (``indexed``/``keys``), most recent kept."""


class RedisTier(SharedReads, Tier):
    """Chunks as values in Redis/Valkey (see the module docstring); raises on a fault, so it is
    used behind :class:`~kvtier.core.tiers.guarded.GuardedTier` (:func:`kvtier.core.tiers.redis.factory.from_config` does).

    Args:
        client: a redis-py ``Redis`` or ``RedisCluster`` client (timeouts set, retries off).
        namespace: 16-byte namespace digest.
        secret: shared secret bytes (keyed MAC) or ``None``.
        key_prefix: prefix of every key.
        ttl_s: seconds each value lives.
        header_wait_s: longest a streamed write waits for the caller's thread to produce the next
            digest (or encoded batch), seconds; the wrapper's abandon ends the wait sooner.
        where: the redacted URL, for log lines.
        codec_args: the envelope's ``chain`` and ``keyring`` (:func:`kvtier.core.codecsettings.envelope_args`).
    """

    name, shared = "redis", True
    describe_error = staticmethod(describe_error)  # the wrapper's log cause (MOVED: one cause, not one per slot)

    def __init__(self, client: Any, namespace: bytes, secret: bytes | None, key_prefix: str, ttl_s: int,
                 header_wait_s: float, where: str = "redis", codec_args: CodecArgs | None = None) -> None:
        super().__init__()
        self.client = client
        self.codec = ValueCodec(namespace, secret, **(codec_args or NO_CODECS))
        self.sealed_away = SealedAway(self.codec.envelope.keyring, self.codec.envelope.stats)
        self.prefix = f"{key_prefix}{namespace.hex()}:{keyspace(secret)}".encode()
        self.ttl_s = ttl_s
        self.header_wait_s = header_wait_s
        self.where = where
        self.wire = WireCounters()
        self.refusal_errors: tuple[type[BaseException], ...] = (redisstream.ReplyError, _response_errors())
        """The server answered and refused (``-OOM``, ``-READONLY``, ``-NOPERM``): the breaker stays closed."""
        self._lock = threading.Lock()
        self._written: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> value bytes, oldest first
        self._used = 0
        self.encode_buffers = BufferPool(BATCH_BYTES * 3, zeroed=True)
        self.read_buffers = BufferPool(READ_BUFFER_BYTES, zeroed=True)
        self._closed = False
        self._streamed = getattr(client, "connection_pool", None) is not None  # standalone (see put_many)

    def rkey(self, key: ChunkKey) -> bytes:
        """The Redis key of a chunk (the only place keys are built)."""
        return self.prefix + key.hex().encode()

    # ---- lookups and reads ---------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """One pipeline of ``EXISTS``; with a key ring, of ``GETRANGE`` of each value's head (:mod:`.sealedaway`)."""
        if not keys:
            return []
        pipe, heads = self.client.pipeline(transaction=False), self.sealed_away.reads_heads
        for key in keys:
            pipe.getrange(self.rkey(key), 0, LOOKUP_HEAD_BYTES - 1) if heads else pipe.exists(self.rkey(key))
        got = pipe.execute()
        return self.sealed_away.openable(keys, [bytes(v) for v in got]) if heads else [bool(n) for n in got]

    def get_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> GetResult:
        return self.get_many([key], [dst], records)[0]

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview],
                 records: TenantRecords | None = None) -> list[GetResult]:
        """:meth:`fetch_many` then :meth:`finish_get` on this thread, corrupt values deleted (the
        wrapper splits the two halves over its thread and the caller's)."""
        return split_get(self, keys, dsts, lambda: self.fetch_many(keys), self.delete_many, records)

    def fetch_many(self, keys: Sequence[ChunkKey]) -> tuple[list[Any], float]:
        """(:class:`~kvtier.core.tiers.split.SplitTier`) The raw values of ``keys`` (``None`` where absent) and when the fetch started.  Standalone:
        received straight into the tier's read buffers (:func:`redisstream.get_many`); Cluster:
        redis-py's pipeline."""
        t0 = time.perf_counter()
        rkeys = [self.rkey(k) for k in keys]
        if self._streamed:
            return list(redisstream.get_many(self.client, rkeys, self.read_buffers.take)), t0
        pipe = self.client.pipeline(transaction=False)
        for rk in rkeys:
            pipe.get(rk)
        return list(pipe.execute()), t0

    def finish_get(self, keys: Sequence[ChunkKey], fetched: tuple[list[Any], float],
                   dsts: Sequence[memoryview], records: TenantRecords | None = None) -> list[GetResult]:
        """Verify each fetched value and copy its payload into ``dsts[i]``: ``HIT``; absent (never
        written, expired, evicted by the server): ``MISS``; failing verification: ``CORRUPT``
        (counted; the caller deletes it).  Each hit's tenant record goes into ``records``.  The
        read buffers go back for reuse."""
        values, t0 = fetched
        done = verify_into(self.codec, keys, values, dsts, f"kvtier {self.name} tier ({self.where})", self._forget,
                           records)
        with self._lock:
            self.corrupt += done.corrupt
        self.wire.corrupt(done.corrupt)
        if self._streamed:
            self.read_buffers.give([v.obj for v in values if v is not None])
        self.wire.moved("read", done.payload_bytes, time.perf_counter() - t0)
        return done.results

    def fetch_head_and(self, key: ChunkKey, start: int, end: int) -> tuple[int, bytes, bytes] | None:
        """(:class:`~kvtier.core.tiers.sharedreads.SharedReads`) One pipeline: ``STRLEN``, the
        header's ``GETRANGE`` and the range's (Redis clips both at the value's end)."""
        rk = self.rkey(key)
        pipe = self.client.pipeline(transaction=False)
        pipe.strlen(rk)
        pipe.getrange(rk, 0, HEADER_BYTES - 1)
        if end > start:
            pipe.getrange(rk, start, end - 1)
        size, head, *data = pipe.execute()
        return None if not size else (int(size), bytes(head), bytes(data[0]) if data else b"")

    def fetch_range(self, key: ChunkKey, start: int, end: int) -> bytes | None:
        """(:class:`~kvtier.core.tiers.sharedreads.SharedReads`) ``GETRANGE`` (``b""`` absent: ``None``)."""
        got = self.client.pipeline(transaction=False).getrange(self.rkey(key), start, end - 1).execute()[0]
        return bytes(got) or None

    def lost(self, key: ChunkKey) -> None:
        self._forget(key)

    def give_back(self, values: list[Any]) -> None:
        if self._streamed:
            self.read_buffers.give([v.obj for v in values if v is not None])

    # ---- writes --------------------------------------------------------------------------
    def put(self, key: ChunkKey, data: memoryview | bytes, tenant: Writer | None = None) -> PutResult:
        return self.put_many([key], [data], [tenant])[0]

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                 tenants: Sequence[Writer | None] | None = None) -> list[PutResult]:
        """:meth:`stream_put` on this thread alone, one Cluster batch at a time: produced, then sent."""
        out: list[PutResult] = []
        who = writers(tenants, len(keys))
        for start, end in self._batches(datas):
            stream = self.stream_put(keys[start:end], datas[start:end], who[start:end])
            try:
                stream.produce(time.perf_counter() + self.header_wait_s)
                out += stream.send()
            finally:
                stream.abandon()
        return out

    def stream_put(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                   tenants: Sequence[Writer | None] | None = None) -> PutStream:
        """Pipelined ``SET key value EX ttl NX``, one value per chunk, as a
        :class:`~kvtier.core.tiers.split.PutStream`.

        Standalone: all commands back to back on one connection, each value sent as (header,
        payload) straight from ``datas`` (:mod:`~kvtier.core.tiers.redis.stream`), headers digested
        by ``produce`` while the earlier chunks are on the wire.  Cluster: redis-py's pipeline in
        batches of about ``BATCH_BYTES`` of joined values, ``produce`` encoding the next batch
        while the previous one is on the wire (at most two encoded batches held).

        A write abandoned at the deadline may still be sending from ``datas`` for a moment: a
        payload changed meanwhile no longer matches its digest, so a reader treats it as corrupt
        (a miss), never as a hit.

        Each value's header carries the tenant record of ``tenants[i]`` (``None``: unknown)."""
        who = writers(tenants, len(keys))
        if self._streamed:
            return self._stream_standalone(keys, datas, who)
        return self._stream_cluster(keys, datas, who)

    def _stream_standalone(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                           who: Sequence[Writer | None]) -> PutStream:
        rkeys = [self.rkey(k) for k in keys]
        payloads = [memoryview(d).cast("B") for d in datas]
        headers: list[bytes] = []
        ready = threading.Semaphore(0)
        abandoned = threading.Event()
        recoded = not self.codec.envelope.chain.passthrough  # bodies differ from the payloads: sealed in produce
        lengths = [memoryview(d).nbytes for d in datas]

        def produce(_deadline: float) -> None:
            for i, (key, payload, length, writer) in enumerate(zip(keys, list(payloads), lengths, who, strict=True)):
                if recoded:
                    headers.append((sealed := self.codec.seal(key, payload, writer)).header)
                    payloads[i] = sealed.body
                else:
                    headers.append(self.codec.envelope.header(key, payload, length, writer))
                ready.release()

        def send() -> list[PutResult]:
            t0 = time.perf_counter()
            created = redisstream.set_many(self.client, rkeys, headers, payloads, self.ttl_s, ready,
                                           abandoned.is_set, self.header_wait_s)
            return self._written_now(keys, [HEADER_BYTES + p.nbytes for p in payloads], created, t0)

        def abandon() -> None:
            abandoned.set()  # a writer still running stops before its next chunk
            ready.release()
        return PutStream(send, produce, abandon)

    def _stream_cluster(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                        who: Sequence[Writer | None]) -> PutStream:
        batches = self._batches(datas)
        encoded: list[list[bytearray | memoryview]] = []
        ready, room = threading.Semaphore(0), threading.Semaphore(2)  # one batch on the wire, one encoded
        abandoned = threading.Event()

        def produce(deadline: float) -> None:
            for start, end in batches:
                if not room.acquire(timeout=max(deadline - time.perf_counter(), 0.0)) or abandoned.is_set():
                    return  # the writer waits for this batch and gives up
                buffers = self.encode_buffers.take_many(
                    [HEADER_BYTES + memoryview(d).nbytes for d in datas[start:end]])
                encoded.append([self.codec.encode(k, d, b, w) for k, d, b, w in
                                zip(keys[start:end], datas[start:end], buffers, who[start:end], strict=True)])
                ready.release()

        def send() -> list[PutResult]:
            t0 = time.perf_counter()
            created: list[bool] = []
            for i, (start, end) in enumerate(batches):
                if not ready.acquire(timeout=self.header_wait_s) or abandoned.is_set():
                    raise WriteAbandoned(f"batch {i} of {len(batches)} not ready")
                pipe = self.client.pipeline(transaction=False)
                for key, value in zip(keys[start:end], encoded[i], strict=True):
                    pipe.set(self.rkey(key), value, ex=self.ttl_s, nx=True)
                created += [bool(c) for c in pipe.execute()]
                self.encode_buffers.give(encoded[i])  # sent: no thread reads them any more
                room.release()
            return self._written_now(keys, [HEADER_BYTES + memoryview(d).nbytes for d in datas], created, t0)

        def abandon() -> None:
            abandoned.set()
            ready.release()
            room.release()
        return PutStream(send, produce, abandon)

    def _batches(self, datas: Sequence[memoryview | bytes]) -> list[tuple[int, int]]:
        """``(start, end)`` of each write batch: one for a standalone server; about
        ``BATCH_BYTES`` of payload each in a Cluster (they bound the encoded values held at once)."""
        if self._streamed:
            return [(0, len(datas))] if datas else []
        batches: list[tuple[int, int]] = []
        start = 0
        while start < len(datas):
            end, size = start, 0
            while end < len(datas) and (end == start or size + memoryview(datas[end]).nbytes <= BATCH_BYTES):
                size += memoryview(datas[end]).nbytes
                end += 1
            batches.append((start, end))
            start = end
        return batches

    def _written_now(self, keys: Sequence[ChunkKey], sizes: list[int], created: list[bool],
                     t0: float) -> list[PutResult]:
        """Account one written batch (``sizes``: value bytes; ``created``: whether each was new)."""
        with self._lock:
            for key, size in zip(keys, sizes, strict=True):
                if key not in self._written:
                    self._written[key] = size
                    self._used += size
            while len(self._written) > WRITTEN_KEYS_MAX:
                _, old = self._written.popitem(last=False)
                self._used -= old
        self.wire.moved("write", sum(size - HEADER_BYTES for size, c in zip(sizes, created, strict=True) if c),
                        time.perf_counter() - t0)
        return [PutResult.STORED if c else PutResult.PRESENT for c in created]

    # ---- deletes and the index -------------------------------------------------------------
    def delete(self, key: ChunkKey) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """One pipeline of ``DEL``, one key each (a multi-key ``DEL`` fails across Cluster slots)."""
        if not keys:
            return []
        for key in keys:
            self._forget(key)
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.delete(self.rkey(key))
        return [bool(n) for n in pipe.execute()]

    def clear(self) -> ClearResult:
        """Delete every key of this tier's namespace on the server, never another namespace's
        (:func:`kvtier.core.tiers.redis.clear.clear_namespace`); the wrapper bounds it."""
        with self._lock:
            self._written.clear()
            self._used = 0
        return clear_namespace(self.client, self.prefix, lambda scan: scan(), self.where)

    def _forget(self, key: ChunkKey) -> None:
        with self._lock:
            size = self._written.pop(key, None)
            if size is not None:
                self._used -= size

    def indexed(self, key: ChunkKey) -> bool:
        """Whether this process wrote ``key`` and has not seen it vanish (no network)."""
        with self._lock:
            return key in self._written

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._written)

    def wire_stats(self) -> WireStats:
        """Bytes and seconds moved and corrupt values (the wrapper adds the rest)."""
        return self.wire.snapshot(0, 0)

    def stored_bytes(self, payload_bytes: int) -> int:
        return payload_bytes + HEADER_BYTES

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._used, 0, self._used, len(self._written))

    def check(self) -> None:
        with self._lock:
            assert self._used == sum(self._written.values()), "redis tier written bytes drifted from its index"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.client.close()
        except Exception as exc:  # noqa: BLE001 - closing a dead connection may fail; nothing to do
            log.debug("kvtier redis tier: close: %s", exc)


def _response_errors() -> type[Exception]:
    """redis-py's class for an error reply (the server answered, with ``-ERR``/``-OOM``/...)."""
    try:
        from redis.exceptions import ResponseError
    except ImportError:  # pragma: no cover - redis-py is a dependency; without it no tier exists
        return redisstream.ReplyError
    return ResponseError
