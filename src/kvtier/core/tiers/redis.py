"""Redis / Valkey shared tier (standalone or Cluster) on redis-py.

- **One value per chunk**, written with one ``SET key value EX ttl NX``: a header (format version,
  namespace, key, length, digest) and the payload (:mod:`kvtier.core.tiers.sharedvalue`).  A read
  verifies everything; a value that fails is a ``CORRUPT`` miss and is deleted.  A key the server
  evicted on its own (``maxmemory``, TTL) is a plain miss.
- **Keys** are ``<prefix><namespace hex>:<chunk key hex>``, built in one place for every command
  (sglang#17265 applied its prefix to SET/GET but not EXISTS).  No hash tag: in a Cluster the
  chunks of one prefix spread over all slots and shards.
- **Batches**: ``contains_many`` / ``get_many`` send one pipeline (redis-py's Cluster pipeline
  splits it per node), so a step costs one round trip per server, not one per chunk
  (LMCache#1639).  On a standalone server ``put_many`` sends every ``SET`` back to back with
  each value as (header, payload) pieces, never joined, and ``get_many`` receives values
  straight into reused buffers (:mod:`kvtier.core.tiers.redisstream`).
- **Bounded**: network calls run on the tier's own threads (``io_threads``), at most
  ``queue_depth`` calls waiting; the caller waits at most ``deadline_s`` and then gets misses
  (bytes arriving later are dropped, never copied into a buffer the caller has given back).
  Sockets carry connect and read/write timeouts, and redis-py's own retries are off: the circuit
  breaker decides when to try again.
- **Faults are misses**: a timeout, connection error or server error fails the call; after
  ``breaker_failures`` timeouts or connection errors in a row the breaker opens, lookups and
  reads miss and writes are skipped (counted) without touching the network, and one probe per
  ``breaker_probe_s`` checks whether the server is back (:mod:`kvtier.core.tiers.breaker`).  An
  error *reply* (``-OOM`` from a full server under Redis's default ``maxmemory-policy
  noeviction``, ``-READONLY`` from a replica, ``-NOPERM``) fails only that call: the server is
  up, so the breaker stays closed and reads go on while writes are refused.
- **Secrets** (:mod:`kvtier.core.tiers.redisclient`): the password comes from the URL, an environment variable or a file; no log line
  or metric shows it (URLs are redacted).

Thread-safe.  Numbers: :meth:`RedisTier.wire_stats` (:class:`~kvtier.core.stats.WireStats`, in the
store's snapshot and its ``kvtier_tier_*`` metrics) and a call latency histogram
(:class:`~kvtier.core.tiers.tiermetrics.TierMetrics`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier.core.config import redact_url
from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.stats import WireCounters, WireStats
from kvtier.core.tiers import redisstream
from kvtier.core.tiers.base import ClearResult, GetResult, PutResult, Tier, TierUsage
from kvtier.core.tiers.breaker import CircuitBreaker
from kvtier.core.tiers.redisclear import CLEAR_DEADLINE_S, clear_namespace
from kvtier.core.tiers.redisclient import LazyClusterClient, make_client
from kvtier.core.tiers.redissettings import redis_settings
from kvtier.core.tiers.sharedvalue import (
    HEADER_BYTES,
    SharedValueError,
    ValueCodec,
    copy_payload,
    keyspace,
    shared_secret,
)
from kvtier.core.tiers.tiermetrics import TierMetrics

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.factory import TierContext

log = logging.getLogger(__name__)
T = TypeVar("T")
BATCH_BYTES = 32 << 20
"""Payload bytes of one pipelined write batch; encode buffers up to three times this are kept for reuse."""
READ_BUFFER_BYTES = 64 << 20
"""Bytes of read buffers (standalone ``get_many``) kept for reuse."""
WRITTEN_KEYS_MAX = 1 << 16
"""Keys this process remembers having written (``indexed``/``keys``), most recent kept."""


class RedisTier(Tier):
    """Chunks as values in Redis/Valkey (see the module docstring).

    Args:
        client: a redis-py ``Redis`` or ``RedisCluster`` client (timeouts set, retries off).
        namespace: 16-byte namespace digest.
        secret: shared secret bytes (keyed MAC) or ``None``.
        key_prefix: prefix of every key.
        ttl_s: seconds each value lives.
        deadline_s: longest a caller waits for a presence batch (a lookup) or a delete.
        transfer_deadline_s: longest a caller waits for a read or write batch (bytes on the wire).
        io_threads / queue_depth: the tier's threads and how many calls may wait for them.
        breaker: the circuit breaker.
        registry: prometheus registry for the tier's metrics.
        where: the redacted URL, for log lines.
    """

    name = "redis"
    shared = True

    def __init__(self, client: Any, namespace: bytes, secret: bytes | None, key_prefix: str, ttl_s: int,
                 deadline_s: float, io_threads: int, queue_depth: int, breaker: CircuitBreaker,
                 transfer_deadline_s: float | None = None,
                 registry: CollectorRegistry | None = None, where: str = "redis") -> None:
        super().__init__()
        self.client = client
        self.codec = ValueCodec(namespace, secret)
        self.prefix = f"{key_prefix}{namespace.hex()}:{keyspace(secret)}".encode()
        self.ttl_s = ttl_s
        self.deadline_s = deadline_s
        self.transfer_deadline_s = deadline_s if transfer_deadline_s is None else transfer_deadline_s
        self.breaker = breaker
        self.metrics = TierMetrics(self.name, registry)
        self.wire = WireCounters()
        self.where = where
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-redis")
        self._slots = threading.BoundedSemaphore(io_threads + queue_depth)
        self._lock = threading.Lock()
        self._written: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> value bytes, oldest first
        self._used = 0
        self._free_buffers: list[bytearray] = []
        self._free_reads: list[bytearray] = []
        self._closed = False
        self._last_error = 0.0
        self._streamed = getattr(client, "connection_pool", None) is not None  # standalone (see put_many)

    # ---- keys and the call path ----------------------------------------------------------
    def rkey(self, key: ChunkKey) -> bytes:
        """The Redis key of a chunk (the only place keys are built)."""
        return self.prefix + key.hex().encode()

    def _call(self, op: str, fn: Callable[[], T]) -> T | None:
        """Run ``fn`` on the tier's threads under the op's deadline; ``None`` on any fault (counted)."""
        return self._wait(op, self._submit(op, fn))

    def _deadline(self, op: str) -> float:
        if op == "clear":  # a whole namespace listed and deleted (kvtier.core.tiers.redisclear)
            return CLEAR_DEADLINE_S
        return self.transfer_deadline_s if op in ("get", "put") else self.deadline_s

    def _submit(self, op: str, fn: Callable[[], T]) -> tuple[Future[T], float] | None:
        """Start ``fn`` on the tier's threads; ``None`` (counted as skipped) if the breaker is open or
        every thread is busy and the queue is full."""
        if self._closed or not self._slots.acquire(blocking=False):
            self.wire.skipped(op)
            return None
        if not self.breaker.allow():
            self._slots.release()
            self.wire.skipped(op)
            return None
        return self._pool.submit(self._run, fn), time.perf_counter()

    def _wait(self, op: str, started: tuple[Future[T], float] | None) -> T | None:
        """The result of a :meth:`_submit`, waiting at most the deadline; ``None`` on any fault."""
        if started is None:
            return None
        future, t0 = started
        try:
            deadline_s = self._deadline(op)
            result = future.result(timeout=max(deadline_s - (time.perf_counter() - t0), 0.0))
        except FutureTimeout:
            if future.cancel():  # never started: its slot is ours to give back
                self._slots.release()
            self._fault(op, f"deadline of {deadline_s:.3f} s passed")
            return None
        except (redisstream.ReplyError, _response_errors()) as exc:
            # The server is up and refused the command (-OOM under maxmemory with noeviction, a
            # -READONLY replica, -NOPERM): counted, but it never opens the breaker, so a server
            # that refuses writes keeps serving reads.
            self.breaker.success()
            self._fault(op, f"{type(exc).__name__}: {exc}", refused=True)
            return None
        except Exception as exc:  # noqa: BLE001 - every server or network fault is a miss
            self._fault(op, f"{type(exc).__name__}: {exc}")
            return None
        self.breaker.success()
        self.metrics.observe(op, time.perf_counter() - t0)
        return result

    def _run(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        finally:
            self._slots.release()

    def _fault(self, op: str, reason: str, refused: bool = False) -> None:
        if not refused:
            self.breaker.failure()
        self.wire.error(op)
        now = time.monotonic()
        if now - self._last_error > 10.0:  # one line per 10 s, not one per call
            self._last_error = now
            outcome = "chunks not written" if op == "put" else "treated as a miss"
            log.warning("kvtier redis tier (%s): %s %s (%s); %s, breaker %s", self.where, op,
                        "refused by the server" if refused else "failed", reason, outcome,
                        self.breaker.state.name.lower())

    # ---- Tier contract -------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        rkeys = [self.rkey(k) for k in keys]

        def exists() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for rk in rkeys:
                pipe.exists(rk)
            return list(pipe.execute())

        got = self._call("lookup", exists)
        found = [False] * len(keys) if got is None else [bool(n) for n in got]
        self.wire.looked_up(len(keys), sum(found))
        return found

    def get_into(self, key: ChunkKey, dst: memoryview) -> GetResult:
        return self.get_many([key], [dst])[0]

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview]) -> list[GetResult]:
        if not keys:
            return []
        rkeys = [self.rkey(k) for k in keys]

        def fetch() -> list[Any]:
            if self._streamed:  # values received straight into the tier's read buffers
                return list(redisstream.get_many(self.client, rkeys, self._read_buffer))
            pipe = self.client.pipeline(transaction=False)
            for rk in rkeys:
                pipe.get(rk)
            return list(pipe.execute())

        t0 = time.perf_counter()
        values = self._call("get", fetch)  # after a fault a late thread may still fill its buffers: not reused
        if values is None:
            return [GetResult.MISS] * len(keys)
        results: list[GetResult] = []
        bad: list[bytes] = []
        num_bytes = 0
        for key, rk, value, dst in zip(keys, rkeys, values, dsts, strict=True):
            if value is None:  # never written, expired, or evicted by the server
                self._forget(key)
                results.append(GetResult.MISS)
                continue
            try:
                decoded = self.codec.decode(key, value, memoryview(dst).nbytes)
            except SharedValueError as exc:
                log.warning("kvtier redis tier (%s): value of chunk %s is unusable (%s); deleted, treated "
                            "as a miss", self.where, key.hex(), exc)
                bad.append(rk)
                self._forget(key)
                with self._lock:
                    self.corrupt += 1
                self.wire.corrupt()
                results.append(GetResult.CORRUPT)
                continue
            copy_payload(value, decoded, dst)
            num_bytes += decoded.length
            results.append(GetResult.HIT)
        if self._streamed:
            self._give_read_buffers([v.obj for v in values if v is not None])
        if bad:
            self._call("delete", lambda: self._delete_each(bad))
        self.wire.moved("read", num_bytes, time.perf_counter() - t0)
        return results

    def _read_buffer(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes for one value being read (reused, so its pages are faulted in)."""
        with self._lock:
            i = next((j for j, b in enumerate(self._free_reads) if len(b) == size), None)
            return self._free_reads.pop(i) if i is not None else bytearray(size)

    def _give_read_buffers(self, buffers: list[bytearray]) -> None:
        with self._lock:
            self._free_reads.extend(buffers)
            while sum(len(b) for b in self._free_reads) > READ_BUFFER_BYTES:
                self._free_reads.pop(0)

    def _delete_each(self, rkeys: Sequence[bytes]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for rk in rkeys:  # one DEL per key: a multi-key DEL fails across Cluster slots
            pipe.delete(rk)
        return sum(int(n) for n in pipe.execute())

    def put(self, key: ChunkKey, data: memoryview | bytes) -> PutResult:
        return self.put_many([key], [data])[0]

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes]) -> list[PutResult]:
        """Pipelined ``SET key value EX ttl NX``, one value per chunk.

        Standalone: all commands back to back on one connection, each value sent as (header,
        payload) straight from ``datas`` (:mod:`~kvtier.core.tiers.redisstream`), headers digested
        on this thread while the earlier chunks are on the wire.  Cluster: redis-py's pipeline in
        batches of about ``BATCH_BYTES`` of joined values, the next batch encoded while the
        previous one is on the wire.

        A write given up at the deadline may still be sending from ``datas`` for a moment: a
        payload changed meanwhile no longer matches its digest, so a reader treats it as corrupt
        (a miss), never as a hit."""
        if not keys:
            return []
        if self._streamed:
            return self._put_streamed(keys, datas)
        batches: list[tuple[int, int]] = []
        start = 0
        while start < len(keys):  # batches bound the memory of encoded values held at once
            end, size = start, 0
            while end < len(keys) and (end == start or size + memoryview(datas[end]).nbytes <= BATCH_BYTES):
                size += memoryview(datas[end]).nbytes
                end += 1
            batches.append((start, end))
            start = end
        out: list[PutResult] = []
        in_flight = None
        for start, end in batches:
            values = self._encode(keys[start:end], datas[start:end])
            if in_flight is not None:
                out += self._finish_batch(*in_flight)
            in_flight = (keys[start:end], values, self._submit("put", self._setter(keys[start:end], values)))
        if in_flight is not None:
            out += self._finish_batch(*in_flight)
        return out

    def _put_streamed(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes]) -> list[PutResult]:
        rkeys = [self.rkey(k) for k in keys]
        payloads = [memoryview(d).cast("B") for d in datas]
        headers: list[bytes] = []
        ready = threading.Semaphore(0)
        abandoned = threading.Event()
        started = self._submit("put", lambda: redisstream.set_many(
            self.client, rkeys, headers, payloads, self.ttl_s, ready, abandoned.is_set, self.transfer_deadline_s))
        try:
            if started is not None:
                for key, payload in zip(keys, payloads):
                    headers.append(self.codec.header(key, payload))
                    ready.release()
            created = self._wait("put", started)
        finally:
            abandoned.set()  # a writer still running stops before its next chunk
            ready.release()
        return self._finish_put(keys, [HEADER_BYTES + p.nbytes for p in payloads], created,
                                started[1] if started is not None else time.perf_counter())

    def _encode(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes]) -> list[bytearray]:
        buffers = self._take_buffers([HEADER_BYTES + memoryview(d).nbytes for d in datas])
        return [self.codec.encode(k, d, b) for k, d, b in zip(keys, datas, buffers, strict=True)]

    def _setter(self, keys: Sequence[ChunkKey], values: list[bytearray]) -> Callable[[], list[bool]]:
        rkeys = [self.rkey(k) for k in keys]

        def store() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for rk, value in zip(rkeys, values):
                pipe.set(rk, value, ex=self.ttl_s, nx=True)
            return [bool(created) for created in pipe.execute()]
        return store

    def _take_buffers(self, sizes: list[int]) -> list[bytearray]:
        with self._lock:
            free = self._free_buffers
            taken = []
            for size in sizes:
                i = next((j for j, b in enumerate(free) if len(b) == size), None)
                taken.append(free.pop(i) if i is not None else bytearray(size))
            return taken

    def _give_buffers(self, buffers: list[bytearray]) -> None:
        with self._lock:
            self._free_buffers.extend(buffers)
            while sum(len(b) for b in self._free_buffers) > BATCH_BYTES * 3:
                self._free_buffers.pop(0)

    def _finish_batch(self, keys: Sequence[ChunkKey], values: list[bytearray],
                      started: tuple[Future[list[bool]], float] | None) -> list[PutResult]:
        t0 = started[1] if started is not None else time.perf_counter()
        created = self._wait("put", started)
        results = self._finish_put(keys, [len(v) for v in values], created, t0)
        if created is not None:  # after a fault a late thread may still read the buffers: not reused
            self._give_buffers(values)
        return results

    def _finish_put(self, keys: Sequence[ChunkKey], sizes: list[int], created: list[bool] | None,
                    t0: float) -> list[PutResult]:
        """Account one written batch (``sizes``: value bytes; ``created``: ``None`` after a fault or skip)."""
        if created is None:  # a fault, or skipped while the breaker is open
            self.wire.writes_skipped(len(keys))
            return [PutResult.FAILED] * len(keys)
        with self._lock:
            for key, size in zip(keys, sizes):
                if key not in self._written:
                    self._written[key] = size
                    self._used += size
            while len(self._written) > WRITTEN_KEYS_MAX:
                _, old = self._written.popitem(last=False)
                self._used -= old
        self.wire.moved("write", sum(size - HEADER_BYTES for size, c in zip(sizes, created) if c),
                           time.perf_counter() - t0)
        return [PutResult.STORED if c else PutResult.PRESENT for c in created]

    def delete(self, key: ChunkKey) -> bool:
        rk = self.rkey(key)
        self._forget(key)
        removed = self._call("delete", lambda: int(self.client.delete(rk)))
        return bool(removed)

    def clear(self) -> ClearResult:
        """Delete every key of this tier's namespace on the server, never another namespace's
        (:func:`kvtier.core.tiers.redisclear.clear_namespace`)."""
        with self._lock:
            self._written.clear()
            self._used = 0
        return clear_namespace(self.client, self.prefix, lambda fn: self._call("clear", fn), self.where)

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
        """What this tier did on the wire since it started, with the breaker's state now."""
        return self.wire.snapshot(int(self.breaker.state), self.breaker.num_opened)

    @property
    def skipped_writes(self) -> int:
        """Chunks not written (breaker open, queue full, or the write failed); from :meth:`wire_stats`."""
        return self.wire_stats().skipped_writes

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
        self._pool.shutdown(wait=False, cancel_futures=True)
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


