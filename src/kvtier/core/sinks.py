"""Sinks for the events of :mod:`kvtier.core.context`: the store's counters, one request's
record, and a fan-out to several.

- :class:`CountersSink`: the store's metrics sink; each event becomes the
  :class:`~kvtier.core.stats.StoreCounters` call that counts it, so ``/metrics``
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
from kvtier.core.stats import StoreCounters
from kvtier.core.tenant import TenantId


class CountersSink:
    """The store's counters as a sink.

    Args:
        counters: the store's counters (the only place these events are counted).
        top: the top tier's name (transfer directions ``<tier>_to_<top>``, ``<top>_to_engine``,
            ``engine_to_<top>``: :func:`kvtier.core.stats.directions`).
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
        match event:
            case ChunksRead():
                c.moved(f"{event.tier}_to_{self.top}", event.bytes, event.seconds)
            case ChunksServed():
                c.loaded(event.by_tier)
            case LoadFailed():
                c.load_failed()
            case EngineLoad():
                c.engine_load(event, self.top)
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
            match event:
                case ChunksRead():
                    self.read_chunks[event.tier] = self.read_chunks.get(event.tier, 0) + event.chunks
                    self.read_bytes[event.tier] = self.read_bytes.get(event.tier, 0) + event.bytes
                    self.read_seconds[event.tier] = self.read_seconds.get(event.tier, 0.0) + event.seconds
                case ChunkMissed() | LoadCut():
                    if self.miss is None or event.index < self.miss.index:
                        self.miss = Miss(event.index, event.tier, event.reason)
                case ChunksServed():
                    for tier, n in event.by_tier.items():  # (as Counter.update, without its frames: the hit path)
                        self.served_chunks[tier] = self.served_chunks.get(tier, 0) + n
                case LoadFailed():
                    self.failed_loads += 1
                case EngineLoad():
                    for tier, n in event.tokens.items():
                        self.loaded_tokens[tier] = self.loaded_tokens.get(tier, 0) + n
                    for tier, n in event.unfilled_tokens.items():
                        self.unfilled_tokens[tier] = self.unfilled_tokens.get(tier, 0) + n
                    self.load_seconds += event.seconds
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
