"""The state of the sinks where the events of :mod:`kvtier.core.context` are counted, and the events a
hit does not send: the bases of the store's counters and of one request's record.  What a hit's events
run (the counters sink, the fan-out, the counting of a load's events, the step's snapshot) is
:mod:`kvtier.core.mover`'s, where the events are made.

- :class:`CountersState`: the store's event counters (the base of
  :class:`~kvtier.core.mover.StoreCounters`, the only place they are counted) and the events off a
  load's path (lookups, saves, drops, failed loads, TTL pins, resets): :meth:`CountersState.count`.
- :class:`RecordState`: what one request's operations did (the base of
  :class:`~kvtier.core.mover.RequestRecord`, issue 35's per-request receipt is built from it), made
  in C (a msgspec Struct: no Python frame per request), and the events off a load's path:
  :meth:`RecordState.note`.
- :class:`Miss`: the first chunk a request was not served, and why.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from kvtier.core.context import (
    ChunkMissed,
    EngineSave,
    Event,
    LoadCut,
    LoadFailed,
    LookedUp,
    MissReason,
    NotHeld,
    Saved,
    SaveDropped,
    TtlPinned,
    WriteDropped,
)


class CountersState(ABC):
    """The store's event counters (thread-safe; every method adds to a running total under
    ``_lock``).  :class:`~kvtier.core.mover.StoreCounters` counts a load's events and reads them
    into a :class:`~kvtier.core.stats.StoreStats`; no other place counts these events."""

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

    @abstractmethod
    def moved(self, direction: str, num_bytes: int, seconds: float) -> None:
        """One transfer in ``direction`` (:meth:`kvtier.core.mover.StoreCounters.moved`, which checks it)."""

    def count(self, event: Event, top: str) -> None:
        """Count one event off a load's path (the counters sink's others:
        :meth:`kvtier.core.mover.CountersSink.emit`); ``top``: the top tier's name."""
        match event:
            case EngineSave():
                self.engine_save(event, top)
            case LoadFailed():
                self.load_failed()
            case Saved():
                self.saved(event.chunks)
            case SaveDropped():
                self.dropped(event.chunks)
            case LookedUp():
                self.looked_up(event.chunks, event.found)
            case TtlPinned():
                self.ttl_pinned(event.pinned, event.refused)
            case _:  # ChunkMissed, LoadCut, WriteDropped: counted by their tier (corrupt, its write queue);
                # NotHeld, ServedBelow: the ghost lists count their hits (kvtier.core.ghosts)
                pass

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

    def load_failed(self) -> None:
        with self._lock:
            self.failed_loads += 1

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

    def engine_save(self, save: EngineSave, top: str) -> None:
        """One save's engine-side outcome (:class:`~kvtier.core.context.EngineSave`); ``top``: the top tier's name."""
        with self._lock:
            self.saved_tokens += save.tokens
        self.moved(f"engine_to_{top}", save.engine_bytes, save.seconds)

    def reset_removed(self, tier: str, num_chunks: int) -> None:
        """A reset removed ``num_chunks`` chunks from ``tier``."""
        with self._lock:
            self.reset_chunks[tier] += num_chunks


@dataclass(frozen=True)
class Miss:
    """The first chunk a request was not served: its ``index`` in the chain, the ``tier`` it was
    planned from (``""``: no tier held it) and the ``reason`` (:data:`kvtier.core.context.MissReason`)."""

    index: int
    tier: str
    reason: MissReason


class RecordState(msgspec.Struct, eq=False):
    """One request's events, summed (thread-safe: a read-ahead thread reports too); made as
    ``RequestRecord(chunk_tokens)`` (:class:`kvtier.core.mover.RequestRecord`).

    Attributes (read them once the request's operations are complete):
        chunk_tokens: tokens per chunk (for :meth:`served_tokens`).
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

    chunk_tokens: int
    _lock: threading.Lock = msgspec.field(default_factory=threading.Lock)
    served_chunks: dict[str, int] = msgspec.field(default_factory=dict)
    read_chunks: dict[str, int] = msgspec.field(default_factory=dict)
    read_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    read_seconds: dict[str, float] = msgspec.field(default_factory=dict)
    loaded_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    unfilled_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    load_seconds: float = 0.0
    failed_loads: int = 0
    miss: Miss | None = None
    below: Miss | None = None
    explained: Miss | None = None
    saved_chunks: int = 0
    dropped_chunks: int = 0
    unwritten_chunks: dict[str, int] = msgspec.field(default_factory=dict)
    saved_tokens: int = 0
    ttl_pinned: int = 0
    ttl_refused: int = 0

    def served_tokens(self) -> dict[str, int]:
        """Tokens of the chunks served, by tier (whole chunks: ``served_chunks`` × ``chunk_tokens``)."""
        with self._lock:
            return {tier: n * self.chunk_tokens for tier, n in self.served_chunks.items()}

    def note(self, event: Event) -> None:
        """Sum one event off a load's path, under ``_lock`` (the record's others:
        :meth:`kvtier.core.mover.RequestRecord.emit`)."""
        match event:
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
            case NotHeld():
                self.explained = Miss(event.index, event.tier, event.reason)
            case _:  # LookedUp: the scheduler's plan, not what the request got
                pass
