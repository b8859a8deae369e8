"""Where the events of :mod:`kvtier.core.context` are counted: the store's counters, one request's
record, and a fan-out to several (all on a load's path: a hit's events and the step's snapshot run here).

- :class:`StoreCounters`: the store's event counters, the only place they are counted; the store's
  snapshot (:meth:`StoreCounters.snapshot`) reads them into a :class:`~kvtier.core.stats.StoreStats`;
  transfer directions are :func:`directions`.
- :class:`CountersSink`: the store's metrics sink; each event becomes the
  :class:`StoreCounters` call that counts it, so ``/metrics``
  (:mod:`kvtier.core.metrics`) and the connector's step stats (:mod:`kvtier.integrations.vllm.stats`)
  read the same numbers as before events existed.
- :class:`RequestRecord`: what one request's operations did: chunks and tokens per tier, read
  bytes and seconds per tier, and the first chunk it was not served with the reason (issue 35's
  per-request receipt is built from it).
- :class:`Tee`: every event to each of its sinks, in order (the store sends a request's events to
  its counters and to the request's own sink this way).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.core.context import (
    NO_SINK,
    ChunkMissed,
    ChunksRead,
    ChunksServed,
    EngineLoad,
    EngineSave,
    Event,
    LoadCut,
    LoadFailed,
    LookedUp,
    MissReason,
    NotHeld,
    OpContext,
    Saved,
    SaveDropped,
    ServedBelow,
    Sink,
    TtlPinned,
    WriteDropped,
)
from kvtier.core.stats import StoreStats, TierStats
from kvtier.core.tenant import TenantId
from kvtier.core.tiers import registry

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
    """Transfer directions, from the registered tiers: ``engine_to_<top>``, ``<top>_to_engine``,
    then ``<top>_to_<tier>`` and ``<tier>_to_<top>`` for each lower tier (e.g. ``cpu_to_disk``)."""
    return _registered()[1]


def add_counts(counts: dict[str, int], by: Mapping[str, int]) -> None:
    """``counts[k] += by[k]`` for every key of ``by`` (a key counted 0 included), as ``Counter.update``
    of a mapping does, without its ABC check and Python frames: the hit path's counts."""
    get = counts.get
    for key, n in by.items():
        counts[key] = get(key, 0) + n


