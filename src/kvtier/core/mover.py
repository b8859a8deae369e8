"""The store's moving part: a load's path from plan to release, the tier reads that run the index's
plans, and where their events are counted.

The index (:mod:`kvtier.core.index`) decides; the :class:`Mover` moves bytes and reports what
happened by calling the index's verbs (the index never calls the mover).  It never holds the
index's lock during tier I/O: each verb it calls takes the lock for its own bookkeeping only.
The store's request-path verbs (a load's, the step's ``stats``, ``take_ghost_distances``) are the mover's, bound
at construction.  What a hit does not run (set-up, writes, landing buffers, shutdown) is :class:`MoverState`'s.

- **Reads** (promotions, docs/store.md): a load's :class:`~kvtier.core.handles.Read` s, one batch per
  tier in tier order, then :meth:`~kvtier.core.index.Index.complete_reads`; with read-ahead, the first
  ``io_threads`` before ``prepare_load`` returns, the rest on a background pool, advancing
  ``LoadHandle.ahead_from``.  A chunk missing or failing verification cuts the prefix there; a chunk
  read keeps its writer's tenant record (``records``, :data:`kvtier.core.tenant.TenantRecords`).
- **Counting**: a load's events go to its context's sink, fanned out (:meth:`CountersSink.bind`, :class:`Tee`) to
  the store's :class:`StoreCounters` and a :class:`RequestRecord`; their state is :mod:`kvtier.core.sinks`'.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

from kvtier.core import tenant
from kvtier.core.context import (
    NO_SINK,
    ChunkMissed,
    ChunksRead,
    ChunksServed,
    EngineLoad,
    Event,
    LoadCut,
    LoadFailed,
    OpContext,
    ServedBelow,
    Sink,
)
from kvtier.core.handles import Into, LoadHandle, LoadPlan, Read
from kvtier.core.index import Index
from kvtier.core.keys import ChunkKey
from kvtier.core.landing import LandingPool
from kvtier.core.mover_state import MoverState, miss_reason
from kvtier.core.sinks import CountersState, Miss, RecordState
from kvtier.core.stats import StoreStats, TierStats
from kvtier.core.tenant import TenantId
from kvtier.core.tiers import registry
from kvtier.core.tiers.base import GetResult
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.wrappers import MissWhy, TierWrapper


class Mover(MoverState):
    """Runs the index's plans (see the module docstring).  Args: ``index``, ``io_threads``, ``queue_depth``
    and ``landing`` as :class:`~kvtier.core.mover_state.MoverState`'s; ``sink``: the store's metrics sink
    (its counters are the writes'); ``chunk_tokens``: tokens per chunk (for :meth:`stats`)."""

    def __init__(self, index: Index, io_threads: int, queue_depth: int, sink: CountersSink, chunk_tokens: int,
                 landing: LandingPool | None = None) -> None:
        super().__init__(index, io_threads, queue_depth, sink.counters, landing)
        self.sink = sink
        self.counters: StoreCounters = sink.counters
        self.chunk_tokens = chunk_tokens

    # ---- a load: TieredStore's prepare_load, complete_load, cancel_load (bound: the worker calls them) ----
    def prepare_load(self, chain: Sequence[ChunkKey], max_chunks: int | None = None, read_ahead: bool = False,
                     top_only: bool = False, ctx: OpContext | None = None, into: Into | None = None,
                     shared_within_s: float | None = None) -> LoadHandle:
        """Pin and return the longest available prefix of ``chain``, at most ``max_chunks`` (the contract:
        :mod:`kvtier.core.store`).  With ``read_ahead``, only the first ``io_threads`` chunks found below the
        cpu tier are read before returning; the rest are read into cpu pages in the background, ``io_threads``
        at a time, while the caller copies the ready ones out (``handle.ready_chunks()`` grows as they
        arrive; ``handle.wait(timeout_s)`` for the end).

        With ``top_only``, the prefix ends at the first chunk the top (cpu) tier does not hold: no file,
        socket or network I/O, every buffer ready when this returns (the connector's synchronous loads, on the
        engine's own thread); with ``shared_within_s`` too, it goes on in the shared tier (no local lower tier),
        read and verified before this returns under that deadline (a synchronous node-tier hit).  Top-tier
        pages are handed out pinned, not re-hashed.  ``ctx``: the request's context (:mod:`kvtier.core.context`;
        ``None``: none), kept in the handle: the reads' events (``ChunksRead``, ``ChunkMissed``, ``LoadCut``)
        and :meth:`complete_load`'s go to it.  ``into``: where the shared tier reads a chunk instead of a cpu
        page (:data:`~kvtier.core.handles.Into`)."""
        limit = len(chain) if max_chunks is None else min(max_chunks, len(chain))
        plan = self.index.plan_load(chain, limit, top_only)
        plan.handle.ctx, plan.into = self.sink.bind(ctx), into
        start = len(plan.handle.keys)  # (num_chunks, without the property's call: the hit path)
        if start < limit and self.index.shared and (not top_only or shared_within_s is not None):
            want = list(chain[start:limit])
            if max_chunks is None:  # nobody asked yet: one presence batch, so misses cost no bytes
                want = want[:self.leading_present(self.index.shared[0].name, want)]
            self.index.plan_shared(plan, start, want)
        if (n := len(plan.handle.keys)) < limit:  # no tier this load may read holds the next chunk: why not
            with self.index.lock:
                ghost = self.index.ghosts.latest(chain[n], (self.top_name,) if top_only else None)
            plan.handle.cut = LoadCut(n, ghost.tier if ghost is not None else self.top_name if top_only else "",
                                      ghost.reason if ghost is not None else "new", limit - n)  # (LoadHandle.cut)
            plan.handle.ctx.sink.emit(plan.handle.cut)
        if plan.writes:  # spills of the cpu pages the reads take
            self.submit(plan.writes)
        if plan.reads:
            self.run(chain, plan, read_ahead, shared_within_s)
        return plan.handle

    def complete_load(self, handle: LoadHandle, success: bool, first_chunk: int = 0,
                      engine: EngineLoad | None = None) -> None:
        """Unpin ``handle``'s chunks (from :meth:`prepare_load`); count hits only if ``success`` (the chunks
        reached their destination).  Idempotent.  ``first_chunk``: chunks before it were pinned, not delivered
        (the engine's prefix cache held them): no hits.  ``engine``: what the load did in the engine (tokens by
        planned tier, blocks not filled, bytes and seconds), counted here, once."""
        # (handle.ready_chunks(), read here: every chunk unless reads ahead still run)
        delivered = len(handle.keys) if (ahead := handle.pending) is None or ahead.done() else handle.ahead_from
        if not self.index.release(handle, refresh=success):
            return
        if handle.landed:  # (only then: the hit path with a page stays off the landing pool, scripts/hit_story.py)
            self.give_landed(handle)
        sink = handle.ctx.sink
        if engine is not None:
            sink.emit(engine)
        served = handle.tiers[first_chunk:delivered]  # chunks per tier, counted in C (no Counter frames: the hit path)
        sink.emit(ChunksServed(dict(zip(tiers := dict.fromkeys(served), map(served.count, tiers))))
                  if success else LoadFailed())
        if success and (below := handle.below) is not None and first_chunk <= below[0] < delivered:
            sink.emit(ServedBelow(*below))  # why the top tier did not hold it

    # ---- reads ---------------------------------------------------------------------------
    def run(self, chain: Sequence[ChunkKey], plan: LoadPlan, read_ahead: bool, within_s: float | None = None) -> None:
        """Run ``plan.reads`` now, or with ``read_ahead`` only the first ``io_threads`` of them and
        the rest in the background; all now if every one reads into the caller's destination
        (``Read.into``: the read is the copy, nothing to overlap it with; one batch, no thread hop).
        ``within_s``: the shared tier's reads under this deadline (:meth:`read`)."""
        reads = plan.reads
        if not all(map(attrgetter("reserved"), reads)):  # a read with no cpu page (or into a shared read's): in C
            self._land(plan)
        ahead = reads[self.io_threads:] if read_ahead and any(r.into is None for r in reads) else []
        self.read(chain, plan.handle, reads[:len(reads) - len(ahead)], within_s)
        if not ahead:
            return
        if not self.index.start_read_ahead(plan.handle, ahead[0].pos):
            self.index.give_back(ahead)  # the prefix already ended before them
            return
        try:
            plan.handle.pending = self._ahead.submit(self._read_ahead, chain, plan.handle, ahead)
        except RuntimeError:  # closed: read here
            self._read_ahead(chain, plan.handle, ahead)

    def read(self, chain: Sequence[ChunkKey], handle: LoadHandle, batch: Sequence[Read],
             within_s: float | None = None) -> None:
        """Read ``batch`` (one read per tier, in tier order) and report to the index; a guarded tier's
        reads under ``within_s`` when given (a synchronous load, on the engine's thread).  The load's
        context (``handle.ctx``) hears a :class:`~kvtier.core.context.ChunksRead` per tier read, a
        ``ChunkMissed`` per chunk that did not arrive and a ``LoadCut`` where the prefix now ends
        (the tiers' per-chunk results and a wrapper's reasons, translated by :func:`_reason`)."""
        sink = handle.ctx.sink
        results: list[GetResult] = []
        records: tenant.TenantRecords = {}  # verified values and chunk files name their writer
        why: MissWhy = {}  # a wrapper's reason for each miss it caused (deadline, breaker open, ...)
        for name in dict.fromkeys(r.tier for r in batch):
            jobs = [r for r in batch if r.tier == name]
            t0 = time.perf_counter()
            tier, keys = self.tiers[name], [r.key for r in jobs]
            dsts: list[Any] = [memoryview(r.buffer.data) if r.into is None else r.into for r in jobs]
            # (wrappers.get_explained, inlined: a bare tier is not asked for reasons)
            if within_s is not None and isinstance(tier, GuardedTier):
                got = tier.get_many(keys, dsts, records, why=why, within_s=within_s)
            else:
                got = tier.get_many(keys, dsts, records, why=why) if isinstance(tier, TierWrapper) else \
                    tier.get_many(keys, dsts, records)
            seconds = time.perf_counter() - t0
            results.extend(got)
            hits = sum(1 for r in got if r is GetResult.HIT)
            sink.emit(ChunksRead(name, hits, hits * self.chunk_bytes, seconds))
        planned = len(handle.keys)  # num_chunks: only complete_reads changes it, and one batch of a load runs at a time
        gone = {r.key for r, res in zip(batch, results)  # local files removed from outside (purge, another engine)
                if res is GetResult.MISS and not r.shared and r.key not in why and not self.tiers[r.tier].indexed(r.key)}
        epoch = self.index.complete_reads(chain, handle, batch, results, records)
        missed = [ChunkMissed(r.pos, r.tier, miss_reason(r, res, r.epoch != epoch, why, gone))
                  for r, res in zip(batch, results) if res is not GetResult.HIT or r.epoch != epoch]
        for m in missed:
            sink.emit(m)
        first = min(missed, key=lambda m: m.index, default=None)
        if first is not None and first.index < planned:  # not cut before (by an earlier batch of this load)
            sink.emit(LoadCut(first.index, first.tier, first.reason, planned - first.index))

    def _read_ahead(self, chain: Sequence[ChunkKey], handle: LoadHandle, ahead: list[Read]) -> None:
        """Read ``ahead`` in batches of ``io_threads`` chunks, advancing ``handle.ahead_from`` after
        each; a shared tier's chunks stay in one batch (one pipelined round trip)."""
        try:
            i = 0
            while i < len(ahead):
                if ahead[i].shared:
                    end = next((j for j in range(i, len(ahead)) if not ahead[j].shared), len(ahead))
                else:
                    end = min(i + self.io_threads, len(ahead))
                batch, i = ahead[i:end], end
                if len(handle.keys) > batch[0].pos:  # the prefix (num_chunks) still reaches this batch
                    self.read(chain, handle, batch)
                else:  # the prefix ended in an earlier batch (a chunk failed): give this one's pins and pages back
                    self.index.give_back(batch)
                # chunks before the batch's end are in place (only complete_reads, on this thread, cuts handle.keys)
                handle.ahead_from = min(batch[-1].pos + 1, len(handle.keys))
        finally:
            self.index.end_read_ahead(handle)

    # ---- each step: TieredStore's stats and take_ghost_distances (bound: the worker calls them) ----
    def stats(self) -> StoreStats:
        """The store's counters and each tier's usage, as one snapshot (:meth:`StoreCounters.snapshot`)."""
        return self.counters.snapshot(self.chunk_bytes, self.chunk_tokens, self.index.tier_stats(),
                                      self.index.dirty_bytes(), sum(q.unfinished_tasks for q in self.queues.values()))

    def take_ghost_distances(self) -> list[tuple[str, int]]:
        """Ghost hits' ``(tier, distance bytes)`` since the last call (:mod:`kvtier.core.ghosts`; at
        most :data:`~kvtier.core.ghosts.PENDING_DISTANCES` of them), for the engine's metrics."""
        if not self.index.ghosts.distances:  # (a worker asks every step; most steps have none: no lock, no call)
            return []
        with self.index.lock:
            return self.index.ghosts.take_distances()


# ---- where a load's events are counted (their state, and the events off a load's path: kvtier.core.sinks) ----
_derived: tuple[int, tuple[str, ...], frozenset[str], tuple[str, ...]] = (-1, (), frozenset(), ())
"""(registry generation, directions, as a set, tier names): rederived only when a tier was registered."""


def _registered() -> tuple[int, tuple[str, ...], frozenset[str], tuple[str, ...]]:
    global _derived
    if _derived[0] != (generation := registry.generation):
        top = registry.top_tier()
        out = (f"engine_to_{top}", f"{top}_to_engine", *(f"{a}_to_{b}" for t in registry.lower_tiers()
                                                          for a, b in ((top, t), (t, top))))
        _derived = (generation, out, frozenset(out), tuple(registry.available_tiers()))
    return _derived


def directions() -> tuple[str, ...]:
    """Transfer directions of the registered tiers: ``engine_to_<top>``, ``<top>_to_engine``, then
    ``<top>_to_<tier>`` and ``<tier>_to_<top>`` for each lower tier (``cpu_to_disk``)."""
    return _registered()[1]


def add_counts(counts: dict[str, int], by: Mapping[str, int]) -> None:
    """``counts[k] += by[k]`` for every key of ``by`` (0 included), as ``Counter.update`` does, without its frames."""
    get = counts.get
    for key, n in by.items():
        counts[key] = get(key, 0) + n


class StoreCounters(CountersState):
    """The store's event counters (thread-safe; every method adds to a running total): the state and
    the events off a load's path are :class:`~kvtier.core.sinks.CountersState`'s.  The store and its
    tiers call these methods; :meth:`Mover.stats` reads them into a :class:`StoreStats`."""

    def loaded(self, by_tier: Mapping[str, int]) -> None:
        """A successful load delivered ``by_tier[tier]`` chunks from each tier."""
        with self._lock:  # (add_counts, inlined: no frame on the hit path)
            for tier, n in by_tier.items():
                self.load_hit_chunks[tier] = self.load_hit_chunks.get(tier, 0) + n

    def engine_load(self, load: EngineLoad, top: str) -> None:
        """One load's engine-side outcome (:class:`~kvtier.core.handles.EngineLoad`); ``top``: the
        top tier's name (the transfer direction is ``<top>_to_engine``)."""
        direction = f"{top}_to_engine"  # its transfer, counted as moved() does (_registered: only after a registration)
        known = load.engine_bytes and direction in (_derived if _derived[0] == registry.generation else _registered())[2]
        with self._lock:
            if load.resumed:
                self.reloaded_tokens += sum(load.tokens.values())
            else:  # (add_counts, inlined)
                counts = self.loaded_tokens
                for tier, n in load.tokens.items():
                    counts[tier] = counts.get(tier, 0) + n
                if load.unfilled_tokens:  # (a whole load promised nothing it did not fill: no call)
                    add_counts(self.unfilled_tokens, load.unfilled_tokens)
            self.load_failed_blocks += load.failed_blocks
            self.rerouted_chunks += load.rerouted_chunks
            if known:
                self.transfer_bytes[direction] += load.engine_bytes
                self.transfer_seconds[direction] = self.transfer_seconds.get(direction, 0.0) + max(load.seconds, 0.0)
        if load.engine_bytes and not known:
            self.moved(direction, load.engine_bytes, load.seconds)  # raises: a tier nobody registered

    def moved(self, direction: str, num_bytes: int, seconds: float) -> None:
        """One transfer of ``num_bytes`` bytes taking ``seconds`` seconds in ``direction``.

        Raises:
            ValueError: ``direction`` is not one of :func:`directions` (a tier nobody registered).
        """
        _, known, known_set, _ = _registered()
        if direction not in known_set:
            raise ValueError(f"unknown transfer direction {direction!r}; use one of {', '.join(known)}")
        with self._lock:  # (engine_load() counts its transfer so too, within its own hold of the lock)
            self.transfer_bytes[direction] += num_bytes
            self.transfer_seconds[direction] = self.transfer_seconds.get(direction, 0.0) + max(seconds, 0.0)

    def evicted(self, tier: str, num_chunks: int = 1) -> None:
        with self._lock:
            self.evictions[tier] += num_chunks

    def snapshot(self, chunk_bytes: int, chunk_tokens: int, tiers: Mapping[str, TierStats],
                 dirty_bytes: int, queued_writes: int) -> StoreStats:
        """The counters with the given usage, as one :class:`StoreStats` (``tiers``: each tier's usage,
        corrupt and pinned chunks; the hit and eviction counts are filled in here)."""
        _, known, _, registered = _registered()
        names = tuple(dict.fromkeys((*known, *self.transfer_bytes)))
        with self._lock:
            merged = {name: TierStats(t.used_bytes, t.capacity_bytes, t.num_chunks, self.lookup_hit_chunks[name],
                                      self.load_hit_chunks[name], self.evictions[name], t.corrupt_chunks,
                                      t.pinned_chunks, t.wire, t.write_errors, self.reset_chunks[name],
                                      t.ttl_pinned_chunks, t.tenant_used_bytes, t.quota_evictions, t.codec)
                      for name, t in tiers.items()}
            return StoreStats(chunk_bytes, chunk_tokens, merged, self.lookup_chunks, self.failed_loads,
                              self.dropped_saves, self.saved_chunks, self.flush_missed_chunks,
                              self.shared_lookups_skipped, {d: self.transfer_bytes[d] for d in names},
                              {d: self.transfer_seconds.get(d, 0.0) for d in names}, dirty_bytes, queued_writes,
                              {t: self.loaded_tokens[t] for t in dict.fromkeys((*registered, *self.loaded_tokens))},
                              self.reloaded_tokens, self.saved_tokens, self.load_failed_blocks,
                              {t: self.unfilled_tokens[t] for t in dict.fromkeys((*registered, *self.unfilled_tokens))},
                              self.rerouted_chunks, self.ttl_pin_chunks, self.ttl_pin_refused_chunks)


class CountersSink:
    """The store's ``counters`` (the only place these events are counted) as a sink; ``top``: the top tier's
    name (transfer directions ``<tier>_to_<top>``, ``<top>_to_engine``, ``engine_to_<top>``: :func:`directions`)."""

    def __init__(self, counters: StoreCounters, top: str) -> None:
        self.counters = counters
        self.top = top
        self.own = OpContext(sink=self)  # operations outside a request

    def bind(self, ctx: OpContext | None, tenant: TenantId | None = None) -> OpContext:
        """``ctx`` with its sink fanned out to these counters too (first, then the request's own);
        ``None``: a context of the store's own (:attr:`own`).  A context bound already (a handle's,
        passed back) is returned as it is, so no event is counted twice.  ``tenant``: shorthand
        for a context of that tenant alone (``TieredStore.prepare_store``'s).

        Raises:
            ValueError: both ``ctx`` and ``tenant`` given.
        """
        if tenant is not None:
            if ctx is not None:
                raise ValueError("pass the tenant in the context (ctx.tenant) or as tenant=, not both")
            ctx = OpContext(tenant=tenant)
        if ctx is None:
            return self.own
        if ctx.sink is self or (isinstance(ctx.sink, Tee) and ctx.sink.sinks[0] is self):
            return ctx
        return OpContext(ctx.request_id, ctx.tenant, self if ctx.sink is NO_SINK else Tee(self, ctx.sink))

    def emit(self, event: Event) -> None:
        c = self.counters
        match event:  # (a hit's events first: each case is an isinstance check)
            case EngineLoad():
                c.engine_load(event, self.top)
            case ChunksServed():
                c.loaded(event.by_tier)
            case ChunksRead():
                c.moved(f"{event.tier}_to_{self.top}", event.bytes, event.seconds)
            case ServedBelow():  # the ghost lists count their hits (kvtier.core.ghosts)
                pass
            case _:
                c.count(event, self.top)


class Tee:
    """Every event to each of ``sinks``, in order."""

    def __init__(self, *sinks: Sink) -> None:
        self.sinks = sinks

    def emit(self, event: Event) -> None:
        for sink in self.sinks:
            sink.emit(event)


class RequestRecord(RecordState):
    """One request's events, summed (thread-safe: a read-ahead thread reports too): ``RequestRecord(chunk_tokens)``;
    its attributes and the events off a load's path are :class:`~kvtier.core.sinks.RecordState`'s."""

    def emit(self, event: Event) -> None:
        with self._lock:
            match event:  # (a hit's events first: each case is an isinstance check)
                case EngineLoad():
                    counts = self.loaded_tokens  # (add_counts, inlined: no frame on the hit path)
                    for tier, n in event.tokens.items():
                        counts[tier] = counts.get(tier, 0) + n
                    if event.unfilled_tokens:  # (a whole load promised nothing it did not fill: no call)
                        add_counts(self.unfilled_tokens, event.unfilled_tokens)
                    self.load_seconds += event.seconds
                case ChunksServed():
                    counts = self.served_chunks
                    for tier, n in event.by_tier.items():
                        counts[tier] = counts.get(tier, 0) + n
                case ChunksRead():
                    self.read_chunks[event.tier] = self.read_chunks.get(event.tier, 0) + event.chunks
                    self.read_bytes[event.tier] = self.read_bytes.get(event.tier, 0) + event.bytes
                    self.read_seconds[event.tier] = self.read_seconds.get(event.tier, 0.0) + event.seconds
                case ServedBelow():
                    if self.below is None or event.index < self.below.index:
                        self.below = Miss(event.index, event.tier, event.reason)
                case _:
                    self.note(event)
