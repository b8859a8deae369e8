"""The context of one store operation, passed explicitly (issue 33 item 4): who asked, for whom,
and where the facts of the operation go.

An :class:`OpContext` travels as an argument from the engine integration (one per request: vLLM's
request id and the request's tenant) into the store's verbs (``lookup``, ``prepare_load`` /
``complete_load``, ``prepare_store`` / ``complete_store``, ``ttl_pin``) and from there to the
code that reads and promotes chunks, on whatever thread does it (a read-ahead thread included).
Nothing about a request travels in thread state.

What happened is reported as typed **events** to the context's :class:`Sink`, at the places the
facts are known: a batch of chunks read from a tier and verified (:class:`ChunksRead`), a chunk
that was not served and why (:class:`ChunkMissed`, then :class:`LoadCut` where the prefix ends),
what a load delivered (:class:`ChunksServed`) or that it failed (:class:`LoadFailed`), what the
engine got (:class:`EngineLoad`) or copied out (:class:`EngineSave`), chunks saved
(:class:`Saved`) or dropped (:class:`SaveDropped`, :class:`WriteDropped`), TTL pins (:class:`TtlPinned`), lookups
(:class:`LookedUp`), why a save found a chunk in no tier (:class:`NotHeld`) and why a load read a
chunk from below the top tier (:class:`ServedBelow`).  The store always sends them to its own metrics sink (the counters that
``/metrics`` and the connector's step stats show: :class:`kvtier.core.mover.CountersSink`) and
to the context's sink as well (:class:`kvtier.core.mover.Tee`); a per-request record
(:class:`kvtier.core.mover.RequestRecord`) is one such sink.

Units: ``*_bytes`` bytes, ``*seconds`` seconds, ``chunks`` chunk counts, ``index`` a chunk's
position in the chain the operation was given.  Tier names are the registry's
(:mod:`kvtier.core.tiers.registry`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol

import msgspec

from kvtier.core import receipt
from kvtier.core.tenant import TenantId

MissReason = receipt.MissReason
"""Why a chunk was not served (the receipt's reasons, :data:`kvtier.core.receipt.MissReason`).  What
the store itself reports:

- a load's chunk not held any more when the load was prepared (the scheduler planned it from a
  mirror a step old, or a synchronous load reads the top tier only): the latest loss its tiers'
  ghost lists remember (:mod:`kvtier.core.ghosts`: ``evicted``, ``purged``, ``reset``,
  ``corrupt``, ``not_admitted``, ``save_dropped``, ``quota``), else ``new``;
- a chunk whose read returned nothing: ``deadline`` or ``breaker_open`` (a shared tier's wrapper
  said so, :class:`kvtier.core.tiers.guarded.GuardedTier`), ``evicted`` (a shared tier no longer
  held it), ``purged`` (a local tier's file was removed from outside this engine: ``kvtier purge``,
  or another engine on the directory), ``load_failed`` (any other failed read);