class StoreCounters:
    """The store's event counters (thread-safe; every method adds to a running total).

    The store and its tiers call these methods; :meth:`kvtier.core.store.TieredStore.stats` reads
    them into a :class:`StoreStats`.  No other place counts these events.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lookup_chunks = 0
        self.lookup_hit_chunks: Counter[str] = Counter()
        self.load_hit_chunks: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        self.failed_loads = 0
        self.dropped_saves = 0
        self.saved_chunks = 0
        self.flush_missed_chunks = 0
        self.shared_lookups_skipped = 0
        self.transfer_bytes: Counter[str] = Counter()
        self.transfer_seconds: dict[str, float] = {}
        self.loaded_tokens: Counter[str] = Counter()
        self.reloaded_tokens = 0
        self.saved_tokens = 0
        self.load_failed_blocks = 0
        self.reset_chunks: Counter[str] = Counter()
        self.unfilled_tokens: Counter[str] = Counter()
        self.rerouted_chunks = 0
        self.ttl_pin_chunks = 0
        self.ttl_pin_refused_chunks = 0

    def ttl_pinned(self, pinned: int, refused: int) -> None:
        """Requests' TTL pins: ``pinned`` chunks pinned (or renewed), ``refused`` past the budget."""
        with self._lock:
            self.ttl_pin_chunks += pinned
            self.ttl_pin_refused_chunks += refused

    def looked_up(self, num_chunks: int, found: Mapping[str, int]) -> None:
        """A lookup of ``num_chunks`` chunks found ``found[tier]`` chunks in each tier."""
        with self._lock:
            self.lookup_chunks += num_chunks
            self.lookup_hit_chunks.update(found)

    def loaded(self, by_tier: Mapping[str, int]) -> None:
        """A successful load delivered ``by_tier[tier]`` chunks from each tier."""
        with self._lock:
            add_counts(self.load_hit_chunks, by_tier)

    def load_failed(self) -> None:
        with self._lock:
            self.failed_loads += 1

    def evicted(self, tier: str, num_chunks: int = 1) -> None:
        with self._lock:
            self.evictions[tier] += num_chunks

    def dropped(self, num_chunks: int = 1) -> None:
        """``num_chunks`` chunk saves were dropped."""
        with self._lock:
            self.dropped_saves += num_chunks

    def saved(self, num_chunks: int) -> None:
        with self._lock:
            self.saved_chunks += num_chunks

    def flush_missed(self, num_chunks: int) -> None:
        with self._lock:
            self.flush_missed_chunks += num_chunks

    def engine_load(self, load: EngineLoad, top: str) -> None:
        """One load's engine-side outcome (:class:`~kvtier.core.handles.EngineLoad`); ``top``: the
        top tier's name (the transfer direction is ``<top>_to_engine``)."""
        direction = f"{top}_to_engine"  # its transfer, counted as moved() does under the same hold of the lock
        known = load.engine_bytes and direction in _registered()[2]
        with self._lock:
            if load.resumed:
                self.reloaded_tokens += sum(load.tokens.values())
            else:
                add_counts(self.loaded_tokens, load.tokens)
                if load.unfilled_tokens:  # (a whole load promised nothing it did not fill: no call)
                    add_counts(self.unfilled_tokens, load.unfilled_tokens)
            self.load_failed_blocks += load.failed_blocks
            self.rerouted_chunks += load.rerouted_chunks
            if known:
                self._add_transfer(direction, load.engine_bytes, load.seconds)
        if load.engine_bytes and not known:
            self.moved(direction, load.engine_bytes, load.seconds)  # raises: a tier nobody registered

    def engine_save(self, save: EngineSave, top: str) -> None:
        """One save's engine-side outcome (:class:`~kvtier.core.handles.EngineSave`)."""
        with self._lock:
            self.saved_tokens += save.tokens
        self.moved(f"engine_to_{top}", save.engine_bytes, save.seconds)

    def reset_removed(self, tier: str, num_chunks: int) -> None:
        """A reset removed ``num_chunks`` chunks from ``tier``."""
        with self._lock:
            self.reset_chunks[tier] += num_chunks

    def moved(self, direction: str, num_bytes: int, seconds: float) -> None:
        """One transfer of ``num_bytes`` bytes taking ``seconds`` seconds in ``direction``.

        Raises:
            ValueError: ``direction`` is not one of :func:`directions` (a tier nobody registered).
        """
        _, known, known_set, _ = _registered()
        if direction not in known_set:
            raise ValueError(f"unknown transfer direction {direction!r}; use one of {', '.join(known)}")
        with self._lock:
            self._add_transfer(direction, num_bytes, seconds)

    def _add_transfer(self, direction: str, num_bytes: int, seconds: float) -> None:
        # under self._lock: moved()'s count, also made by engine_load() within its own hold of the lock
        self.transfer_bytes[direction] += num_bytes
        self.transfer_seconds[direction] = self.transfer_seconds.get(direction, 0.0) + max(seconds, 0.0)

    def snapshot(self, chunk_bytes: int, chunk_tokens: int, tiers: Mapping[str, TierStats],
                 dirty_bytes: int, queued_writes: int) -> StoreStats:
        """The counters with the given usage, as one :class:`StoreStats`.

        ``tiers`` carries each tier's usage, corrupt and pinned chunks; the hit and eviction counts
        are filled in here."""
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
    """The store's counters as a sink.

    Args:
        counters: the store's counters (the only place these events are counted).
        top: the top tier's name (transfer directions ``<tier>_to_<top>``, ``<top>_to_engine``,
            ``engine_to_<top>``: :func:`directions`).
    """

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
        match event:  # (a hit's two events first: each case is an isinstance check)
            case EngineLoad():
                c.engine_load(event, self.top)
            case ChunksServed():
                c.loaded(event.by_tier)
            case ChunksRead():
                c.moved(f"{event.tier}_to_{self.top}", event.bytes, event.seconds)
            case LoadFailed():
                c.load_failed()
            case EngineSave():
                c.engine_save(event, self.top)
            case Saved():
                c.saved(event.chunks)
            case SaveDropped():
                c.dropped(event.chunks)
            case LookedUp():
                c.looked_up(event.chunks, event.found)
            case TtlPinned():
                c.ttl_pinned(event.pinned, event.refused)
            case _:  # ChunkMissed, LoadCut, WriteDropped: counted by their tier (corrupt, its write queue);
                # NotHeld, ServedBelow: the ghost lists count their hits (kvtier.core.ghosts)
                pass


class Tee:
    """Every event to each of ``sinks``, in order."""

    def __init__(self, *sinks: Sink) -> None:
        self.sinks = sinks

    def emit(self, event: Event) -> None:
        for sink in self.sinks:
            sink.emit(event)


@dataclass(frozen=True)
class Miss:
    """The first chunk a request was not served: its ``index`` in the chain, the ``tier`` it was
    planned from (``""``: no tier held it) and the ``reason`` (:data:`kvtier.core.context.MissReason`)."""

    index: int
    tier: str
    reason: MissReason