def check(config: KVTierConfig) -> list[tuple[str, str]]:
    """The password and shared secret, read as start-up reads them (files, the environment
    variable): ``(config key, message)`` per one that start-up would refuse."""
    from kvtier.core.tiers.redisclient import redis_password

    problems = []
    settings = redis_settings(config)
    password_key = "redis_password_env" if settings.redis_password_env else "redis_password_file"
    for name, read in ((password_key, lambda: redis_password(settings)), ("shared_secret_file",
                                                                          lambda: shared_secret(config))):
        try:
            read()
        except ConfigError as exc:
            problems.append((name, str(exc)))
    return problems


def configured(config: KVTierConfig) -> bool:
    """Whether ``config`` asks for the redis tier (``redis_url`` set)."""
    return bool(redis_settings(config).redis_url)


def from_config(ctx: TierContext) -> RedisTier | None:
    """The redis tier, or ``None`` without ``redis_url``.  The server need not be up: an
    unreachable one is a run of misses until it answers.

    Raises:
        ConfigError: redis-py missing, or an unreadable password or secret file
            (:func:`make_client`, :func:`shared_secret`).
    """
    config = ctx.config
    settings = redis_settings(config)
    if not settings.redis_url:
        return None
    client = LazyClusterClient(settings) if settings.redis_cluster else make_client(settings)
    return RedisTier(client, ctx.namespace, shared_secret(config), settings.redis_key_prefix, settings.redis_ttl_s,
                     config.shared_deadline_s, config.io_threads, config.shared_queue_depth,
                     CircuitBreaker(settings.redis_breaker_failures, settings.redis_breaker_probe_s),
                     transfer_deadline_s=config.shared_transfer_deadline_s, registry=ctx.registry,
                     where=redact_url(settings.redis_url))


def reset(config: KVTierConfig, namespace: bytes) -> ClearResult:
    """Delete namespace ``namespace``'s keys from the configured server from outside any store (a
    tier made for the purpose, then closed); nothing to do without ``redis_url``."""
    from prometheus_client import CollectorRegistry

    from kvtier.core.tiers.factory import TierContext

    try:
        tier = from_config(TierContext(config, namespace, 0, 1, CollectorRegistry()))
    except ConfigError as exc:
        return ClearResult([], False, str(exc))
    if tier is None:
        return ClearResult([])
    try:
        return tier.clear()
    finally:
        tier.close()
