"""``GuardedTier(inner)``: deadlines, a circuit breaker and latency metrics for any remote tier.

A remote tier's own code only talks to its server; what every remote tier needs around that
lives here, once:

- **Deadlines.**  Each batch call runs on the wrapper's threads (``io_threads``, at most
  ``queue_depth`` more waiting: a full queue is a skipped call, never a wait); the caller waits
  at most ``deadline_s`` for presence and delete batches and ``transfer_deadline_s`` for reads
  and writes, then gets misses (``MISS``, ``False``, ``FAILED``).
- **No late writes into a caller's buffer.**  Reads go into the wrapper's own buffers and are
  copied into the caller's only after the call returned in time; a call given up at the
  deadline may finish later, into buffers nobody reads.  Writes hand the inner tier private
  copies, so a caller may reuse its buffer as soon as ``put_many`` returns.  An inner tier that
  implements :class:`ValueTier` skips both extra copies: its reads return values it allocated
  itself (a late one lands in nobody's buffer) and are verified and copied into the caller's
  buffers on the caller's thread after the call returned in time; its writes are encoded (the
  one copy a write needs) on the caller's thread before the call is queued.
- **Circuit breaker** (:class:`~kvtier.core.tiers.breaker.CircuitBreaker`): a call that raises
  or passes its deadline is a failure; ``breaker_failures`` in a row open it, and calls are then
  skipped (counted) without reaching the inner tier until a probe every ``breaker_probe_s``
  succeeds.  An exception of one of the inner tier's ``refusal_errors`` (the server answered and
  refused, e.g. a full Redis's ``-OOM``) fails that call only and does not open the breaker.
- **Numbers**: a :class:`~kvtier.core.stats.WireCounters` (errors and skipped calls by op,
  skipped writes, lookups) merged into the inner tier's :meth:`wire_stats`, and the latency
  histogram ``kvtier_tier_call_seconds{tier, op}``
  (:class:`~kvtier.core.tiers.tiermetrics.TierMetrics`).

The inner tier raises on a fault (it is called only through this wrapper); its results on a
success are passed through unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol, TypeVar, runtime_checkable

from prometheus_client import CollectorRegistry

from kvtier.core.keys import ChunkKey
from kvtier.core.stats import WireCounters, WireStats
from kvtier.core.tiers.base import GetResult, PutResult, Tier
from kvtier.core.tiers.breaker import CircuitBreaker
from kvtier.core.tiers.tiermetrics import TierMetrics
from kvtier.core.tiers.wrappers import TierWrapper

log = logging.getLogger(__name__)
T = TypeVar("T")


@runtime_checkable
class ValueTier(Protocol):
    """A remote tier whose values can be fetched and stored whole, without the wrapper's private
    copies (the s3 tier; see the module docstring).  Each method raises on a fault, as the tier's
    ``get_many``/``put_many`` do.

    - ``read_values(keys)``: one value per key, each a new buffer the tier allocated (``None``:
      absent), fetched in parallel; runs on the wrapper's threads.
    - ``accept_values(keys, values, dsts, seconds)``: verify each value and copy its payload into
      ``dsts`` (a corrupt or expired value is a miss, and the tier deletes it in the background,
      never waiting); ``seconds``: how long the read took (the tier's numbers).  Runs on the
      caller's thread, after ``read_values`` returned in time.
    - ``encode_values(keys, datas)``: the values to write (header + payload), made on the
      caller's thread so the caller may reuse ``datas`` once ``put_many`` returns.
    - ``put_values(keys, values, payload_bytes)``: write them; runs on the wrapper's threads.
    """

    def read_values(self, keys: Sequence[ChunkKey]) -> list[Any]: ...

    def accept_values(self, keys: Sequence[ChunkKey], values: Sequence[Any], dsts: Sequence[memoryview],
                      seconds: float) -> list[GetResult]: ...

    def encode_values(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes]) -> list[Any]: ...

    def put_values(self, keys: Sequence[ChunkKey], values: Sequence[Any], payload_bytes: Sequence[int]
                   ) -> list[PutResult]: ...


class GuardedTier(TierWrapper):
    """``inner`` behind deadlines, a breaker and latency metrics (see the module docstring).

    Args:
        inner: the tier (raises on a fault; may list ``refusal_errors``, a tuple of exception
            classes that mean "the server answered and refused").
        deadline_s: longest a caller waits for a presence or delete batch, seconds (> 0).
        transfer_deadline_s: longest a caller waits for a read or write batch, seconds (> 0).
        io_threads / queue_depth: the wrapper's threads, and how many calls may wait for them.
        breaker: the circuit breaker.
        registry: prometheus registry for the latency histogram.
        where: where the inner tier's server is (redacted), for log lines.
    """

    def __init__(self, inner: Tier, deadline_s: float, transfer_deadline_s: float, io_threads: int,
                 queue_depth: int, breaker: CircuitBreaker, registry: CollectorRegistry | None = None,
                 where: str = "") -> None:
        super().__init__(inner)
        self.deadline_s = deadline_s
        self.transfer_deadline_s = transfer_deadline_s
        self.breaker = breaker
        self.metrics = TierMetrics(inner.name, registry)
        self.wire = WireCounters()
        self.where = where or inner.name
        self._refusals: tuple[type[BaseException], ...] = tuple(getattr(inner, "refusal_errors", ()))
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix=f"kvtier-{inner.name}-guard")
        self._slots = threading.BoundedSemaphore(io_threads + queue_depth)
        self._closed = False
        self._last_error = 0.0

    # ---- the call path ---------------------------------------------------------------------
    def _call(self, op: str, fn: Callable[[], T]) -> T | None:
        """``fn()`` on the wrapper's threads under ``op``'s deadline; ``None`` on any fault (counted)."""
        if self._closed or not self._slots.acquire(blocking=False):
            self.wire.skipped(op)
            return None
        if not self.breaker.allow():
            self._slots.release()
            self.wire.skipped(op)
            return None
        t0 = time.perf_counter()
        future: Future[T] = self._pool.submit(self._run, fn)
        deadline_s = self.transfer_deadline_s if op in ("get", "put") else self.deadline_s
        try:
            result = future.result(timeout=deadline_s)
        except FutureTimeout:
            if future.cancel():  # never started: its slot is ours to give back
                self._slots.release()
            self._fault(op, f"deadline of {deadline_s:.3f} s passed")
            return None
        except self._refusals as exc:
            self.breaker.success()  # the server is up and answered: reads go on while writes are refused
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
            log.warning("kvtier %s tier (%s): %s %s (%s); %s, breaker %s", self.name, self.where, op,
                        "refused by the server" if refused else "failed", reason,
                        "chunks not written" if op == "put" else "treated as a miss", self.breaker.state.name.lower())

    # ---- Tier contract -----------------------------------------------------------------------
    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        got = self._call("lookup", lambda: self.inner.contains_many(keys))
        found = [False] * len(keys) if got is None else got
        self.wire.looked_up(len(keys), sum(found))
        return found

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview]) -> list[GetResult]:
        if not keys:
            return []
        if isinstance(self.inner, ValueTier):
            inner = self.inner
            t0 = time.perf_counter()
            values = self._call("get", lambda: inner.read_values(keys))
            if values is None:
                return [GetResult.MISS] * len(keys)
            return inner.accept_values(keys, values, dsts, time.perf_counter() - t0)
        own = [bytearray(memoryview(d).nbytes) for d in dsts]  # a late call fills these, never the caller's
        got = self._call("get", lambda: self.inner.get_many(keys, [memoryview(b) for b in own]))
        if got is None:
            return [GetResult.MISS] * len(keys)
        for result, buf, dst in zip(got, own, dsts, strict=True):
            if result is GetResult.HIT:
                memoryview(dst).cast("B")[:] = buf
        return got

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes]) -> list[PutResult]:
        if not keys:
            return []
        if isinstance(self.inner, ValueTier):
            inner = self.inner
            values = inner.encode_values(keys, datas)  # the one copy a write needs, on the caller's thread
            sizes = [memoryview(d).nbytes for d in datas]
            put = self._call("put", lambda: inner.put_values(keys, values, sizes))
            if put is None:
                self.wire.writes_skipped(len(keys))
                return [PutResult.FAILED] * len(keys)
            return put
        copies = [bytes(d) for d in datas]  # the caller may reuse its buffers once this returns
        got = self._call("put", lambda: self.inner.put_many(keys, copies))
        if got is None:
            self.wire.writes_skipped(len(keys))
            return [PutResult.FAILED] * len(keys)
        return got

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        got = self._call("delete", lambda: self.inner.delete_many(keys))
        return [False] * len(keys) if got is None else got

    def wire_stats(self) -> WireStats:
        """The inner tier's wire numbers (bytes, seconds, corrupt values) with this wrapper's
        (errors, skipped calls and writes, lookups) and the breaker's state."""
        mine = self.wire.snapshot(int(self.breaker.state), self.breaker.num_opened)
        inner = self.inner.wire_stats() or WireStats()
        return WireStats(mine.lookup_keys + inner.lookup_keys, mine.lookup_hit_keys + inner.lookup_hit_keys,
                         {d: inner.bytes.get(d, 0) + n for d, n in mine.bytes.items()},
                         {d: inner.seconds.get(d, 0.0) + n for d, n in mine.seconds.items()},
                         {op: inner.errors.get(op, 0) + n for op, n in mine.errors.items()},
                         {op: inner.skipped_calls.get(op, 0) + n for op, n in mine.skipped_calls.items()},
                         mine.skipped_writes + inner.skipped_writes, mine.corrupt_values + inner.corrupt_values,
                         mine.breaker_state, mine.breaker_opened,
                         {d: inner.calls.get(d, 0) + n for d, n in mine.calls.items()})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.inner.close()
