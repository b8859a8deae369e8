"""``GuardedTier(inner)``: deadlines, a circuit breaker and latency metrics for any remote tier.

A remote tier's own code only talks to its server; what every remote tier needs around that
lives here, once:

- **Deadlines.**  Each batch call (and each blob verb: ``get``, ``read_into``, ``get_range``) runs on the wrapper's threads (``io_threads``, at most
  ``queue_depth`` more waiting: a full queue is a skipped call, never a wait); the caller waits
  at most ``deadline_s`` for presence and delete batches and ``transfer_deadline_s`` for reads
  and writes, then gets misses (``MISS``, ``False``, ``FAILED``).
- **No late writes into a caller's buffer.**  Reads go into the wrapper's own buffers and are
  copied into the caller's only after the call returned in time; a call given up at the
  deadline may finish later, into buffers nobody reads.  Writes hand the inner tier private
  copies, so a caller may reuse its buffer as soon as ``put_many`` returns.  A tier that
  implements :class:`SplitTier` keeps its own data path instead, without those copies (below).
- **Circuit breaker** (:class:`~kvtier.core.tiers.breaker.CircuitBreaker`): a call that raises
  or passes its deadline is a failure; ``breaker_failures`` in a row open it, and calls are then
  skipped (counted) without reaching the inner tier until a probe every ``breaker_probe_s``
  succeeds.  An exception of one of the inner tier's ``refusal_errors`` (the server answered and
  refused, e.g. a full Redis's ``-OOM``) fails that call only and does not open the breaker.
- **Log lines**: a fault is one WARNING with its short cause (the inner tier's ``describe_error``,
  e.g. the s3 tier's ``connection refused to http://...``; full text at DEBUG), at most one per
  cause per 10 s and a new cause at once (:class:`~kvtier.core.tiers.loglimit.CauseLimiter`); the
  breaker closing again is one INFO line ("reachable again after N s").
- **Numbers**: a :class:`~kvtier.core.stats.WireCounters` (errors and skipped calls by op,
  skipped writes, lookups) merged into the inner tier's :meth:`wire_stats`, and the latency
  histogram ``kvtier_tier_call_seconds{tier, op}``
  (:class:`~kvtier.core.tiers.tiermetrics.TierMetrics`).

The inner tier raises on a fault (it is called only through this wrapper); its results on a
success are passed through unchanged.

A remote tier that implements :class:`~kvtier.core.tiers.split.SplitTier` keeps its own data path
behind the wrapper (:mod:`kvtier.core.tiers.split`); one that also bounds its own waits
(:class:`~kvtier.core.tiers.split.BoundsItself`: the node tier) is read on the caller's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from kvtier.core.keys import ChunkKey
from kvtier.core.stats import WireCounters, WireStats
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.base import ClearResult, GetResult, PutResult, Tier
from kvtier.core.tiers.breaker import CircuitBreaker
from kvtier.core.tiers.loglimit import CauseLimiter, held_back
from kvtier.core.tiers.sharedreads import SharedReads
from kvtier.core.tiers.split import BoundsItself, SplitTier, split_get
from kvtier.core.tiers.tiermetrics import TierMetrics
from kvtier.core.tiers.valueread import check_range, check_room
from kvtier.core.tiers.wrappers import MissWhy, TierWrapper

log = logging.getLogger(__name__)
T = TypeVar("T")


def describe_error(exc: BaseException) -> str:
    """``"ConnectionError: Error 111 connecting to ..."``: an exception's class and the first line of
    its text, for a tier without its own ``describe_error``."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


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
        clear_deadline_s: with a value, :meth:`clear` runs the inner tier's on the wrapper's
            threads under this deadline, seconds (a fault: a ``ClearResult`` that is not ``ok``);
            ``None``: the inner tier's ``clear`` is called as is (it bounds itself).
    """

    def __init__(self, inner: Tier, deadline_s: float, transfer_deadline_s: float, io_threads: int,
                 queue_depth: int, breaker: CircuitBreaker, registry: CollectorRegistry | None = None,
                 where: str = "", clear_deadline_s: float | None = None) -> None:
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
        self._warnings = CauseLimiter()  # one line per cause per 10 s, a new cause at once
        self._describe: Callable[[BaseException], str] = getattr(inner, "describe_error", describe_error)
        self.clear_deadline_s = clear_deadline_s
        direct = not isinstance(inner, TierWrapper)  # SplitTier is never reached through another wrapper
        self._split = inner if direct and isinstance(inner, SplitTier) else None
        self._bounded = self._split if isinstance(self._split, BoundsItself) else None  # (a protocol check: ~10 µs)

    # ---- the call path ---------------------------------------------------------------------
    def _deadline(self, op: str) -> float:
        if op == "clear" and self.clear_deadline_s is not None:
            return self.clear_deadline_s
        return self.transfer_deadline_s if op in ("get", "put") else self.deadline_s

    def _call(self, op: str, fn: Callable[[], T], during: Callable[[float], None] | None = None,
              fault: list[str] | None = None, within_s: float | None = None) -> T | None:
        """``fn()`` on the wrapper's threads under ``op``'s deadline (or a tighter ``within_s``); ``None``
        on any fault (counted).  ``during(deadline)``, if given, runs on the caller's thread once ``fn``
        is submitted; the deadline (a ``time.perf_counter()`` value) counts from the submission.
        ``fault``, if given, gets the fault's kind appended (:data:`~kvtier.core.receipt.MissReason`)."""
        if not self._admit(op, fault, slot=True):
            return None
        deadline_s = min(self._deadline(op), within_s or float("inf"))
        t0 = time.perf_counter()
        future: Future[T] = self._pool.submit(self._run, fn)

        def wait() -> T:
            try:
                if during is not None:
                    during(t0 + deadline_s)
                return future.result(timeout=max(deadline_s - (time.perf_counter() - t0), 0.0))
            except FutureTimeout:
                if future.cancel():  # never started: its slot is ours to give back
                    self._slots.release()
                raise
        return self._outcome(op, wait, t0, deadline_s, fault)

    def _call_here(self, op: str, fn: Callable[[float], T], fault: list[str] | None = None,
                   within_s: float | None = None) -> T | None:
        """:meth:`_call` for a tier that bounds its own waits (:class:`BoundsItself`): ``fn(deadline)``
        on the caller's thread, no hop to the wrapper's; the same deadline, breaker and counts (the
        tier's ``TimeoutError`` is a ``deadline`` fault)."""
        if not self._admit(op, fault, slot=False):
            return None
        deadline_s = min(self._deadline(op), within_s or float("inf"))
        t0 = time.perf_counter()
        return self._outcome(op, lambda: fn(t0 + deadline_s), t0, deadline_s, fault)

    def _admit(self, op: str, fault: list[str] | None, slot: bool) -> bool:
        """Whether a call may start (not closed, a free ``slot`` if asked, the breaker closed); a
        skipped one counted."""
        if self._closed or (slot and not self._slots.acquire(blocking=False)):
            self.wire.skipped(op)
            if fault is not None:
                fault.append("load_failed")  # closed, or queue_depth calls already waiting
            return False
        if not self.breaker.allow():
            if slot:
                self._slots.release()
            self.wire.skipped(op)
            if fault is not None:
                fault.append("breaker_open")
            return False
        return True

    def _outcome(self, op: str, run: Callable[[], T], t0: float, deadline_s: float,
                 fault: list[str] | None) -> T | None:
        """``run()``'s result, or ``None`` on a fault (counted, the breaker told)."""
        try:
            result = run()
        except TimeoutError:  # the future's wait (FutureTimeout is TimeoutError), or a tier's own bound
            self._fault(op, f"deadline of {deadline_s:.3f} s passed")
            if fault is not None:
                fault.append("deadline")
            return None
        except self._refusals as exc:
            self._back(self.breaker.success())  # the server is up and answered: reads go on while writes are refused
            self._fault(op, self._cause(op, exc), refused=True)
            if fault is not None:
                fault.append("load_failed")
            return None
        except Exception as exc:  # noqa: BLE001 - every server or network fault is a miss
            self._fault(op, self._cause(op, exc))
            if fault is not None:
                fault.append("load_failed")
            return None
        if (down_s := self.breaker.success()) is not None:
            self._back(down_s)
        self.metrics.observe(op, time.perf_counter() - t0)
        return result

    def _run(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        finally:
            self._slots.release()

    def _cause(self, op: str, exc: BaseException) -> str:
        """The fault's short cause (the inner tier's ``describe_error``, if it has one); its full
        text at DEBUG."""
        log.debug("kvtier %s tier (%s): %s failed: %r", self.name, self.where, op, exc)
        return self._describe(exc)

    def _fault(self, op: str, reason: str, refused: bool = False) -> None:
        if not refused:
            self.breaker.failure()
        self.wire.error(op)
        verb = "refused by the server" if refused else "failed"
        if (held := self._warnings.admit(f"{verb}: {reason}")) is None:
            return  # this cause was logged within 10 s; a new cause is logged at once
        log.warning("kvtier %s tier (%s): %s %s (%s); %s, breaker %s%s", self.name, self.where, op, verb, reason,
                    "chunks not written" if op == "put" else "treated as a miss", self.breaker.state.name.lower(),
                    held_back(held))

    def _back(self, down_s: float | None) -> None:
        """The breaker closed again after ``down_s`` seconds open: one line, and the next fault of
        any cause is logged at once."""
        if down_s is not None:
            self._warnings.forget()
            log.info("kvtier %s tier (%s): reachable again after %.1f s; breaker closed", self.name, self.where,
                     down_s)

    # ---- Tier contract -----------------------------------------------------------------------
    def contains_many(self, keys: Sequence[ChunkKey], fault: list[str] | None = None) -> list[bool]:
        if not keys:
            return []
        got = self._call("lookup", lambda: self.inner.contains_many(keys), fault=fault)  # faulted: all absent
        found = [False] * len(keys) if got is None else got
        self.wire.looked_up(len(keys), sum(found))
        return found

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview],
                 records: TenantRecords | None = None, why: MissWhy | None = None,
                 within_s: float | None = None) -> list[GetResult]:
        """The inner tier's read under the deadline and the breaker; a call that faulted is every
        key a ``MISS``, and ``why`` (if given) gets each key's reason: ``breaker_open``,
        ``deadline`` or ``load_failed`` (:func:`~kvtier.core.tiers.wrappers.get_explained`).
        ``within_s``: a tighter deadline (a synchronous load's read on the engine's thread)."""
        if not keys:
            return []
        fault: list[str] | None = [] if why is not None else None
        if (split := self._split) is not None:  # the wire half under the deadline, then verify on this thread
            prepare = getattr(split, "while_fetching", None)
            if (bounded := self._bounded) is not None:  # on this thread, no hop: its own waits end by the deadline
                def fetch() -> Any:
                    return self._call_here("get", lambda d: bounded.fetch_many_by(
                        keys, d, (lambda: prepare(dsts)) if prepare else None, dsts), fault, within_s)
            else:
                def fetch() -> Any:
                    return self._call("get", lambda: split.fetch_many(keys),
                                      (lambda _d: prepare(dsts)) if prepare else None, fault, within_s)
            results = split_get(split, keys, dsts, fetch, self.delete_many, records)
            if fault and why is not None:
                why.update(dict.fromkeys(keys, fault[0]))
            return results
        own = [bytearray(memoryview(d).nbytes) for d in dsts]  # a late call fills these, never the caller's
        own_records: TenantRecords = {}  # likewise: a late call's records never reach the caller's
        got = self._call("get", lambda: self.inner.get_many(keys, [memoryview(b) for b in own], own_records),
                         fault=fault, within_s=within_s)
        if got is None:
            if fault and why is not None:
                why.update(dict.fromkeys(keys, fault[0]))
            return [GetResult.MISS] * len(keys)
        for key, result, buf, dst in zip(keys, got, own, dsts, strict=True):
            if result is GetResult.HIT:
                memoryview(dst).cast("B")[:] = buf
                if records is not None and key in own_records:
                    records[key] = own_records[key]
        return got

    def _split_read(self, key: ChunkKey, dst: memoryview | None, records: TenantRecords | None,
                    split: SharedReads) -> memoryview | bytes | None:
        """A shared tier's blob read split as ``get_many``'s is: the fetch under the deadline, then
        verify and decode into ``dst`` on this thread (no copy beyond the one a read needs)."""
        fetched = self._call("get", lambda: split.fetch_many([key]))
        if fetched is None:
            return None
        payload, failed = split.finish_read(key, fetched, dst, records)
        if failed:
            self.delete_many([key])
        return payload

    def get(self, key: ChunkKey, records: TenantRecords | None = None) -> bytes | None:
        """The inner tier's ``get`` under the read deadline; ``None`` on a fault (counted).  A late
        call's bytes and record reach nobody (a new buffer, a private record dict)."""
        if isinstance(split := self._split, SharedReads):
            got = self._split_read(key, None, records, split)
            return None if got is None else bytes(got)
        own: TenantRecords = {}
        got = self._call("get", lambda: self.inner.get(key, own))
        if got is not None and records is not None and key in own:
            records[key] = own[key]
        return got

    def read_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> int | None:
        """A shared tier's read split (the fetch on the wrapper's threads, verified into ``dst`` on
        this one); another tier's :meth:`get`, then one copy into ``dst`` on this thread.  Never a
        late write into ``dst``.

        Raises:
            BufferTooSmall: ``dst`` is shorter than the payload (nothing written).
        """
        if isinstance(split := self._split, SharedReads):
            payload = self._split_read(key, dst, records, split)
            return None if payload is None else len(payload)
        own: TenantRecords = {}
        got = self.get(key, own)
        if got is None:
            return None
        check_room(len(got), dst)[:] = got
        if records is not None and key in own:
            records[key] = own[key]
        return len(got)

    def get_range(self, key: ChunkKey, offset: int, length: int) -> bytes | None:
        """The inner tier's ``get_range`` under the read deadline (unverified bytes: see
        :mod:`kvtier.core.tiers.valueread`); ``None`` on a fault.  Raises ValueError for a negative
        ``offset`` or ``length`` (the caller's mistake, not a fault)."""
        check_range(offset, length)
        return self._call("get", lambda: self.inner.get_range(key, offset, length))

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                 tenants: Sequence[Writer | None] | None = None) -> list[PutResult]:
        if not keys:
            return []
        if self._split is not None:  # the caller's buffers, uncopied (see SplitTier)
            stream = self._split.stream_put(keys, datas, tenants)
            try:
                got = self._call("put", stream.send, during=stream.produce)
            finally:
                stream.abandon()
        else:
            copies = [bytes(d) for d in datas]  # the caller may reuse its buffers once this returns
            got = self._call("put", lambda: self.inner.put_many(keys, copies, tenants))
        if got is None:
            self.wire.writes_skipped(len(keys))
            return [PutResult.FAILED] * len(keys)
        return got

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        got = self._call("delete", lambda: self.inner.delete_many(keys))
        return [False] * len(keys) if got is None else got

    def clear(self) -> ClearResult:
        """The inner tier's ``clear``; with ``clear_deadline_s``, on the wrapper's threads under it
        (breaker open, queue full, a fault or the deadline: not ``ok``, with the reason)."""
        if self.clear_deadline_s is None:
            return self.inner.clear()
        got = self._call("clear", self.inner.clear)
        if got is None:
            return ClearResult([], False, f"the {self.name} server at {self.where} did not list and delete the "
                                          f"namespace's keys within {self.clear_deadline_s:g} s")
        return got

    @property
    def skipped_writes(self) -> int:
        """Chunks not written (breaker open, queue full, or the write failed); from :meth:`wire_stats`."""
        return self.wire_stats().skipped_writes

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
