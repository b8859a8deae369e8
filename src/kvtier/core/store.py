"""TieredStore: chunk storage across an ordered list of tiers (cpu, then e.g. disk and redis).

The tiers come from the configuration's ``tiers`` list, by name (:mod:`kvtier.core.tiers.registry`);
a tier the configuration does not ask for is skipped.  The first is the top (staging) tier: every
chunk passes through it.  The store is a thin facade over two parts:

- the **index** (:mod:`kvtier.core.index`, :mod:`kvtier.core.upkeep`, one
  :mod:`~kvtier.core.lowerindex` per lower tier): all placement state under one lock, no threads;
  its verbs return typed plans (:mod:`kvtier.core.handles`);
- the **mover** (:mod:`kvtier.core.mover`): write queues and threads per lower tier, the
  read-ahead pool, tier reads and writes; it runs the plans and reports back to the index.

Contract (all methods thread-safe; the index's lock guards placement, copies and tier I/O run
outside it on pinned chunks):

- ``lookup(chain) -> int``: how many **leading** chunks of ``chain`` are available in the top tier
  or a local lower tier.  A chunk is only useful if every chunk before it is available, so the
  count stops at the first miss.  Never asks a shared tier, so it never waits on the network.
  No pins; results may be stale by the time a load starts (a load may return fewer chunks, never wrong ones).
- ``prepare_load(chain, max_chunks) -> LoadHandle``: pins the longest available prefix.  Chunks
  found below the top tier are read, verified, and promoted into top-tier pages (hot chunks move
  up; :mod:`kvtier.core.mover`); chunks beyond the local prefix are read from a shared tier,
  at most ``max_chunks`` in all (what the scheduler's shared lookup found; ``None``: one presence
  batch asks first).  A chunk that is missing or fails verification ends the prefix.  ``complete_load(handle, success)`` unpins and, only if ``success``, counts hits and
  refreshes recency.  A failed transfer is never a hit; ``cancel_load(handle)`` unpins a load that
  will not happen without counting anything.
- ``prepare_store(chain, start) -> StoreHandle``: reserves top-tier pages for the chunks not yet
  stored; reserved pages are invisible to lookups and cannot be evicted.
  ``complete_store(handle, success)`` publishes them or gives them back.
- Both ``complete_*`` must be called on every path (``try/finally``); calling twice is a no-op.
- Context: every verb takes ``ctx`` (:class:`~kvtier.core.context.OpContext`), a handle carries
  it on; events go to the store's counters and to ``ctx.sink`` (:mod:`kvtier.core.context`).
- Eviction: when the top tier needs a page, the policy's victim (never a pinned chunk) leaves.
  A write-back tier (disk in ``write-back`` mode) that lacks the victim gets a staged copy queued
  (spill); write-through tiers (disk in ``write-through`` mode, every shared tier) get every
  stored chunk queued at once.  Queues are bounded (``save_queue_depth``): a write that does not
  fit is dropped and counted in ``dropped_saves``; callers are never blocked.  A background
  spill keeps ``spill_watermark`` of the top tier's pages free so that saves rarely wait.
- ``clear(tiers) -> {tier: ClearResult}``: a reset (vLLM's external prefix-cache reset): drops
  every chunk of the named tiers at once, and bumps :attr:`TieredStore.epoch`.  Chunks pinned by a
  load in flight become invisible at once and are freed when unpinned; a save or promotion
  started before the reset does not publish; a queued or running write of a cleared lower tier
  is dropped, or its chunk deleted if it landed after the clear; a scan of other processes'
  files running meanwhile adopts nothing.  A caller that copied bytes out of a load started
  before the reset compares ``epoch`` to tell (:mod:`kvtier.integrations.vllm.worker.loader`).
- ``gate_evictions(closed)``: while closed no top-tier page is freed; ``pin_resident(chain)`` pins
  what the top tier holds for a load prepared later: a mirror's plan and its pin as one step (:mod:`kvtier.core.gate`).
- The change feed (:mod:`kvtier.core.changes`): ``drain_changes(max_items=4096) -> IndexDelta`` (changes since
  the last drain; the first, and the first after a reset, is a full snapshot), ``pending_changes()``,
  ``dirty_keys()`` (chunks held in DRAM but on no local lower tier: a crash would lose them) and
  ``dirty_bytes()``.  These six are the index's own methods (:class:`~kvtier.core.index.Index`), bound at
  construction: the store adds nothing to them.  So are the request path's: a load's three verbs, ``stats()``
  and ``take_ghost_distances()`` are the mover's (:class:`~kvtier.core.mover.Mover`), ``epoch`` the index's count.
- ``check_integrity()``: every invariant of the index (:func:`kvtier.core.indexcheck.check_index`).

Sizes: ``chunk_bytes`` is one chunk's payload; capacities are the configuration's / ``tp_size``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from operator import attrgetter

from prometheus_client import CollectorRegistry

from kvtier.core import context
from kvtier.core.config import KVTierConfig
from kvtier.core.context import OpContext
from kvtier.core.errors import ConfigError
from kvtier.core.handles import EngineLoad, EngineSave, StoreHandle
from kvtier.core.index import Index
from kvtier.core.indexcheck import check_index
from kvtier.core.keys import ChunkKey, Namespace
from kvtier.core.lowerindex import LowerIndex
from kvtier.core.metrics import StoreMetrics
from kvtier.core.mover import CountersSink, Mover, StoreCounters
from kvtier.core.storeio import StoreConvenience
from kvtier.core.tenant import TenantId
from kvtier.core.tiers.base import ClearResult, Rescannable, StagingTier, Tier
from kvtier.core.tiers.factory import TierContext, make_tier

log = logging.getLogger(__name__)


class TieredStore(StoreConvenience):
    """The tiered chunk store; see the module docstring for the contract.

    Args:
        config: kvtier configuration.
        namespace: what the stored bytes depend on; no tier returns another namespace's chunks.
        chunk_bytes: bytes of one chunk's KV (all layers of this rank), > 0.
        tp_size: tensor-parallel size; capacities are per rank (total / tp_size).
        registry: prometheus registry to register metrics in (a fresh one by default).
        wrap: ``wrap(tier) -> tier`` applied to each lower tier as it is built (e.g. a
            :class:`~kvtier.core.tiers.wrappers.FaultyTier` in tests and drills); ``None``: none.

    ``index`` (:class:`~kvtier.core.index.Index`) knows where every chunk is, ``mover``
    (:class:`~kvtier.core.mover.Mover`) moves the bytes; ``cpu`` is the top (staging) tier.

    Raises:
        ValueError: ``chunk_bytes`` not positive.
        ConfigError: a tier cannot be built from the configuration.
        OSError: the disk directory cannot be created.
    """

    def __init__(self, config: KVTierConfig, namespace: Namespace, chunk_bytes: int, tp_size: int = 1,
                 registry: CollectorRegistry | None = None, wrap: Callable[[Tier], Tier] | None = None) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.config = config
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        self.chunk_tokens = namespace.chunk_tokens  # the engine's resolved size (config may say auto)
        self.counters = StoreCounters()
        self.metrics = StoreMetrics(lambda: self.stats(), registry)  # (self.stats is bound below, to the mover's)
        self.metrics.set_config({**config.public_dict(), "chunk_bytes": chunk_bytes, "tp_size": tp_size,
                                 "namespace": namespace.digest().hex()})
        ctx = TierContext(config, namespace.digest(), chunk_bytes, tp_size, self.metrics.registry,
                          namespace.engine_digests())
        tiers: list[Tier] = []
        try:
            for name in config.tiers:
                tier = make_tier(name, ctx)
                if tier is not None:
                    tiers.append(wrap(tier) if wrap is not None and tiers else tier)
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        if not tiers or not isinstance(tiers[0], StagingTier):
            raise ConfigError(f"the first tier must be a staging tier such as 'cpu', got {config.tiers[0]!r}; "
                              "list 'cpu' first in tiers")
        self.cpu: StagingTier = tiers[0]
        self.sink = CountersSink(self.counters, self.cpu.name)  # every operation's events reach the counters
        lower = [LowerIndex(t, config.policy, config.write_mode == "write-back", self.counters) for t in tiers[1:]]
        self.index = Index(self.cpu, lower, config, self.counters, chunk_bytes, self.metrics.ghost_hit)
        self.mover = Mover(self.index, config.io_threads, config.save_queue_depth, self.sink, self.chunk_tokens)
        # the request path's verbs, as they are: the mover's for a load and the step's snapshot, the index's for
        # the module docstring's change feed and eviction gate (a worker calls them on every load and engine
        # step: no forwarding call in between, scripts/hit_story.py)
        self.prepare_load = self.mover.prepare_load
        self.complete_load = self.mover.complete_load
        self.cancel_load = self.mover.cancel_load
        self.stats = self.mover.stats
        self.take_ghost_distances = self.mover.take_ghost_distances
        self.drain_changes = self.index.drain_changes
        self.pending_changes = self.index.pending_changes
        self.dirty_keys = self.index.dirty_keys
        self.dirty_bytes = self.index.dirty_bytes
        self.gate_evictions = self.index.gate_evictions
        self.pin_resident = self.index.pin_resident
        self._closed = False
        self._rescan_stop = threading.Event()
        self._rescanner: threading.Thread | None = None
        if config.disk_rescan_s and self.index.local:  # None or 0: never (the vLLM connector sets it for consumers)
            self._rescanner = threading.Thread(target=self._rescan_loop, args=(config.disk_rescan_s,),
                                               name="kvtier-disk-rescan", daemon=True)
            self._rescanner.start()

    epoch = property(attrgetter("index.epoch"), doc="""Resets so far (:meth:`clear`); a load started under another
        epoch serves pre-reset bytes.  (The index's own count, read in C: a worker reads it on every load.)""")

    def clear(self, tiers: Collection[str]) -> dict[str, ClearResult]:
        """Reset: drop every chunk of the store's tiers named in ``tiers`` (names it lacks are
        ignored) and bump :attr:`epoch`; see the module docstring for what is in flight.  The next
        :meth:`drain_changes` is a full snapshot.  Runs the tiers' removals under the index's lock
        (a rare operator action: loads and saves wait for it).

        Returns:
            per tier cleared, what it removed (``ok`` False, with a reason, where something could
            not be removed); counted in each tier's ``reset_chunks``.
        """
        out = self.index.clear(tiers)
        for name, result in out.items():
            self.counters.reset_removed(name, len(result.keys))
        return out

    def tier(self, name: str) -> Tier | None:
        """The tier called ``name``, or ``None`` if the store has none."""
        lt = self.index.by_name.get(name)
        return self.cpu if name == self.cpu.name else lt.tier if lt is not None else None

    # ---- the change feed (kvtier.core.changes, kept by the index; its verbs are the index's: __init__) ----
    @property
    def change_feed_limit(self) -> int:
        """Changed keys kept between drains; past it the next drain is a full snapshot."""
        return self.index.change_feed_limit

    @change_feed_limit.setter
    def change_feed_limit(self, limit: int) -> None:
        self.index.change_feed_limit = limit

    # ---- lookup --------------------------------------------------------------------------
    def lookup(self, chain: Sequence[ChunkKey], ctx: OpContext | None = None) -> int:
        """Leading chunks of ``chain`` available in local tiers (see module docstring) for ``ctx``."""
        start = time.perf_counter()
        n, found = self.index.lookup(chain)
        self.sink.bind(ctx).sink.emit(context.LookedUp(len(chain), found))
        self.metrics.lookup_seconds.observe(time.perf_counter() - start)
        return n

    # ---- load ----------------------------------------------------------------------------
    def load_skipped(self, engine: EngineLoad, ctx: OpContext | None = None) -> None:
        """Count a load that never reached the store (its request was aborted before it began)."""
        self.sink.bind(ctx).sink.emit(engine)

    # ---- store ---------------------------------------------------------------------------
    def prepare_store(self, chain: Sequence[ChunkKey], start: int = 0, tenant: TenantId | None = None,
                      ctx: OpContext | None = None, explain: int = -1, touch_end: int = 0) -> StoreHandle:
        """Reserve top-tier pages for ``chain[start:]`` chunks not stored yet (see module docstring).
        ``ctx``: the request's context (:mod:`kvtier.core.context`), kept in the handle; its ``tenant``
        is who the chunks are saved for, written with them where a tier keeps a tenant record
        (:mod:`kvtier.core.tenant`; ``None``: unknown).  ``tenant``: shorthand for a context of that
        tenant alone (tools and tests); both given: ``ValueError``.  ``explain``: a chain position
        whose absence the request's receipt explains: if no tier holds it, ``ctx`` hears why
        (:class:`~kvtier.core.context.NotHeld`, from the ghost lists: :mod:`kvtier.core.ghosts`).
        ``touch_end``: chunks of ``chain[start:touch_end]`` the top tier holds are touched in its policy
        (the engine served them from its own prefix cache: a use no load marked; 0: none)."""
        plan = self.index.plan_store(chain, start, self.sink.bind(ctx, tenant), explain, touch_end)
        self.mover.submit(plan.writes)
        return plan.handle

    def complete_store(self, handle: StoreHandle, success: bool, engine: EngineSave | None = None) -> None:
        """Publish (``success``) or release the reserved pages; count ``engine`` (what the copy out
        of the engine moved) when ``success``.  Idempotent."""
        if success and engine is not None and not handle.done:
            handle.ctx.sink.emit(engine)
        published = self.index.complete_store(handle, success, self.mover.free_slots())
        if published is not None:
            handle.ctx.sink.emit(context.Saved(len(handle.keys)))
            self.mover.submit(published.writes, handle.ctx.sink)  # the sink hears of refused write-throughs

    # ---- TTL pins ----------------------------------------------------------------------------
    def ttl_pin(self, keys: Sequence[ChunkKey], ttl_s: float, ctx: OpContext | None = None) -> tuple[int, int]:
        """Keep ``keys`` in the top tier for ``ttl_s`` seconds (a request's pinned prefix, issue 22 item 4).

        Only chunks resident in the top tier are pinned (a chunk not held there is skipped); a pin
        already held keeps the later deadline.  At most ``pin_max_share`` of the top tier's pages
        are pinned at once: a pin past that is refused and counted (never an eviction storm).
        Pinned chunks are never evicted before their deadline and need no unpin; a reset drops them.

        Returns:
            ``(pinned, refused)`` chunk counts.
        """
        if ttl_s <= 0:
            return 0, 0
        pinned, refused = self.index.ttl_pin(keys, time.monotonic() + ttl_s)
        self.sink.bind(ctx).sink.emit(context.TtlPinned(pinned, refused))
        return pinned, refused

    # ---- other processes' chunk files -----------------------------------------------------
    def rescan(self) -> int:
        """Adopt chunk files other processes wrote into the local lower tiers since start, and
        forget those they removed (:meth:`kvtier.core.tiers.disk.DiskTier.rescan`); both reach the
        change feed, so a scheduler's mirror learns of them.  Runs every ``disk_rescan_s``
        seconds on a background thread when that is set.  The directory is read without the
        index's lock; the index takes in what was found.  Returns the keys adopted or forgotten."""
        n = 0
        for lt in self.index.local:
            if isinstance(lt.tier, Rescannable) and lt.policy is not None:
                n += self.index.adopt(lt.name, lt.tier.scan())
        return n

    def _rescan_loop(self, interval_s: float) -> None:
        while not self._rescan_stop.wait(interval_s):
            try:
                self.rescan()
            except Exception:  # the thread must outlive one bad round (e.g. the directory vanished)
                log.exception("kvtier: rescanning the disk tier failed")

    # ---- lifecycle and checks ------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued writes of every tier are done; False if ``timeout_s`` passed first."""
        return self.mover.flush(None if timeout_s is None else time.monotonic() + timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued writes (up to ``timeout_s``), stop the threads, close the tiers.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._rescan_stop.set()
        if self._rescanner is not None:
            self._rescanner.join(timeout=timeout_s)
        self.flush(timeout_s)
        self.mover.close()
        for lt in self.index.lower:
            lt.tier.close()
        self.cpu.close()

    def flush_dirty(self, timeout_s: float) -> tuple[int, int]:
        """Write every dirty top-tier chunk to the local lower tiers, waiting at most ``timeout_s``.

        Used on a graceful stop so that a restart finds the hot set on disk.  Unlike the save
        path, this waits for room in the write queues (until the deadline) instead of dropping.
        A dirty chunk with a write in flight is passed over first, then waited for and planned
        again: that write may be to a shared tier alone (its disk write was dropped or failed).
        The chunks it writes are pinned in their tier until it ends, so that a full tier evicts
        older chunks for them, never one the flush itself just wrote.

        Returns:
            ``(written, missed)``: chunks that reached a local lower tier, and chunks still dirty
            at the deadline (counted in ``flush_missed_chunks``), of those dirty when it began (a
            chunk it evicted from a full tier to make room is an eviction).  ``(0, 0)`` without one.
        """
        if not self.index.local:
            return 0, 0
        dirty, deadline = self.dirty_keys(), time.monotonic() + max(timeout_s, 0.0)
        before, writing = len(dirty), self.index.writing  # (write jobs in flight per chunk, to any lower tier)
        with self.index.lock:  # what the flush writes is no victim of its own later writes (a full disk whose
            for lt in self.index.local:  # policy evicts new chunks first, s3fifo and adaptive, lost most of them)
                for key in dirty:
                    lt.pin(key)
        try:
            held = [k for k in dirty if k in writing]
            self._plan_flush([k for k in dirty if k not in writing], deadline)
            while any(k in writing for k in held) and time.monotonic() < deadline:
                time.sleep(0.005)
            self._plan_flush(held, deadline)
            local = [lt.name for lt in self.index.local]
            while self.mover.busy(local) and time.monotonic() < deadline:
                time.sleep(0.005)
        finally:
            with self.index.lock:
                for lt in self.index.local:
                    for key in dirty:
                        lt.unpin(key)
        missed = len(set(dirty).intersection(self.dirty_keys()))  # (not those it evicted from a full tier for room)
        if missed:
            self.counters.flush_missed(missed)
        return max(before - missed, 0), missed

    def _plan_flush(self, keys: Sequence[ChunkKey], deadline: float) -> None:
        """Queue the flush writes of ``keys``, each waiting for room until ``deadline`` (``time.monotonic()``)."""
        for key in keys:  # unlike a save, each waits for room in the queues
            while time.monotonic() < deadline:
                done, writes = self.index.plan_flush(key, self.mover.full())
                self.mover.submit(writes)
                if done:
                    break
                time.sleep(0.002)

    def check_integrity(self, expect_idle: bool = True) -> None:
        """Assert the store's invariants (:func:`kvtier.core.indexcheck.check_index`).

        Args:
            expect_idle: also require that no chunk is pinned and no write is queued.

        Raises:
            AssertionError: naming the broken invariant.
        """
        check_index(self.index, expect_idle)
        if expect_idle:
            assert not self.mover.busy(), "writes still in flight"

