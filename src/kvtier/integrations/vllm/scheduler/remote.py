"""The scheduler's questions to the shared tier (e.g. Redis / Valkey), asked off the scheduler's thread.

The mirror (:class:`~kvtier.integrations.vllm.scheduler.steps.IndexMirror`) knows only what the engine's own workers
hold.  For the part of a prompt beyond the mirror's hit, :class:`RemoteLookups` sends one
pipelined presence batch (``EXISTS`` per chunk) to the shared tier per tensor-parallel rank, on
its own threads, and hands back "ask again" (``None``) until the answer is in or
``shared_deadline_s`` has passed (then: 0 more chunks).  vLLM's ``get_num_new_matched_tokens``
answers ``(None, False)`` meanwhile (vllm/v1/core/sched/scheduler.py skips the request for this
step and asks again in the next one), so the engine's step never waits on the network.

- The scheduler asks :meth:`RemoteLookups.poll_pages` for every model: the batch is over the
  page keys no local tier holds (a dense model's pages are its chunks; a hybrid model's are
  chunk key and KV cache group); the hit is then planned over local and shared pages together
  (:meth:`~kvtier.integrations.vllm.scheduler.steps.PagePlanner.lookup`).
- A page counts only if every rank's value is there (each rank stores its own KV heads under its
  own namespace, reported by the workers in ``RankReport.namespace``): the answer is the pages
  every rank holds.
- A tier that can answer on the caller's thread without I/O (``contains_now``: the node tier reads
  its pool's presence table, :mod:`kvtier.core.tiers.node.presence`) is asked there first: the
  answer is in at the first poll, and no thread has to be woken for it.
- Bounded: at most ``shared_queue_depth`` lookups in flight; more are answered "0 more" at once
  (counted in :attr:`RemoteLookups.skipped`).  Each rank's tier has its own deadline, timeouts and
  circuit breaker (:class:`~kvtier.core.tiers.guarded.GuardedTier`): a dead server is a fast miss.
- The answer is a promise the worker checks: the load reads the values with one pipelined ``GET``
  and verifies each; a value gone since (evicted, server restarted) ends the load short and vLLM
  recomputes the rest.
- Counted (:meth:`RemoteLookups.counters`, exported to vLLM's ``/metrics`` as
  ``kvtier_shared_lookups_*`` by the scheduler-side connector): lookups sent, answered, timed
  out, superseded and skipped, chunks asked and found by the answered ones, and lookups pending.
  At every scrape ``sent == answered + superseded + pending``: a lookup whose request's span
  changed (its local hit grew) is replaced by a new one and counted superseded, as is one
  dropped with its request before its answer was read.
- For the request's receipt (issue 35), :meth:`RemoteLookups.outcome` says why a lookup did not
  answer: ``deadline`` (past ``shared_deadline_s``, the tier's own deadline, or not sent because
  ``shared_queue_depth`` lookups were in flight) or ``breaker_open`` (the tier's breaker was open,
  or the tier not ready); the receipt's miss then names it instead of ``new``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier.core.codecstats import codec_numbers
from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.base import AnswersNow
from kvtier.core.tiers.factory import TierContext, make_tier, shared_configured
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.loglimit import CauseLimiter, held_back

if TYPE_CHECKING:
    from kvtier.integrations.vllm.scheduler.steps import PagePlanner

log = logging.getLogger(__name__)
T = TypeVar("T")


def shared_tier_configured(config: KVTierConfig) -> bool:
    """Whether ``config`` asks for a shared tier (a registered tier with ``shared``, in ``tiers``
    and configured; :func:`kvtier.core.tiers.factory.shared_configured`)."""
    return bool(shared_configured(config))


def unheld_pages(pages: PagePlanner, chain: Sequence[bytes], num_computed_tokens: int, num_tokens: int) -> list[bytes]:
    """Keys of the pages a hit beyond ``num_computed_tokens`` could use that no rank's local tiers
    hold (every group of ``pages``' plan, every chunk up to the last one vLLM lets a connector load):
    what the scheduler asks the shared tier about (``chain``: the request's chunk keys)."""
    first = num_computed_tokens // pages.C
    limit = min(len(chain), max(0, num_tokens - 1) // pages.C)
    return [key for c in range(first, limit) for g in pages.plan.groups
            if pages.mirror.tier(key := pages.key(chain, g.index, c)) is None]


class RemoteLookups:
    """Background presence checks in the shared tier for the scheduler (see the module docstring).

    Asks the first shared tier ``config`` lists (the workers' stores read from that one too);
    :attr:`tier_name` is its name.

    Args:
        config: kvtier configuration (the shared tier's settings, deadlines, ``shared_queue_depth``,
            ``io_threads``).

    Raises:
        ConfigError: ``config`` asks for no shared tier.
    """

    def __init__(self, config: KVTierConfig) -> None:
        self.config = config
        names = shared_configured(config)
        if not names:
            raise ConfigError("remote lookups need a shared tier in tiers and its settings set")
        self.tier_name = names[0]
        self.deadline_s = config.shared_deadline_s
        self.queue_depth = config.shared_queue_depth
        self._tiers: list[Any] = []
        self._namespaces: tuple[bytes, ...] = ()
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvtier-remote-lookup")
        self._lock = threading.Lock()
        self._in_flight = 0
        # req_id -> (page keys asked, the lookup or its answer, deadline); answered ones stay until the
        # request is planned or gone
        self._pending: dict[str, tuple[tuple[bytes, ...], Future[tuple[frozenset[bytes], str, float]] | frozenset[bytes], float]] = {}
        self._unanswered: set[str] = set()  # requests whose sent lookup's answer was not read yet
        self._outcomes: dict[str, str] = {}  # req_id -> why its lookup did not answer (receipt miss reason)
        self._skip_reason = ""  # why the last _start sent nothing
        self.asked = self.answered = self.timed_out = self.skipped = self.superseded = 0
        self._timeout_lines = CauseLimiter()  # one line per interval: a slow server times out every request's lookup
        self.answered_chunks = self.found_chunks = 0  # over answered lookups: the shared tier's hit rate
        self._sealed_away_closed = 0  # values sealed under a key the ring lacks, met by tiers closed since
        self._counters_sent: dict[str, int] = {}  # counters() as last taken (take_counters)
        self._pending_sent: int | None = None  # the pending gauge as last sent

    def bind(self, namespaces: Sequence[bytes]) -> bool:
        """Use the shared tier under the ranks' ``namespaces``; False while a rank's is unknown."""
        key = tuple(namespaces)
        if key == self._namespaces:
            return bool(self._tiers)
        if not all(key):
            return False
        from prometheus_client import CollectorRegistry

        self.close_tiers()
        self._namespaces = key
        try:
            # A private registry per tier: the scheduler's tiers only ask about presence; their
            # kvtier_tier_* numbers are not exported (the workers' tiers do the reads and writes).
            for ns in key:
                tier = make_tier(self.tier_name, TierContext(self.config, ns, 0, len(key), CollectorRegistry()))
                if tier is not None:
                    self._tiers.append(tier)
        except ConfigError as exc:  # the workers' stores refused the same config at start-up already
            log.error("kvtier: the scheduler cannot use the shared tier (%s); answering from local tiers", exc)
            self.close_tiers()
        return bool(self._tiers)

    def poll_pages(self, req_id: str, keys: Sequence[bytes]) -> frozenset[bytes] | None:
        """Which of ``keys`` (page keys, in any order; none of them held locally)
        the shared tier holds for every rank; ``None`` ("ask again") while the lookup runs, the
        empty set past ``shared_deadline_s`` or on a fault.  Never blocks."""
        asked = tuple(keys)
        entry = self._pending.get(req_id)
        if entry is not None and isinstance(entry[1], frozenset) and set(asked) <= set(entry[0]):
            return entry[1].intersection(asked)  # answered; pages since saved locally are no longer asked
        if entry is None or entry[0] != asked:
            self._supersede(req_id)
            self._outcomes.pop(req_id, None)
            now = self._held_now(asked) if asked else None
            if now is not None:  # answered on this thread: sent and answered at once
                self.asked += 1
                self._answered(req_id, len(asked), len(now), False)
                self._pending[req_id] = (asked, now, time.monotonic() + self.deadline_s)
                return now
            # the answer carries when it came (a late one is a time-out however late the poll that reads it);
            # the deadline is set before the lookup starts, so it never falls after the tier's own
            deadline = time.monotonic() + self.deadline_s
            future = self._start(lambda tiers: (*_held_by_every_rank(tiers, asked), time.monotonic())) \
                if asked else None
            if future is not None:
                self._unanswered.add(req_id)
            elif asked:
                self._outcomes[req_id] = self._skip_reason
            entry = self._pending[req_id] = (asked, frozenset() if future is None else future, deadline)
        _, answer, deadline = entry
        if isinstance(answer, frozenset):
            return answer
        timed_out, fault = False, ""
        if answer.done():
            try:
                found, fault, answered_at = answer.result()
            except Exception:  # noqa: BLE001 - a fault in the shared tier is a miss
                found, answered_at = frozenset[bytes](), 0.0
            if answered_at >= deadline:  # came after shared_deadline_s: a time-out, whenever it is read
                found, timed_out = frozenset[bytes](), True
        elif time.monotonic() >= deadline:
            found, timed_out = frozenset(), True
        else:
            return None
        if timed_out or fault in ("deadline", "breaker_open"):
            self._outcomes[req_id] = "deadline" if timed_out else fault
        self._answered(req_id, len(asked), len(found), timed_out)
        self._pending[req_id] = (asked, found, deadline)
        return found

    def _held_now(self, keys: Sequence[bytes]) -> frozenset[bytes] | None:
        """Those of ``keys`` every rank's tier holds, when every rank's tier answers on this thread
        (:class:`~kvtier.core.tiers.base.AnswersNow`); ``None`` when one cannot (then the lookup
        threads ask)."""
        left = list(keys)
        for tier in self._tiers:
            present = tier.contains_now([ChunkKey(k) for k in left]) if isinstance(tier, AnswersNow) else None
            if present is None:
                return None
            left = [k for k, hit in zip(left, present, strict=True) if hit]
            if not left:
                break
        return frozenset(left) if self._tiers else None

    def outcome(self, req_id: str) -> tuple[str, str] | None:
        """Why ``req_id``'s lookup did not answer, as a receipt's ``(reason, tier)``:
        ``("deadline", tier)`` or ``("breaker_open", tier)`` (see the module docstring); ``None``:
        it answered (or was never sent)."""
        reason = self._outcomes.get(req_id)
        return (reason, self.tier_name) if reason else None

    def _answered(self, req_id: str, asked: int, found: int, timed_out: bool) -> None:
        """Count an answered lookup (``asked`` pages, ``found`` of them in the shared tier)."""
        self._unanswered.discard(req_id)
        self.answered += 1
        self.answered_chunks += asked
        self.found_chunks += found
        if timed_out:
            self.timed_out += 1
            if (unlogged := self._timeout_lines.admit("deadline")) is not None:
                log.info("kvtier: shared-tier lookup for request %s passed shared_deadline_s=%s; answered from "
                         "local tiers%s", req_id, self.deadline_s, held_back(unlogged))

    def _supersede(self, req_id: str) -> None:
        """Count ``req_id``'s sent lookup as superseded if its answer was never read."""
        if req_id in self._unanswered:
            self._unanswered.discard(req_id)
            self.superseded += 1

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s lookup (planned, or the request is gone); one still unanswered
        counts as superseded."""
        self._supersede(req_id)
        self._pending.pop(req_id, None)
        self._outcomes.pop(req_id, None)

    def forget_all(self) -> None:
        """Drop every request's lookup (a reset: answers given before it may count removed chunks)."""
        for req_id in list(self._pending):
            self.forget(req_id)

    def _start(self, ask: Callable[[list[Any]], T]) -> Future[T] | None:
        """Run ``ask(tiers)`` on the lookup threads; ``None`` (counted as skipped) when the tier is
        not ready, ``shared_queue_depth`` lookups are in flight, or the pool is closed."""
        with self._lock:
            if not self._tiers or self._in_flight >= self.queue_depth:
                self.skipped += 1
                self._skip_reason = "deadline" if self._tiers else "breaker_open"  # backed up / not ready
                return None
            self._in_flight += 1
            tiers = list(self._tiers)
        self.asked += 1

        def run() -> T:
            try:
                return ask(tiers)
            finally:
                with self._lock:
                    self._in_flight -= 1

        try:
            return self._pool.submit(run)
        except RuntimeError:  # closed
            with self._lock:
                self._in_flight -= 1
            self._skip_reason = "breaker_open"
            return None

    @property
    def tiers(self) -> tuple[Any, ...]:
        """The shared tier, one per rank's namespace, that the lookups ask (empty until bound)."""
        return tuple(self._tiers)

    @property
    def pending(self) -> int:
        """Lookups sent whose answer the scheduler has not read yet (neither answered nor
        superseded), so that ``asked == answered + superseded + pending``.  Superseded lookups
        still running occupy ``shared_queue_depth`` until they finish but are not counted here."""
        return len(self._unanswered)

    def counters(self) -> dict[str, int]:
        """Totals since start: ``shared_lookups`` (sent), ``shared_lookups_answered``,
        ``shared_lookups_timed_out`` (answered at the deadline), ``shared_lookups_superseded``
        (replaced or dropped before their answer was read; sent = answered + superseded +
        :attr:`pending`), ``shared_lookups_skipped`` (not sent: queue full or the tier not ready),
        ``shared_lookup_chunks`` / ``shared_lookup_hit_chunks`` (asked / found, over answered
        lookups), ``shared_lookup_sealed_away_chunks`` (values the lookups answered absent because
        they are sealed under a master key this kvtier's ring lacks, each once:
        :mod:`kvtier.core.tiers.sealedaway`)."""
        sealed_away = self._sealed_away_closed + sum(_sealed_away(t) for t in self._tiers)
        return {"shared_lookups": self.asked, "shared_lookups_answered": self.answered,
                "shared_lookups_timed_out": self.timed_out, "shared_lookups_superseded": self.superseded,
                "shared_lookups_skipped": self.skipped,
                "shared_lookup_chunks": self.answered_chunks, "shared_lookup_hit_chunks": self.found_chunks,
                "shared_lookup_sealed_away_chunks": sealed_away}

    def take_counters(self) -> dict[str, int]:
        """:meth:`counters`' changes since the last call (none unchanged)."""
        totals = self.counters()
        changed = {k: v - self._counters_sent.get(k, 0) for k, v in totals.items() if v != self._counters_sent.get(k, 0)}
        self._counters_sent = totals
        return changed

    def pending_gauge(self, other_news: bool) -> dict[str, float]:
        """``shared_lookups_pending`` when it changed since last sent, or with ``other_news`` (counters
        sent in the same stats); else empty."""
        if self.pending == self._pending_sent and not other_news:
            return {}
        self._pending_sent = self.pending
        return {"shared_lookups_pending": self.pending}

    def close_tiers(self) -> None:
        for tier in self._tiers:
            self._sealed_away_closed += _sealed_away(tier)
            tier.close()
        self._tiers = []

    def close(self) -> None:
        """Stop asking; idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.close_tiers()


def _sealed_away(tier: Any) -> int:
    """Values a scheduler's tier found sealed under a key its ring lacks (its lookups are all it
    does, so every decrypt failure it counted is one of them)."""
    numbers = codec_numbers(tier)
    return numbers.decrypt_failures if numbers is not None else 0


def _held_by_every_rank(tiers: Sequence[Any], keys: Sequence[bytes]) -> tuple[frozenset[bytes], str]:
    """Those of ``keys`` (in any order) every rank's tier holds: one pipelined EXISTS batch per
    rank, over what every earlier rank holds; and the first fault a rank's tier reported
    (``deadline``, ``breaker_open``, ``load_failed``; ``""``: none)."""
    left = list(keys)
    fault: list[str] = []
    for tier in tiers:
        chunk_keys = [ChunkKey(k) for k in left]
        present = tier.contains_many(chunk_keys, fault=fault) if isinstance(tier, GuardedTier) \
            else tier.contains_many(chunk_keys)
        left = [k for k, hit in zip(left, present) if hit]
        if not left:
            break
    return frozenset(left), fault[0] if fault else ""
