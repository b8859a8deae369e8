"""TieredStore: chunk storage across an ordered list of tiers (cpu, then e.g. disk and redis).

The tiers come from the configuration's ``tiers`` list, by name (:mod:`kvtier.core.tiers.registry`);
a tier the configuration does not ask for is skipped.  The first is the top (staging) tier: every
chunk passes through it (:mod:`kvtier.core.top`).  Each tier below it is a
:class:`~kvtier.core.lower.LowerTier` with its own policy, pins, bounded write queue and threads.

Contract (all methods thread-safe; one lock guards metadata, data copies and tier I/O run
outside it on pinned chunks):

- ``lookup(chain) -> int``: how many **leading** chunks of ``chain`` are available in the top tier
  or a local lower tier.  A chunk is only useful if every chunk before it is available, so the
  count stops at the first miss.  Never asks a shared tier, so it never waits on the network.
  No pins; results may be stale by the time a load starts (a load may return fewer chunks,
  never wrong ones).
- ``lookup_async(chain) -> PendingLookup``: the same, continued in a shared tier in the background
  (one pipelined batch of presence checks, under ``shared_deadline_s``); ``poll()`` answers
  "ask again" (``None``) until the shared tier answered or the deadline passed.  At most
  ``shared_queue_depth`` such lookups run at once; more are answered from local tiers alone
  and counted in ``shared_lookups_skipped``.
- ``prepare_load(chain, max_chunks) -> LoadHandle``: pins the longest available prefix.  Chunks
  found below the top tier are read, verified, and promoted into top-tier pages (hot chunks move
  up; :mod:`kvtier.core.promotion`); chunks beyond the local prefix are read from a shared tier,
  at most ``max_chunks`` in all (pass the count ``lookup_async`` returned).  A chunk that is missing or fails verification ends
  the prefix.  ``complete_load(handle, success)`` unpins and, only if ``success``, counts hits and
  refreshes recency.  A failed transfer is never a hit; ``cancel_load(handle)`` unpins a load that
  will not happen without counting anything.
- ``prepare_store(chain, start) -> StoreHandle``: reserves top-tier pages for the chunks not yet
  stored; reserved pages are invisible to lookups and cannot be evicted.
  ``complete_store(handle, success)`` publishes them or gives them back.
- Both ``complete_*`` must be called on every path (``try/finally``); calling twice is a no-op.
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
- ``gate_evictions(closed)``: while closed, nothing leaves the top tier (it takes free pages only;
  a finished spill's eviction waits for the gate to open); ``pin_resident(chain)`` pins what
  the top tier holds now for a load prepared later.  Together they make a mirror's plan and the
  pin one step (:mod:`kvtier.core.gate`).
- ``check_integrity()``: each tier's accounting, policies track exactly the resident chunks, and
  no pins remain (call it once all requests are done).

Sizes: ``chunk_bytes`` is the payload of one chunk; capacities come from
:class:`~kvtier.core.config.KVTierConfig` divided by ``tp_size`` (sizes are totals across ranks).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from kvtier.core.changes import ChangeFeedMixin
from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.handles import EngineLoad, EngineSave, LoadHandle, PendingLookup, StoreHandle
from kvtier.core.keys import ChunkKey, Namespace
from kvtier.core.lower import LowerTier, WriteJob
from kvtier.core.metrics import StoreMetrics
from kvtier.core.policies import make_policy
from kvtier.core.policies.admission import make_admission
from kvtier.core.promotion import Promoter, Promotion
from kvtier.core.quota import TenantLedger
from kvtier.core.shared import SharedLookups
from kvtier.core.stats import StoreCounters, StoreStats, TierStats
from kvtier.core.tenant import TenantId
from kvtier.core.tiers.base import AlreadyHeld, ClearResult, NoRoom, Paged, StagingTier, Tier
from kvtier.core.tiers.factory import TierContext, make_tier
from kvtier.core.top import TopTier

log = logging.getLogger(__name__)
READ_AHEAD_WAIT_S = 60.0
"""How long :meth:`TieredStore.get` waits for chunks read ahead before calling the load failed."""


class TieredStore(ChangeFeedMixin):
    """The tiered chunk store; see the module docstring for the contract.

    Args:
        config: kvtier configuration.
        namespace: what the stored bytes depend on; no tier returns another namespace's chunks.
        chunk_bytes: bytes of one chunk's KV (all layers of this rank), > 0.
        tp_size: tensor-parallel size; capacities are per rank (total / tp_size).
        registry: prometheus registry to register metrics in (a fresh one by default).
        wrap: ``wrap(tier) -> tier`` applied to each lower tier as it is built (e.g. a
            :class:`~kvtier.core.tiers.wrappers.FaultyTier` in tests and drills); ``None``: none.

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
        self.metrics = StoreMetrics(self.stats, registry)
        self.metrics.set_config({**config.public_dict(), "chunk_bytes": chunk_bytes, "tp_size": tp_size,
                                 "namespace": namespace.digest().hex()})
        self._lock = threading.RLock()
        self._init_feed()
        ctx = TierContext(config, namespace.digest(), chunk_bytes, tp_size, self.metrics.registry)
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
        self.cpu_policy = make_policy(config.policy)
        self.top = TopTier(self.cpu, self.cpu_policy, self.counters, config.spill_watermark, chunk_bytes)
        self.top.on_change = self._note_locked
        self.lower: list[LowerTier] = []
        self._local: list[LowerTier] = []
        self.lower = [LowerTier(t, config.policy, config.write_mode == "write-back", config.io_threads,
                                config.save_queue_depth, self._lock, self.counters,
                                self.cpu.view, self._on_written, self._note_locked, self._resync_locked)
                      for t in tiers[1:]]
        for lt in self.lower:  # admission per lower tier (kvtier.core.policies.admission)
            lt.admission = make_admission(config.admission.get(lt.name, "all"))
        self.top.back = [lt for lt in self.lower if lt.write_back]
        # victims move down, so the default orders the cpu tier for the reach of the whole stack
        self.cpu_policy.set_capacity_below(sum(lt.tier.usage().capacity_bytes for lt in self.top.back) // chunk_bytes)
        self._local = [lt for lt in self.lower if not lt.shared]
        if config.tenant_quotas is not None:  # each local tier's share per tenant (kvtier.core.quota)
            self.top.quota = TenantLedger(config.tenant_quotas, self._pages(self.cpu))
            for lt in self._local:
                lt.quota = TenantLedger(config.tenant_quotas,
                                        lt.tier.usage().capacity_bytes // lt.tier.stored_bytes(chunk_bytes))
        self._shared = [lt for lt in self.lower if lt.shared]
        self._through = [lt for lt in self.lower if not lt.write_back]
        self.shared = SharedLookups(self._shared[0], config.shared_deadline_s, config.shared_queue_depth,
                                    self.counters) if self._shared else None
        self.promoter = Promoter(self._lock, self.cpu, self.top, self.counters, chunk_bytes, config.io_threads,
                                 self._unpin_handle)
        self._closed = False
        self._rescan_stop = threading.Event()
        self._rescanner: threading.Thread | None = None
        if config.disk_rescan_s and self._local:  # None or 0: never (the vLLM connector sets it for consumers)
            self._rescanner = threading.Thread(target=self._rescan_loop, args=(config.disk_rescan_s,),
                                               name="kvtier-disk-rescan", daemon=True)
            self._rescanner.start()

    def _on_written(self, job: WriteJob, tier_name: str, ok: bool) -> None:
        self.top.written(job, ok)  # the top tier is built before the lower tiers that call this

    # ---- what the change feed asks (kvtier.core.changes; the lock held) -------------------
    def _tier_locked(self, key: ChunkKey) -> str | None:
        if self.top.holds(key):
            return self.top.name
        return next((lt.name for lt in self._local if lt.tier.indexed(key)), None)

    def _dirty_locked(self, key: ChunkKey) -> bool:
        return bool(self._local) and self.top.holds(key) and not any(lt.tier.indexed(key) for lt in self._local)

    def _held_keys_locked(self) -> list[ChunkKey]:
        doomed = self.top.doomed
        return [*(k for k in self.cpu.keys() if k not in doomed), *self.top.staged,  # noqa: SIM118
                *(k for lt in self._local for k in lt.tier.keys())]  # noqa: SIM118

    @property
    def epoch(self) -> int:
        """Resets so far (:meth:`clear`); a load started under another epoch serves pre-reset bytes."""
        return self.top.epoch

    def clear(self, tiers: Collection[str]) -> dict[str, ClearResult]:
        """Reset: drop every chunk of the store's tiers named in ``tiers`` (names it lacks are
        ignored) and bump :attr:`epoch`; see the module docstring for what is in flight.  The next
        :meth:`drain_changes` is a full snapshot.  Runs the tiers' removals under the store's lock
        (a rare operator action: loads and saves wait for it).

        Returns:
            per tier cleared, what it removed (``ok`` False, with a reason, where something could
            not be removed); counted in each tier's ``reset_chunks``.
        """
        out: dict[str, ClearResult] = {}
        with self._lock:
            self.top.epoch += 1  # even when the top tier is kept: no promotion or save of before publishes
            if self.cpu.name in tiers:
                out[self.cpu.name] = ClearResult(self.top.clear())
            for lt in self.lower:
                if lt.name in tiers:
                    out[lt.name] = lt.clear_locked()
            self._resync_locked()
        for name, result in out.items():
            self.counters.reset_removed(name, len(result.keys))
        return out

    def tier(self, name: str) -> Tier | None:
        """The tier called ``name``, or ``None`` if the store has none."""
        if name == self.cpu.name:
            return self.cpu
        return next((lt.tier for lt in self.lower if lt.name == name), None)

    # ---- lookup --------------------------------------------------------------------------
    def lookup(self, chain: Sequence[ChunkKey]) -> int:
        """Leading chunks of ``chain`` available in local tiers (see module docstring)."""
        start = time.perf_counter()
        found = Counter[str]()
        with self._lock:
            n = 0
            for key in chain:
                if self.top.holds(key):
                    found[self.top.name] += 1
                else:
                    lt = next((lt for lt in self._local if lt.tier.contains(key)), None)
                    if lt is None:
                        break
                    found[lt.name] += 1
                n += 1
        self.counters.looked_up(len(chain), found)
        self.metrics.lookup_seconds.observe(time.perf_counter() - start)
        return n

    def lookup_async(self, chain: Sequence[ChunkKey]) -> PendingLookup:
        """Local lookup now, continued in the shared tier in the background (see module docstring)."""
        n = self.lookup(chain)
        if self.shared is None or n >= len(chain):
            return PendingLookup(n, len(chain))
        return self.shared.lookup(chain, n)

    # ---- plan and pin (kvtier.core.gate) --------------------------------------------------
    def gate_evictions(self, closed: bool) -> bool:
        """Close the eviction gate (before a drain whose changes a mirror plans from), or open it
        (once the loads planned from that drain are pinned), running what it deferred.  Returns
        whether it was closed."""
        with self._lock:
            gate = self.top.gate
            was, gate.closed = gate.closed, closed
            if not closed and gate.deferred:
                gate.run_deferred()
            return was

    def pin_resident(self, chain: Sequence[ChunkKey]) -> LoadHandle:
        """Pin every chunk of ``chain`` resident in the top tier (wherever it is in the chain; no
        I/O, nothing counted), so that a load prepared later, on another thread, still finds them.
        Release with :meth:`cancel_load`."""
        handle = LoadHandle([], [], [])
        with self._lock:
            for key in chain:
                if self.top.resident(key):
                    self.top.pin(key)
                    handle.pinned.append(key)
        return handle

    # ---- load ----------------------------------------------------------------------------
    def prepare_load(self, chain: Sequence[ChunkKey], max_chunks: int | None = None,
                     read_ahead: bool = False, top_only: bool = False) -> LoadHandle:
        """Pin and return the longest available prefix of ``chain`` (at most ``max_chunks``).

        With ``read_ahead``, only the first ``io_threads`` chunks found below the cpu tier are read
        before returning; the rest are read into cpu pages in the background, ``io_threads`` at a
        time, while the caller copies the ready ones out (``handle.ready_chunks()`` grows as they
        arrive; ``handle.wait(timeout_s)`` for the end).

        With ``top_only``, the prefix ends at the first chunk the top (cpu) tier does not hold: no
        file, socket or network I/O at all, and every buffer is ready when this returns (the
        connector's synchronous loads, run on the engine's own thread).  Top-tier pages are handed
        out as they are, pinned, without re-hashing: they never left this process's memory (the
        lower tiers' reads are verified, :mod:`kvtier.core.promotion`)."""
        limit = len(chain) if max_chunks is None else min(max_chunks, len(chain))
        handle = LoadHandle([], [], [])
        promote: list[Promotion] = []  # chunks to read from lower tiers (kvtier.core.promotion)
        with self._lock:
            for i in range(limit):
                key = chain[i]
                if self.top.resident(key):
                    self.top.pin(key)
                    handle.pinned.append(key)
                    buf = self.cpu.view(key)
                    source = self.top.name
                elif key in self.top.staged:  # a private copy, immutable: no pin needed
                    buf = self.top.staged[key].data
                    source = self.top.name
                elif top_only:
                    break
                else:
                    lt = next((lt for lt in self._local if lt.tier.contains(key)), None)
                    if lt is None:
                        break
                    lt.pin_locked(key)
                    buf = self.promoter.buffer_locked(key, promote, i, lt)
                    source = lt.name
                handle.keys.append(key)
                handle.buffers.append(buf)
                handle.tiers.append(source)
        start = handle.num_chunks
        if start < limit and self._shared and not top_only:
            self._plan_shared_reads(chain, start, limit, max_chunks is None, handle, promote)
        if promote:
            self.promoter.run(chain, handle, promote, read_ahead)
        return handle

    def _plan_shared_reads(self, chain: Sequence[ChunkKey], start: int, limit: int, unbounded: bool,
                           handle: LoadHandle, promote: list[Promotion]) -> None:
        """Queue reads of ``chain[start:limit]`` from the first shared tier (checked first if ``unbounded``)."""
        lt = self._shared[0]
        want = list(chain[start:limit])
        if unbounded and self.shared is not None:  # nobody asked yet: one presence batch, so misses cost no bytes
            want = want[:self.shared.leading_present(want)]
        with self._lock:
            for offset, key in enumerate(want):
                handle.keys.append(key)
                handle.buffers.append(self.promoter.buffer_locked(key, promote, start + offset, lt))
                handle.tiers.append(lt.name)

    def complete_load(self, handle: LoadHandle, success: bool, first_chunk: int = 0,
                      engine: EngineLoad | None = None) -> None:
        """Unpin a load's chunks; count hits only if ``success``.  Idempotent.

        Args:
            handle: from :meth:`prepare_load`.
            success: whether the chunks reached their destination.
            first_chunk: chunks before this index were pinned but not delivered (the engine's own
                prefix cache already held them); they are not counted as hits.
            engine: what the load did in the engine (tokens by planned tier, blocks not filled,
                bytes and seconds); counted here, once.
        """
        delivered = handle.ready_chunks()  # a caller that did not wait for read-ahead got no more
        if not self._release(handle, refresh=success):
            return
        if engine is not None:
            self.counters.engine_load(engine, self.top.name)
        if not success:
            self.counters.load_failed()
            return
        self.counters.loaded(Counter(handle.tiers[first_chunk:delivered]))

    def cancel_load(self, handle: LoadHandle, engine: EngineLoad | None = None) -> None:
        """Unpin a load that will not happen (request aborted, or nothing left to load).

        Neither a hit nor a failed load is counted; ``engine`` (what the engine was promised
        and did not get) is.  Idempotent.
        """
        if self._release(handle, refresh=False) and engine is not None:
            self.counters.engine_load(engine, self.top.name)

    def load_skipped(self, engine: EngineLoad) -> None:
        """Count a load that never reached the store (its request was aborted before it began)."""
        self.counters.engine_load(engine, self.top.name)

    def _release(self, handle: LoadHandle, refresh: bool) -> bool:
        """Unpin ``handle`` once; on ``refresh`` mark its chunks used.  False if already released."""
        with self._lock:
            if handle.done:
                return False
            handle.done = True
            if handle.reading_ahead:  # unpinned by the read-ahead when its reads end
                handle.release_after_read = refresh
                return True
        self._unpin_handle(handle, refresh)
        return True

    def _unpin_handle(self, handle: LoadHandle, refresh: bool) -> None:
        with self._lock:
            for key in handle.pinned:
                self.top.unpin(key)
            handle.pinned = []
            if refresh and handle.keys:
                self.top.used([k for k in handle.keys if self.top.resident(k)])
                for lt in self._local:
                    used = [k for k, t in zip(handle.keys, handle.tiers) if t == lt.name]
                    if used and lt.policy is not None:
                        lt.policy.touch(used)

    # ---- store ---------------------------------------------------------------------------
    def prepare_store(self, chain: Sequence[ChunkKey], start: int = 0, tenant: TenantId | None = None) -> StoreHandle:
        """Reserve top-tier pages for ``chain[start:]`` chunks not stored yet (see module docstring);
        ``tenant``: who they are saved for, written with them where a tier keeps a tenant record
        (:mod:`kvtier.core.tenant`; ``None``: unknown)."""
        handle = StoreHandle([], [], [], [], tenant=tenant)
        owner = tenant.salt if tenant is not None else None  # the quota's tenant key
        with self._lock:
            handle.epoch = self.top.epoch
            for i in range(start, len(chain)):
                key = chain[i]
                if self.top.holds(key) or any(lt.tier.indexed(key) for lt in self._local):
                    continue
                got = self.cpu.reserve(key) if self.top.free_page(owner) else NoRoom.NO_ROOM
                if got is AlreadyHeld.ALREADY_HELD:  # being promoted from a lower tier: stored when that ends
                    continue
                if got is NoRoom.NO_ROOM:
                    dropped = len(chain) - i
                    self.counters.dropped(dropped)
                    break
                handle.keys.append(key)
                handle.indices.append(i)
                handle.parents.append(chain[i - 1] if i > 0 else None)
                handle.buffers.append(got.buffer)
        return handle

    def complete_store(self, handle: StoreHandle, success: bool, engine: EngineSave | None = None) -> None:
        """Publish (``success``) or release the reserved pages; count ``engine`` (what the copy out
        of the engine moved) when ``success``.  Idempotent."""
        if success and engine is not None and not handle.done:
            self.counters.engine_save(engine, self.top.name)
        with self._lock:
            if handle.done:
                return
            handle.done = True
            success = success and handle.epoch == self.top.epoch  # bytes copied before a reset: not stored
            for key, parent in zip(handle.keys, handle.parents):
                if not success:
                    self.cpu.abort(key)
                    continue
                self.top.publish(key, parent, handle.tenant)
                for lt in self._through:  # a shared server may have lost what this process wrote
                    if lt.shared or not lt.tier.indexed(key):  # (restart, its own eviction, TTL): write
                        self.top.enqueue(lt, WriteJob(key, parent, None, evict_after=False,  # again
                                                      tenant=handle.tenant))
            if success:
                self.counters.saved(len(handle.keys))
                self.top.spill_ahead()

    # ---- TTL pins ----------------------------------------------------------------------------
    def ttl_pin(self, keys: Sequence[ChunkKey], ttl_s: float) -> tuple[int, int]:
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
        deadline = time.monotonic() + ttl_s
        pinned = refused = 0
        with self._lock:
            budget = self._ttl_pin_budget()
            for key in keys:
                if not self.top.resident(key):
                    continue
                if self.top.ttl_pin(key, deadline, budget):
                    pinned += 1
                else:
                    refused += 1
        self.counters.ttl_pinned(pinned, refused)
        return pinned, refused

    def _ttl_pin_budget(self) -> int:
        return int(self.config.pin_max_share * self._pages(self.cpu))

    def _pages(self, cpu: StagingTier) -> int:
        return cpu.num_pages if isinstance(cpu, Paged) else cpu.usage().capacity_bytes // self.chunk_bytes

    # ---- convenience ---------------------------------------------------------------------
    def put(self, chain: Sequence[ChunkKey], datas: Sequence[bytes | memoryview | np.ndarray],
            tenant: TenantId | None = None) -> int:
        """Store ``datas[i]`` (``chunk_bytes`` each) under ``chain[i]`` for ``tenant``; returns chunks newly stored."""
        handle = self.prepare_store(chain, tenant=tenant)
        ok = False
        try:
            t0 = time.perf_counter()
            for idx, buf in zip(handle.indices, handle.buffers):
                np.copyto(buf, np.frombuffer(datas[idx], dtype=np.uint8))
            self.counters.moved("engine_to_cpu", handle.num_chunks * self.chunk_bytes, time.perf_counter() - t0)
            ok = True
        finally:
            self.complete_store(handle, ok)
        return handle.num_chunks

    def get(self, chain: Sequence[ChunkKey]) -> list[bytes]:
        """Bytes of the longest available prefix of ``chain`` (copies)."""
        handle = self.prepare_load(chain, read_ahead=True)
        try:
            out = [buf.tobytes() for buf in handle.buffers[:handle.ready_chunks()]]
            if not handle.wait(READ_AHEAD_WAIT_S):
                raise TimeoutError(f"chunks read ahead from disk did not arrive within {READ_AHEAD_WAIT_S} s")
            out += [buf.tobytes() for buf in handle.buffers[len(out):]]
        except BaseException:
            self.complete_load(handle, False)
            raise
        self.complete_load(handle, True)
        return out

    # ---- other processes' chunk files -----------------------------------------------------
    def rescan(self) -> int:
        """Adopt chunk files other processes wrote into the local lower tiers since start, and
        forget those they removed (:meth:`kvtier.core.tiers.disk.DiskTier.rescan`); both reach the
        change feed, so a scheduler's mirror learns of them.  Runs every ``disk_rescan_s``
        seconds on a background thread when that is set.  Returns the keys adopted or forgotten."""
        return sum(lt.rescan() for lt in self._local)

    def _rescan_loop(self, interval_s: float) -> None:
        while not self._rescan_stop.wait(interval_s):
            try:
                self.rescan()
            except Exception:  # the thread must outlive one bad round (e.g. the directory vanished)
                log.exception("kvtier: rescanning the disk tier failed")

    # ---- lifecycle and checks ------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued writes of every tier are done; False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        done = [lt.flush(deadline) for lt in self.lower]  # every tier, not just up to the first late one
        return all(done)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued writes (up to ``timeout_s``), stop the threads, close the tiers.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._rescan_stop.set()
        if self._rescanner is not None:
            self._rescanner.join(timeout=timeout_s)
        self.flush(timeout_s)
        self.promoter.close()
        for lt in self.lower:
            lt.close()
        self.cpu.close()

    def flush_dirty(self, timeout_s: float) -> tuple[int, int]:
        """Write every dirty top-tier chunk to the local lower tiers, waiting at most ``timeout_s``.

        Used on a graceful stop so that a restart finds the hot set on disk.  Unlike the save
        path, this waits for room in the write queues (until the deadline) instead of dropping.

        Returns:
            ``(written, missed)``: chunks that reached a local lower tier, and chunks still dirty
            at the deadline (counted in ``flush_missed_chunks``).  ``(0, 0)`` without one.
        """
        if not self._local:
            return 0, 0
        deadline = time.monotonic() + max(timeout_s, 0.0)
        before = len(self.dirty_keys())
        for key in self.dirty_keys():
            while time.monotonic() < deadline:
                with self._lock:
                    missing = [lt for lt in self._local if not lt.tier.indexed(key)]
                    if not self.top.resident(key) or key in self.top.writing or not missing:
                        break  # evicted (then staged and queued), already on its way, or written
                    if not any(lt.queue.full() for lt in missing):
                        for lt in missing:
                            self.top.enqueue(lt, WriteJob(key, self.top.parent.get(key), None, evict_after=False,
                                                                  tenant=self.top.tenant.get(key)))
                        break
                time.sleep(0.002)
        while any(lt.queue.unfinished_tasks for lt in self._local) and time.monotonic() < deadline:
            time.sleep(0.005)
        missed = len(self.dirty_keys())
        if missed:
            self.counters.flush_missed(missed)
        return max(before - missed, 0), missed

    def _pinned_locked(self) -> dict[str, int]:
        return {self.cpu.name: len(self.top.pins), **{lt.name: len(lt.pins) for lt in self.lower}}

    def _ttl_pinned_locked(self) -> dict[str, int]:
        self.top.expire_ttl_pins()
        return {self.cpu.name: len(self.top.ttl_pins)}

    def stats(self) -> StoreStats:
        """The store's counters and each tier's usage, as one snapshot (:mod:`kvtier.core.stats`)."""
        with self._lock:
            pinned = self._pinned_locked()
            ttl_pinned = self._ttl_pinned_locked()
            all_tiers = {t.name: t for t in (self.cpu, *(lt.tier for lt in self.lower))}
            ledgers = {self.cpu.name: self.top.quota, **{lt.name: lt.quota for lt in self._local}}
            tiers = {name: TierStats(u.used_bytes, u.capacity_bytes, u.num_chunks, corrupt_chunks=t.corrupt,
                                     pinned_chunks=pinned.get(name, 0), wire=t.wire_stats(),
                                     write_errors=t.write_errors, ttl_pinned_chunks=ttl_pinned.get(name, 0),
                                     **_tenant_stats(ledgers.get(name), u.num_chunks, self.chunk_bytes))
                     for name, t in all_tiers.items() for u in (t.usage(),)}
            return self.counters.snapshot(self.chunk_bytes, self.chunk_tokens, tiers, self.dirty_bytes(),
                                          sum(lt.queue.unfinished_tasks for lt in self.lower))

    def check_integrity(self, expect_idle: bool = True) -> None:
        """Assert the store's invariants (see module docstring).

        Args:
            expect_idle: also require that no chunk is pinned and no write is queued.

        Raises:
            AssertionError: naming the broken invariant.
        """
        with self._lock:
            self.top.check()
            for lt in self.lower:
                lt.check_locked()
            if expect_idle:
                lower_pins = {lt.name: len(lt.pins) for lt in self.lower if lt.pins}
                assert not self.top.pins and not lower_pins, \
                    f"pins left behind: {len(self.top.pins)} {self.cpu.name}, {lower_pins}"
                staged = [k for k, c in self.top.staged.items() if c.pending > 0]  # done ones may wait for the gate
                assert not self.top.writing and not staged and \
                    not any(lt.queue.unfinished_tasks for lt in self.lower), "writes still in flight"


def _tenant_stats(ledger: TenantLedger | None, num_chunks: int, chunk_bytes: int) -> dict[str, Any]:
    """A tier's per-tenant bytes and quota evictions for its :class:`TierStats` (none without quotas)."""
    if ledger is None:
        return {}
    return {"tenant_used_bytes": ledger.usage_by_label(chunk_bytes, num_chunks - len(ledger.owner)),
            "quota_evictions": ledger.quota_evictions}
