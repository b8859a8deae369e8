"""vLLM KV events for kvtier's local tiers: what a cache-aware router must know to route to a hit.

With vLLM's ``--kv-events-config`` on (``enable_kv_cache_events``), the scheduler publishes, each
step, the events its ``KVCacheManager`` queued (GPU blocks) and then those its KV connector
returns from ``take_events()`` (vllm/v1/core/sched/scheduler.py ``update_from_output``, after
``update_connector_output``).  kvtier's scheduler side answers it from this module: a
``BlockStored`` when a chunk becomes held by a local tier, a ``BlockRemoved`` when it leaves it
(vllm/distributed/kv_events.py; shapes as vLLM's own offloading connector builds them,
vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py: one ``BlockStored`` per chunk
carrying the chunk's per-block hashes, its parent block hash, its token ids and the engine block
size; removals grouped by medium and KV cache group).

What an event says (the semantics kept exactly, docs/vllm.md "KV events"): **kvtier holds this
chunk for every tensor-parallel rank, and a load would read it from medium X**, where X is the
registry record's ``medium`` of the tier the scheduler's mirror names for the chunk (the best
local tier of each rank, the slowest over ranks: ``"CPU"`` for the cpu tier, ``"STORAGE"`` for
the disk tier).  Each chunk is announced at one medium at a time: a chunk spilled from cpu to disk
and dropped from cpu is ``BlockRemoved(CPU)`` then ``BlockStored(STORAGE)``; one promoted back is
the reverse; a chunk in both is announced at ``"CPU"`` only.  A shared tier (redis) has no medium:
the change feed does not report it, other engines write it, and it is never announced.

Events are the difference between what the router was told (``announced``) and the mirror, for
the chunks whose vLLM block hashes the scheduler knows: it learns them when it schedules a
chunk's save or plans a load of it (the ``Request``'s ``block_hashes`` are at hand then), and keeps
them in a bounded map (:data:`MAX_CHUNKS`, least recently used first out; a chunk leaving the map
while announced is announced removed, so the router never keeps a chunk kvtier cannot describe).

Bounded everywhere:

- the map and the announced set: :data:`MAX_CHUNKS` chunks (announced ⊆ map);
- the chunks waiting for an event (``dirty``) are map keys; ``BlockStored`` events leave at most
  :data:`STORED_PER_S` chunks a second, in bursts of :data:`STORED_BURST` (a restart announcing a
  full disk tier spreads over seconds; the rest waits, never dropped);
- removals of chunks the map forgot wait in a backlog of :data:`REMOVED_BACKLOG` block hashes; past
  it they are dropped and counted (``kvtier_kv_events_dropped_total``).

Restart: the map, with the medium each chunk is announced at, is written at shutdown to a journal
in the first configured tier's ``state_dir`` (the disk tier's ``disk_path``; its file:
:mod:`~kvtier.integrations.vllm.scheduler.events_journal`); the restarted scheduler reads it once
its mirror is ready, announces the chunks of the workers' first snapshot the journal describes, and
withdraws what the stopped engine had announced at another medium (its cpu tier's chunks, gone
with its process, which a router reading the stream across the restart would keep).  The journal
is ignored when vLLM's block-hash seed differs (``NONE_HASH``: a non-cryptographic
``--prefix-caching-hash-algo`` without ``PYTHONHASHSEED`` seeds at random per process, so the
old hashes would name nothing).  A crash writes no journal: the disk tier's chunks are then
announced only as requests look them up.
"""

from __future__ import annotations

import array
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm import envs
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core import kv_cache_utils

from kvtier.core.tiers.registry import specs
from kvtier.integrations.vllm.scheduler.events_journal import (
    ChunkMeta,
    journal_path,
    read_journal,
    write_journal,
)

log = logging.getLogger(__name__)

MAX_CHUNKS = 1 << 16
"""Chunks whose event payload (block hashes, token ids) the scheduler keeps, at most (about 1 KiB
each for 128-token chunks of 16-token blocks)."""

STORED_PER_S = 4096.0
"""``BlockStored`` events a second, at most, after a burst of :data:`STORED_BURST`."""

STORED_BURST = 4096
"""``BlockStored`` events one step may publish when the bucket is full."""

REMOVED_BACKLOG = 1 << 16
"""Block hashes of forgotten chunks' removals waiting for ``take_events``, at most."""

