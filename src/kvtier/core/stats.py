"""The store's numbers in one place: events counted once, read as one typed snapshot.

:class:`~kvtier.core.mover.StoreCounters` (with the events' sinks, on the load's path) is where the
store and its tiers count events (lookups, hits, evictions, dropped saves, transfers);
:meth:`kvtier.core.store.TieredStore.stats` combines it with each tier's usage into a frozen
:class:`StoreStats`, defined here with the tiers' numbers.  Everything that shows a store number reads that
snapshot: the store's Prometheus collector (:mod:`kvtier.core.metrics`), the vLLM connector's
per-step stats (deltas of two snapshots, :mod:`kvtier.integrations.vllm.stats`), tests and tools.

A remote tier (redis) counts what it did on the wire in a :class:`WireCounters`; the store's
snapshot carries it as ``TierStats.wire`` (:class:`WireStats`), so its lookups, hits, bytes and
seconds per direction, errors, skipped calls and writes and breaker state are read from the same
snapshot as everything else.

Units: ``*_chunks`` count chunks, ``*_bytes`` bytes, ``*_seconds`` seconds; tokens are chunks
times ``chunk_tokens``.  Tier names are those of the registry (:mod:`kvtier.core.tiers.registry`);
transfer directions are :func:`kvtier.core.mover.directions`; a remote tier's calls are :data:`OPS` and
its wire directions :data:`WIRE_DIRECTIONS`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtier.core.codecstats import CodecNumbers

OPS = ("lookup", "get", "put", "delete")
WIRE_DIRECTIONS = ("read", "write")


@dataclass(frozen=True)
class WireStats:
    """What a remote tier did on the wire since it started (this rank's connection to the server).

    Attributes:
        lookup_keys / lookup_hit_keys: keys asked about by presence batches / found.
        bytes / seconds: payload bytes moved and seconds spent, by :data:`WIRE_DIRECTIONS`.
        errors: calls that failed (timeout, connection or server error), by :data:`OPS`.
        skipped_calls: calls not made (breaker open or the tier's queue full), by :data:`OPS`.
        skipped_writes: chunks not written (breaker open, queue full, or the write failed).
        corrupt_values: values that failed verification (each a miss, deleted).
        breaker_state: the circuit breaker now: 0 closed, 1 half-open, 2 open
            (:class:`kvtier.core.tiers.breaker.BreakerState`).
        breaker_opened: times the breaker opened.
        calls: calls (batches) that moved payload bytes, by :data:`WIRE_DIRECTIONS`: ``seconds``
            over ``calls`` is the mean time of one read (a load's batch of GETs) or write batch.
    """

    lookup_keys: int = 0
    lookup_hit_keys: int = 0
    bytes: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(WIRE_DIRECTIONS, 0))
    seconds: Mapping[str, float] = field(default_factory=lambda: dict.fromkeys(WIRE_DIRECTIONS, 0.0))
    errors: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    skipped_calls: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    skipped_writes: int = 0
    corrupt_values: int = 0
    breaker_state: int = 0
    breaker_opened: int = 0
    calls: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(WIRE_DIRECTIONS, 0))

    @property
    def total_errors(self) -> int:
        return sum(self.errors.values())

    @property
    def total_skipped_calls(self) -> int:
        return sum(self.skipped_calls.values())


class WireCounters:
    """A remote tier's wire counters (thread-safe; the only place they are counted)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lookup_keys = self.lookup_hit_keys = self.skipped_writes = self.corrupt_values = 0
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.seconds: dict[str, float] = {}
        self.errors: Counter[str] = Counter()
        self.skipped_calls: Counter[str] = Counter()

    def looked_up(self, num_keys: int, num_found: int) -> None:
        """A presence batch of ``num_keys`` keys found ``num_found`` (0 when the call failed)."""
        with self._lock:
            self.lookup_keys += num_keys
            self.lookup_hit_keys += num_found

    def moved(self, direction: str, num_bytes: int, seconds: float) -> None:
        """``num_bytes`` payload bytes moved in ``direction`` (:data:`WIRE_DIRECTIONS`) in ``seconds``."""
        with self._lock:
            self.bytes[direction] += num_bytes
            self.calls[direction] += 1
            self.seconds[direction] = self.seconds.get(direction, 0.0) + max(seconds, 0.0)

    def error(self, op: str) -> None:
        with self._lock:
            self.errors[op] += 1

    def skipped(self, op: str) -> None:
        with self._lock:
            self.skipped_calls[op] += 1

    def writes_skipped(self, num_chunks: int) -> None:
        with self._lock:
            self.skipped_writes += num_chunks

    def corrupt(self, n: int = 1) -> None:
        """``n`` values that failed verification."""
        with self._lock:
            self.corrupt_values += n

    def snapshot(self, breaker_state: int, breaker_opened: int) -> WireStats:
        """The counters with the breaker's state, as one :class:`WireStats`."""
        with self._lock:
            return WireStats(self.lookup_keys, self.lookup_hit_keys, {d: self.bytes[d] for d in WIRE_DIRECTIONS},
                             {d: self.seconds.get(d, 0.0) for d in WIRE_DIRECTIONS},
                             {op: self.errors[op] for op in OPS}, {op: self.skipped_calls[op] for op in OPS},
                             self.skipped_writes, self.corrupt_values, breaker_state, breaker_opened,
                             {d: self.calls[d] for d in WIRE_DIRECTIONS})


@dataclass(frozen=True)
class TierStats:
    """One tier's numbers at the time of a snapshot (counters since the store started).

    Attributes:
        used_bytes / capacity_bytes: bytes held and the tier's capacity (this rank).
        num_chunks: chunks held.
        lookup_hit_chunks: chunks found in this tier by lookups.
        load_hit_chunks: chunks from this tier delivered by successful loads.
        evictions: chunks evicted from this tier.
        corrupt_chunks: chunks that failed verification (each served as a miss).
        pinned_chunks: chunks held by loads or writes in flight (zero when idle).
        write_errors: chunk writes that failed in the tier's own storage (a full or read-only disk
            directory, an I/O error); each such chunk is not stored.  A remote tier's failed writes
            are in ``wire.skipped_writes``.
        wire: a remote tier's wire numbers (:class:`WireStats`); ``None`` for a local tier.
        reset_chunks: chunks removed from this tier by resets (:meth:`kvtier.core.store.TieredStore.clear`).
        ttl_pinned_chunks: chunks requests pinned with a TTL (:meth:`kvtier.core.store.TieredStore.ttl_pin`)
            whose deadline has not passed.
        tenant_used_bytes: with ``tenant_quotas``, bytes held per tenant label (at most ``top_tenants``
            by digest, then ``other`` and ``unknown``: :meth:`kvtier.core.quota.TenantLedger.usage_by_label`);
            empty without quotas.
        quota_evictions: evictions in which the tenant quotas chose another chunk than the eviction
            policy alone would have (:mod:`kvtier.core.quota`).
        codec: the tier's codec chain numbers (:mod:`kvtier.core.codecstats`); ``None``: no envelope.
    """

    used_bytes: int = 0
    capacity_bytes: int = 0
    num_chunks: int = 0
    lookup_hit_chunks: int = 0
    load_hit_chunks: int = 0
    evictions: int = 0
    corrupt_chunks: int = 0
    pinned_chunks: int = 0
    wire: WireStats | None = None
    write_errors: int = 0
    reset_chunks: int = 0
    ttl_pinned_chunks: int = 0
    tenant_used_bytes: Mapping[str, int] = field(default_factory=dict)
    quota_evictions: int = 0
    codec: CodecNumbers | None = None


@dataclass(frozen=True)
class StoreStats:
    """A store's numbers at one moment.

    Attributes:
        chunk_bytes / chunk_tokens: size of one chunk (bytes of this rank; tokens).
        tiers: the store's tiers by name, in tier order.
        lookup_chunks: chunks asked for by lookups.
        failed_loads: loads completed with ``success=False``.
        dropped_saves: chunk saves dropped (no room, or a write queue full, or a write failed).
        saved_chunks: chunks newly stored.
        flush_missed_chunks: dirty chunks a flush could not write in time.
        shared_lookups_skipped: shared-tier lookups not made because the queue was full.
        transfer_bytes / transfer_seconds: volume and time moved, by direction (:func:`kvtier.core.mover.directions`).
        dirty_bytes: bytes in DRAM not yet on the disk tier (what a crash would lose).
        queued_writes: writes queued or running in the lower tiers.
        loaded_tokens: tokens copied into the engine, labelled with the tier the engine's plan
            named for their chunk (for vLLM: the hit source it was told at admission; the tier
            the bytes were actually read from is ``TierStats.load_hit_chunks``, and a chunk read
            from another tier than planned is counted in ``rerouted_chunks``).
        unfilled_tokens: tokens the engine admitted as hits that no load filled (the request was
            aborted before its load started, a chunk was gone or failed verification, or its read
            missed ``load_wait_s``), by planned tier.  ``loaded_tokens + unfilled_tokens`` per tier
            is what the engine was promised (vLLM's ``prompt_tokens_cached_by_source``).
        rerouted_chunks: chunks a load read from another tier than the one planned (the planned
            tier evicted or promoted it in between); their tokens keep the planned label.
        reloaded_tokens: tokens copied into requests resumed after a preemption (apart from
            ``loaded_tokens``, as vLLM counts them apart from its external hits).
        saved_tokens: tokens of the chunks newly saved from the engine.
        load_failed_blocks: engine blocks a load could not fill (the engine recomputes them).
        ttl_pin_chunks / ttl_pin_refused_chunks: chunks requests pinned with a TTL, and pins refused
            because ``pin_max_share`` of the cpu tier was pinned already.
    """

    chunk_bytes: int
    chunk_tokens: int
    tiers: Mapping[str, TierStats]
    lookup_chunks: int = 0
    failed_loads: int = 0
    dropped_saves: int = 0
    saved_chunks: int = 0
    flush_missed_chunks: int = 0
    shared_lookups_skipped: int = 0
    transfer_bytes: Mapping[str, int] = field(default_factory=dict)
    transfer_seconds: Mapping[str, float] = field(default_factory=dict)
    dirty_bytes: int = 0
    queued_writes: int = 0
    loaded_tokens: Mapping[str, int] = field(default_factory=dict)
    reloaded_tokens: int = 0
    saved_tokens: int = 0
    load_failed_blocks: int = 0
    unfilled_tokens: Mapping[str, int] = field(default_factory=dict)
    rerouted_chunks: int = 0
    ttl_pin_chunks: int = 0
    ttl_pin_refused_chunks: int = 0

    def tier(self, name: str) -> TierStats:
        """The tier called ``name``; all zeros if the store has none."""
        return self.tiers.get(name, TierStats())

    @property
    def corrupt_chunks(self) -> int:
        """Chunks that failed verification, all tiers."""
        return sum(t.corrupt_chunks for t in self.tiers.values())

    @property
    def write_errors(self) -> int:
        """Chunk writes that failed in a tier's own storage, all tiers."""
        return sum(t.write_errors for t in self.tiers.values())

    @property
    def pinned_chunks(self) -> int:
        """Chunks pinned, all tiers."""
        return sum(t.pinned_chunks for t in self.tiers.values())