class RequestRecord:
    """One request's events, summed (thread-safe: a read-ahead thread reports too).

    Args:
        chunk_tokens: tokens per chunk (for :meth:`served_tokens`).

    Attributes (read them once the request's operations are complete):
        served_chunks: chunks successful loads delivered, by the tier their bytes came from.
        read_chunks / read_bytes / read_seconds: chunks read and verified from each lower tier into
            the top tier, their payload bytes, and the seconds the reads took, by tier.
        loaded_tokens / unfilled_tokens: tokens the engine got / was promised and did not get,
            by the tier its plan named (as the engine integration reported them: :class:`EngineLoad`).
        load_seconds: time the engine's loads took, from prepare to the last copy.
        failed_loads: loads completed as failed.
        miss: the first chunk not served (lowest index over every load), ``None`` if none was cut.
        below: the first chunk a load read from below the top tier, and why the top tier lacked it
            (:class:`~kvtier.core.context.ServedBelow`), ``None`` if none.
        explained: why a save found the chunk it was asked to explain in no tier
            (:class:`~kvtier.core.context.NotHeld`), ``None`` if it was not asked or the chunk was held.
        saved_chunks / dropped_chunks: chunks its saves published / dropped.
        unwritten_chunks: chunks its saves published that were not queued for a tier below, by tier.
        saved_tokens: tokens of the chunks its saves copied out of the engine.
        ttl_pinned / ttl_refused: chunks its TTL pins kept / were refused.
    """

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self._lock = threading.Lock()
        self.served_chunks: dict[str, int] = {}
        self.read_chunks: dict[str, int] = {}
        self.read_bytes: dict[str, int] = {}
        self.read_seconds: dict[str, float] = {}
        self.loaded_tokens: dict[str, int] = {}
        self.unfilled_tokens: dict[str, int] = {}
        self.load_seconds = 0.0
        self.failed_loads = 0
        self.miss: Miss | None = None
        self.below: Miss | None = None
        self.explained: Miss | None = None
        self.saved_chunks = 0
        self.dropped_chunks = 0
        self.unwritten_chunks: dict[str, int] = {}
        self.saved_tokens = 0
        self.ttl_pinned = 0
        self.ttl_refused = 0

    def served_tokens(self) -> dict[str, int]:
        """Tokens of the chunks served, by tier (whole chunks: ``served_chunks`` × ``chunk_tokens``)."""
        with self._lock:
            return {tier: n * self.chunk_tokens for tier, n in self.served_chunks.items()}

    def emit(self, event: Event) -> None:
        with self._lock:
            match event:  # (a hit's two events first: each case is an isinstance check)
                case EngineLoad():
                    for tier, n in event.tokens.items():
                        self.loaded_tokens[tier] = self.loaded_tokens.get(tier, 0) + n
                    for tier, n in event.unfilled_tokens.items():
                        self.unfilled_tokens[tier] = self.unfilled_tokens.get(tier, 0) + n
                    self.load_seconds += event.seconds
                case ChunksServed():
                    for tier, n in event.by_tier.items():  # (as Counter.update, without its frames: the hit path)
                        self.served_chunks[tier] = self.served_chunks.get(tier, 0) + n
                case ChunksRead():
                    self.read_chunks[event.tier] = self.read_chunks.get(event.tier, 0) + event.chunks
                    self.read_bytes[event.tier] = self.read_bytes.get(event.tier, 0) + event.bytes
                    self.read_seconds[event.tier] = self.read_seconds.get(event.tier, 0.0) + event.seconds
                case ChunkMissed() | LoadCut():
                    if self.miss is None or event.index < self.miss.index:
                        self.miss = Miss(event.index, event.tier, event.reason)
                case LoadFailed():
                    self.failed_loads += 1
                case EngineSave():
                    self.saved_tokens += event.tokens
                case Saved():
                    self.saved_chunks += event.chunks
                case SaveDropped():
                    self.dropped_chunks += event.chunks
                case WriteDropped():
                    self.unwritten_chunks[event.tier] = self.unwritten_chunks.get(event.tier, 0) + event.chunks
                case TtlPinned():
                    self.ttl_pinned += event.pinned
                    self.ttl_refused += event.refused
                case ServedBelow():
                    if self.below is None or event.index < self.below.index:
                        self.below = Miss(event.index, event.tier, event.reason)
                case NotHeld():
                    self.explained = Miss(event.index, event.tier, event.reason)
                case _:  # LookedUp: the scheduler's plan, not what the request got
                    pass