LOCALITY = "LOCAL"
"""``locality`` of every kvtier event: the tiers announced are this engine's own."""


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config`` with ``enable_kv_cache_events``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return cfg is not None and bool(getattr(cfg, "enable_kv_cache_events", False))


@dataclass(frozen=True)
class EventGroup:
    """One KV cache group as its events describe it.

    Attributes:
        index: the group's index (``group_idx``).
        block_size: tokens per engine block of the group (``block_size`` of its events).
        announced: whether its pages are announced (full attention only, as vLLM's offloading
            connector: a sliding-window or state page alone resumes nothing a router can match).
        spec_kind: ``kv_cache_spec_kind`` (vLLM's ``KVCacheSpecKind`` value), or ``None``.
    """

    index: int
    block_size: int
    announced: bool = True
    spec_kind: str | None = None


class KVEventTracker:
    """Turns the scheduler mirror's changes into vLLM KV events (see the module docstring).

    Args:
        tier_of: the mirror's answer for a page key (``IndexMirror.tier``): the tier every rank
            holds it in, or ``None``.
        groups: the engine's KV cache groups.
        hash_block_size: tokens per hash of ``Request.block_hashes`` (``KVCacheConfig.hash_block_size``).
        chunk_tokens: tokens per kvtier chunk.
        journal_dir: directory of the restart journal (``None``: none is kept).
        max_chunks, stored_per_s, stored_burst, removed_backlog: the bounds (module constants).
        clock: monotonic seconds (tests).
    """

    def __init__(self, tier_of: Callable[[bytes], str | None], groups: Sequence[EventGroup], hash_block_size: int,
                 chunk_tokens: int, journal_dir: Path | None = None, max_chunks: int = MAX_CHUNKS,
                 stored_per_s: float = STORED_PER_S, stored_burst: int = STORED_BURST,
                 removed_backlog: int = REMOVED_BACKLOG, clock: Callable[[], float] = time.monotonic) -> None:
        if max_chunks <= 0 or stored_per_s <= 0 or stored_burst <= 0 or removed_backlog < 0:
            raise ValueError("KV event bounds must be positive")
        self._tier_of = tier_of
        self.groups = {g.index: g for g in groups}
        self.hash_block_size = hash_block_size
        self.chunk_tokens = chunk_tokens
        self.journal_dir = journal_dir
        self.max_chunks = max_chunks
        self.stored_per_s = stored_per_s
        self.stored_burst = stored_burst
        self.removed_backlog = removed_backlog
        self._clock = clock
        self._medium = {s.name: s.medium for s in specs()}
        self._meta: OrderedDict[bytes, ChunkMeta] = OrderedDict()
        self._announced: dict[bytes, str] = {}  # what the router was told: key -> medium
        self._dirty: dict[bytes, None] = {}  # keys whose announcement may differ from the mirror
        self._removed: dict[tuple[str, int], list[bytes]] = {}  # forgotten chunks' removals
        self._removed_count = 0
        self._tokens = float(stored_burst)
        self._last = clock()
        self._journal_root: bytes | None = None
        # kv_events_seconds: time spent here (record, observe, take_events), for the cost's share of a step
        self.counters: dict[str, float] = {"kv_events_stored": 0, "kv_events_removed": 0, "kv_events_dropped": 0,
                                           "kv_events_seconds": 0.0}
        # vLLM's maybe_convert_block_hash, with its environment switch read once (vllm/envs.py
        # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES; each read of vllm.envs parses the environment)
        self._int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)

    # ---- learning payloads ---------------------------------------------------------------------
    def record(self, request: Any, key: bytes, group: int, chunk: int) -> None:
        """Learn the payload of page ``key`` (chunk ``chunk`` of group ``group``) of ``request``;
        a page already known is only refreshed in the LRU order.  Cheap when known: one dict move."""
        start = time.perf_counter()
        meta = self._meta.get(key)
        if meta is not None:
            self._meta.move_to_end(key)
        elif (spec := self.groups.get(group)) is not None and spec.announced and (
                meta := self._payload(request, spec, chunk)) is not None:
            self._meta[key] = meta
            self._dirty[key] = None
            while len(self._meta) > self.max_chunks:
                self._forget(next(iter(self._meta)))
        self.counters["kv_events_seconds"] += time.perf_counter() - start

    def _payload(self, request: Any, spec: EventGroup, chunk: int) -> ChunkMeta | None:
        per_chunk = self.chunk_tokens // spec.block_size
        raw = getattr(request, "block_hashes", None)
        if raw is None or per_chunk <= 0:
            return None
        if spec.block_size != self.hash_block_size:
            raw = kv_cache_utils.resolve_block_hashes(raw, self.hash_block_size, spec.block_size)
        first, end = chunk * per_chunk, (chunk + 1) * per_chunk
        if len(raw) < end:
            return None  # the request's hashes do not reach this chunk (cannot be described)
        hashes = tuple(raw[first:end])  # vLLM's BlockHash values are bytes already
        parent = raw[first - 1] if first > 0 else None
        start_token, end_token = chunk * self.chunk_tokens, (chunk + 1) * self.chunk_tokens
        tokens = array.array("i", request.all_token_ids[start_token:end_token]).tobytes()
        lora = getattr(request, "lora_request", None)
        extra = None
        if lora is not None or getattr(request, "cache_salt", None) or getattr(request, "mm_features", None):
            per_block = []
            for b in range(first, end):
                keys, _ = kv_cache_utils.generate_block_hash_extra_keys(
                    request, b * spec.block_size, (b + 1) * spec.block_size, 0)
                per_block.append(keys)
            converted = kv_cache_utils.to_event_extra_keys(per_block)
            extra = tuple(converted) if converted else None
        return ChunkMeta(hashes, parent, tokens, spec.block_size, spec.index, spec.spec_kind,
                         lora.adapter_id if lora is not None else None,
                         lora.name if lora is not None else None, extra)

    def _forget(self, key: bytes) -> None:
        meta = self._meta.pop(key)
        self._dirty.pop(key, None)
        medium = self._announced.pop(key, None)
        if medium is None:
            return
        self._queue_removed(medium, meta)

    def _queue_removed(self, medium: str, meta: ChunkMeta) -> None:
        """Queue a ``BlockRemoved`` of ``meta``'s blocks at ``medium`` (dropped, and counted, past
        ``removed_backlog``)."""
        if self._removed_count + len(meta.block_hashes) > self.removed_backlog:
            self.counters["kv_events_dropped"] += 1
            return
        self._removed.setdefault((medium, meta.group_idx), []).extend(meta.block_hashes)
        self._removed_count += len(meta.block_hashes)
        self.counters["kv_events_removed"] += 1

    # ---- mirror changes ------------------------------------------------------------------------
    def observe(self, keys: Iterable[bytes], full: bool = False) -> None:
        """The mirror's view of ``keys`` may have changed (``full``: of every key, a snapshot)."""
        start = time.perf_counter()
        if full:
            self._dirty.update(dict.fromkeys(self._meta))
        else:
            meta, dirty = self._meta, self._dirty
            for key in keys:
                if key in meta:
                    dirty[key] = None
        self.counters["kv_events_seconds"] += time.perf_counter() - start

    def reset(self) -> None:
        """The mirror was emptied by a reset: every announced chunk is announced removed at the
        next :meth:`take_events` (the payloads are kept: a chunk saved again is announced again)."""
        self._dirty.update(dict.fromkeys(self._announced))

    def pending(self) -> bool:
        """Events wait for a step (``has_pending_push_work`` keeps an idle engine stepping)."""
        return bool(self._dirty or self._removed)

    def wants_step(self) -> bool:
        """:meth:`pending`, or published events wait to be counted: vLLM asks for the stats before
        the events in one ``update_from_output``, so a step's events are counted by the next step's
        stats, which an idle engine takes for them (``kv_events_seconds`` alone asks for none)."""
        c = self.counters
        return self.pending() or bool(c["kv_events_stored"] or c["kv_events_removed"] or c["kv_events_dropped"])

    # ---- publishing ----------------------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call (vLLM's ``take_events``): removals first, then stores
        (at most the rate limit's share; the rest next step)."""
        start = time.perf_counter()
        now = self._clock()
        self._tokens = min(float(self.stored_burst), self._tokens + (now - self._last) * self.stored_per_s)
        self._last = now
        removed, self._removed, self._removed_count = self._removed, {}, 0
        stored: list[KVCacheEvent] = []
        convert = _as_int if self._int_hashes else bytes
        done = []
        for key in self._dirty:
            tier = self._tier_of(key)
            new = self._medium.get(tier) if tier is not None else None
            old = self._announced.get(key)
            if new == old:
                done.append(key)
                continue
            if new is not None and self._tokens < 1:
                break  # the rest waits for the bucket (removals of later keys too: one order)
            meta = self._meta[key]
            if old is not None:
                removed.setdefault((old, meta.group_idx), []).extend(meta.block_hashes)
                del self._announced[key]
                self.counters["kv_events_removed"] += 1
            if new is not None:
                self._tokens -= 1
                self._announced[key] = new
                parent = meta.parent_block_hash
                stored.append(BlockStored(  # positional: vllm/distributed/kv_events.py's field order
                    [convert(h) for h in meta.block_hashes], convert(parent) if parent else None,  # type: ignore[arg-type]
                    _tokens(meta.token_ids), meta.block_size, meta.lora_id, new, meta.lora_name,
                    list(meta.extra_keys) if meta.extra_keys else None, meta.group_idx, meta.spec_kind, None,
                    LOCALITY))
                self.counters["kv_events_stored"] += 1
            done.append(key)
        for key in done:
            del self._dirty[key]
        events: list[KVCacheEvent] = [
            BlockRemoved(block_hashes=[convert(h) for h in hashes], medium=medium,  # type: ignore[arg-type]
                         group_idx=group, locality=LOCALITY)
            for (medium, group), hashes in removed.items()]
        events += stored
        self.counters["kv_events_seconds"] += time.perf_counter() - start
        return events

    def announced(self) -> dict[bytes, str]:
        """Page key -> medium, as the router was told (a copy)."""
        return dict(self._announced)

    # ---- restart journal -----------------------------------------------------------------------
    def load_journal(self, key_root: bytes) -> int:
        """Read the journal of namespace ``key_root`` (once; called when the mirror is ready):
        its chunks join the map and those the mirror holds are announced (rate-limited); those
        the stopped engine had announced at another medium than the mirror's now are withdrawn
        there (:meth:`_withdraw`).

        Returns:
            chunks read (0: none, unreadable or of another hash seed; logged once, never raised).
        """
        self._journal_root = key_root
        path = journal_path(self.journal_dir, key_root)
        journal = read_journal(path) if path is not None else None
        if journal is None:
            return 0
        n, last = 0, slice(-self.max_chunks, None)
        for key, meta, old in zip(journal.keys[last], journal.metas[last], journal.media[last]):
            if key not in self._meta and meta.group_idx in self.groups:
                self._meta[key] = meta
                self._dirty[key] = None
                n += 1
                self._withdraw(key, meta, old)
        while len(self._meta) > self.max_chunks:
            self._forget(next(iter(self._meta)))
        log.info("kvtier: KV-event journal: %d chunks' block hashes read from %s", n, path)
        return n

    def _withdraw(self, key: bytes, meta: ChunkMeta, old: str) -> None:
        """A chunk the stopped engine had announced at medium ``old`` is withdrawn there unless the
        mirror names the same medium now (it is then announced again, at the first step): a cpu
        tier's announcements do not outlive its process, and a router reading this engine's stream
        across the restart would otherwise keep the chunk at ``CPU`` beside its new ``STORAGE``."""
        tier = self._tier_of(key)
        if not old or (self._medium.get(tier) if tier is not None else None) == old:
            return
        self._queue_removed(old, meta)

    def save_journal(self) -> bool:
        """Write the map, and the medium each chunk is announced at, to the journal (at shutdown);
        ``False`` (logged) when it could not."""
        path = journal_path(self.journal_dir, self._journal_root or b"")
        if path is None:
            return False
        return write_journal(path, list(self._meta), list(self._meta.values()),
                             [self._announced.get(key, "") for key in self._meta], self.max_chunks)

    @property
    def journal_loaded(self) -> bool:
        return self._journal_root is not None

    def take_counters(self) -> dict[str, float]:
        """Counters' change since the last call (``kvtier_kv_events_*_total``), only non-zero ones."""
        out = {k: v for k, v in self.counters.items() if v}
        self.counters = dict.fromkeys(self.counters, 0)
        return out


def _as_int(block_hash: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash`` with int hashes on: the low 64 bits, big-endian."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


def _tokens(data: bytes) -> list[int]:
    tokens = array.array("i")
    tokens.frombytes(data)
    return tokens.tolist()