- ``corrupt``: the value failed verification (counted by the tier, deleted, never served);
- ``reset``: a reset (:meth:`kvtier.core.store.TieredStore.clear`) came between its plan and its read;
- ``new``: a chunk a save found in no tier and no ghost list (:class:`NotHeld`).
"""

DropReason = Literal["no_room", "queue_full"]
"""Why a save, or its write to a tier below the top one, was dropped: ``no_room``, no top-tier
page could be freed (every page pinned, or the tenant's quota); ``queue_full``, the tier's write
queue was full (``save_queue_depth``)."""


class LookedUp(msgspec.Struct, frozen=True):
    """A lookup asked about ``chunks`` chunks and found ``found[tier]`` leading chunks in each tier."""

    chunks: int
    found: Mapping[str, int]


class ChunksRead(msgspec.Struct, frozen=True):
    """One batch read from a lower ``tier`` into top-tier pages: ``chunks`` arrived verified,
    ``bytes`` of payload, the batch took ``seconds`` (reads that missed included)."""

    tier: str
    chunks: int
    bytes: int
    seconds: float


class ChunkMissed(msgspec.Struct, frozen=True):
    """Chunk ``index`` of a load, planned from ``tier``, was not served, for ``reason``."""

    index: int
    tier: str
    reason: MissReason


class LoadCut(msgspec.Struct, frozen=True):
    """A load's prefix ends at chunk ``index`` (planned from ``tier``), for ``reason``: the first
    chunk not served; every later chunk of the load is dropped (a chunk is useful only after all
    its predecessors).  ``dropped_chunks``: chunks the load had planned from ``index`` on."""

    index: int
    tier: str
    reason: MissReason
    dropped_chunks: int = 0


class NotHeld(msgspec.Struct, frozen=True):
    """A save found chunk ``index`` (the position it was asked to explain) in no tier: ``reason``
    (about ``tier``) is why, from the ghost lists (``new``: none remembers it; :mod:`kvtier.core.ghosts`)."""

    index: int
    tier: str
    reason: MissReason


class ServedBelow(msgspec.Struct, frozen=True):
    """Chunk ``index`` of a load was read from the lower tier ``tier`` because the top tier did not
    hold it, for ``reason`` (the top tier's ghost: ``evicted``, ``reset``, …; ``new``: it never
    did, or forgot).  Only the first such chunk of a successful load is reported (by ``complete_load``)."""

    index: int
    tier: str
    reason: MissReason


class ChunksServed(msgspec.Struct, frozen=True):
    """A successful load delivered ``by_tier[tier]`` chunks from each tier (the tier the bytes were
    read from; chunks the engine's own prefix cache held are not counted)."""

    by_tier: Mapping[str, int]


class LoadFailed(msgspec.Struct, frozen=True):
    """A load was completed as failed (its bytes did not reach the engine): nothing is a hit."""


class EngineLoad(msgspec.Struct, frozen=True):
    """What one load did on the engine's side, as its caller (the engine integration) saw it.

    Attributes:
        tokens: tokens copied into the engine, by the tier the load's plan named for their chunk.
        unfilled_tokens: tokens the engine was promised and did not get, by planned tier.
        resumed: a request re-admitted after a preemption (its tokens count as reloaded; vLLM
            counts them apart from its hits).
        failed_blocks: engine blocks reported back to the engine as not filled.
        rerouted_chunks: chunks read from another tier than the one planned.
        engine_bytes: bytes copied into the engine (all layers of this rank).
        seconds: time the load took, from prepare to the last copy.
    """

    tokens: Mapping[str, int] = msgspec.field(default_factory=dict)
    unfilled_tokens: Mapping[str, int] = msgspec.field(default_factory=dict)
    resumed: bool = False
    failed_blocks: int = 0
    rerouted_chunks: int = 0
    engine_bytes: int = 0
    seconds: float = 0.0


class EngineSave(msgspec.Struct, frozen=True):
    """What one save copied out of the engine.

    Attributes:
        tokens: tokens the newly stored chunks cover.
        engine_bytes: bytes copied out of the engine (all layers of this rank).
        seconds: time the copy took.
    """

    tokens: int = 0
    engine_bytes: int = 0
    seconds: float = 0.0


class Saved(msgspec.Struct, frozen=True):
    """A save published ``chunks`` new chunks in the top tier."""

    chunks: int


class SaveDropped(msgspec.Struct, frozen=True):
    """A save dropped ``chunks`` chunks (from the first one that found no room to the chain's end), for ``reason``."""

    chunks: int
    reason: DropReason


class WriteDropped(msgspec.Struct, frozen=True):
    """A save's ``chunks`` published in the top tier were not queued for writing to ``tier``, for
    ``reason`` (they stay in the top tier; the tier's queue counts them in ``dropped_saves`` for
    every writer, so the store's counters do not count this event again)."""

    tier: str
    chunks: int
    reason: DropReason


class TtlPinned(msgspec.Struct, frozen=True):
    """A TTL pin kept ``pinned`` chunks in the top tier and refused ``refused`` past ``pin_max_share``."""

    pinned: int
    refused: int


Event = (LookedUp | ChunksRead | ChunkMissed | LoadCut | ChunksServed | LoadFailed | EngineLoad | EngineSave
         | Saved | SaveDropped | WriteDropped | TtlPinned | NotHeld | ServedBelow)
"""Every event a store operation reports."""


class Sink(Protocol):
    """Where an operation's events go.  ``emit`` is called on whatever thread learned the fact
    (the caller's, a read-ahead thread), possibly on several at once: implementations are
    thread-safe, never block, and never raise."""

    def emit(self, event: Event) -> None:
        """Take one event."""


class Counts(Protocol):
    """What the store's parts count besides events (:class:`kvtier.core.mover.StoreCounters`; the
    index, its lower tiers and the writers take the counters as this)."""

    def evicted(self, tier: str, num_chunks: int = 1) -> None:
        """``num_chunks`` chunks were evicted from ``tier``."""

    def dropped(self, num_chunks: int = 1) -> None:
        """``num_chunks`` chunk saves were dropped."""

    def moved(self, direction: str, num_bytes: int, seconds: float) -> None:
        """One transfer of ``num_bytes`` bytes taking ``seconds`` seconds in ``direction``."""


class NullSink:
    """A sink that keeps nothing."""

    def emit(self, event: Event) -> None:
        return None


NO_SINK = NullSink()


class OpContext(msgspec.Struct, frozen=True):
    """Who an operation is for and where its events go; passed explicitly, never in thread state.

    Attributes:
        request_id: the engine's request id (vLLM's ``Request.request_id``); ``None`` outside a request.
        tenant: who chunks are saved for (:class:`~kvtier.core.tenant.TenantId`, written with them
            where a tier keeps a tenant record); ``None``: unknown.
        sink: the request's own sink (the store sends every event to its metrics sink besides).
    """

    request_id: str | None = None
    tenant: TenantId | None = None
    sink: Sink = NO_SINK


NO_CONTEXT = OpContext()
"""The context of an operation outside any request (tools, tests, the store's own work)."""

