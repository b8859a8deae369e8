"""TieredStore: chunk storage across a CPU DRAM tier and an optional disk tier.

Contract (all methods thread-safe; one lock guards metadata, data copies and disk I/O run
outside it on pinned chunks):

- ``lookup(chain) -> int``: how many **leading** chunks of ``chain`` are available in any tier.
  A chunk is only useful if every chunk before it is available, so the count stops at the first
  miss.  No pins; results may be stale by the time a load starts (a load may return fewer chunks,
  never wrong ones).
- ``prepare_load(chain) -> LoadHandle``: pins the longest available prefix.  Chunks found only on
  disk are read and verified into cpu pages (promotion: hot chunks move up).  A chunk that fails
  verification ends the prefix.  ``complete_load(handle, success)`` unpins and, only if
  ``success``, counts hits and refreshes recency.  A failed transfer is never a hit;
  ``cancel_load(handle)`` unpins a load that will not happen without counting anything.
- ``prepare_store(chain, start) -> StoreHandle``: reserves cpu pages for the chunks not yet
  stored; reserved pages are invisible to lookups and cannot be evicted.
  ``complete_store(handle, success)`` publishes them or gives them back.
- Both ``complete_*`` must be called on every path (``try/finally``); calling twice is a no-op.
- Eviction: when the cpu tier needs a page, the policy's victim (never a pinned chunk) leaves.
  In ``write-back`` mode a victim not yet on disk is copied to a staging buffer and queued for
  the disk (spill); in ``write-through`` mode every stored chunk is queued for the disk at once.
  The queue is bounded (``save_queue_depth``): when it is full the disk write is dropped and
  counted in ``dropped_saves``; callers are never blocked.  A background spill keeps
  ``spill_watermark`` of the cpu pages free so that saves rarely wait on eviction.
- ``check_integrity()``: used + free == capacity per tier, policies track exactly the resident
  chunks, and no pins remain (call it once all requests are done).

Sizes: ``chunk_bytes`` is the payload of one chunk; capacities come from
:class:`~kvtier.core.config.KVTierConfig` divided by ``tp_size`` (sizes are totals across ranks).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from kvtier.core.changes import ChangeFeedMixin
from kvtier.core.config import KVTierConfig
from kvtier.core.handles import LoadHandle, StoreHandle
from kvtier.core.keys import ChunkKey, Namespace
from kvtier.core.metrics import StoreMetrics
from kvtier.core.policies import make_policy
from kvtier.core.sizing import make_cpu_tier
from kvtier.core.spill import SpillMixin, WriteJob
from kvtier.core.tiers.disk import DiskTier

log = logging.getLogger(__name__)


class TieredStore(SpillMixin, ChangeFeedMixin):
    """The tiered chunk store; see the module docstring for the contract.

    Args:
        config: kvtier configuration.
        namespace: what the stored bytes depend on; selects the disk tier's directory.
        chunk_bytes: bytes of one chunk's KV (all layers of this rank), > 0.
        tp_size: tensor-parallel size; capacities are per rank (total / tp_size).
        registry: prometheus registry to register metrics in (a fresh one by default).

    Raises:
        ValueError: ``chunk_bytes`` not positive.
        OSError: the disk directory cannot be created.
    """

    def __init__(self, config: KVTierConfig, namespace: Namespace, chunk_bytes: int, tp_size: int = 1,
                 registry: CollectorRegistry | None = None) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.config = config
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        self.chunk_tokens = config.chunk_tokens
        self.metrics = StoreMetrics(registry)
        self.metrics.set_config({**config.model_dump(), "chunk_bytes": chunk_bytes, "tp_size": tp_size,
                                 "namespace": namespace.digest().hex()})
        self._lock = threading.RLock()
        self._init_feed()
        self.counters: Counter[str] = Counter()
        self.cpu = make_cpu_tier(config, chunk_bytes, tp_size)
        self.cpu_policy = make_policy(config.policy)
        self.disk: DiskTier | None = None
        self.disk_policy = make_policy(config.policy)
        if config.disk_path and config.disk_bytes_per_rank(tp_size) > 0:
            self.disk = DiskTier(config.disk_path, namespace.digest(), config.disk_bytes_per_rank(tp_size),
                                 fsync=config.disk_fsync, io=config.disk_io, io_threads=config.io_threads)
            for key in self.disk.keys():  # noqa: SIM118 - a list, oldest first
                self.disk_policy.insert(key, None)
            self._trim_disk()
        self._disk_generation = 0
        self._pins: Counter[ChunkKey] = Counter()
        self._disk_pins: Counter[ChunkKey] = Counter()
        self._spilling: set[ChunkKey] = set()
        self._staged: dict[ChunkKey, np.ndarray] = {}  # evicted from cpu, queued for disk, still servable
        self._parent: dict[ChunkKey, ChunkKey | None] = {}
        self._queue: queue.Queue[WriteJob | None] = queue.Queue(maxsize=config.save_queue_depth)
        self._workers: list[threading.Thread] = []
        self._readers: ThreadPoolExecutor | None = None
        if self.disk is not None:
            self._readers = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvtier-read")
            for i in range(config.io_threads):
                t = threading.Thread(target=self._write_loop, name=f"kvtier-write-{i}", daemon=True)
                t.start()
                self._workers.append(t)
        self.metrics.capacity_bytes.labels("cpu").set(self.cpu.usage().capacity_bytes)
        self.metrics.capacity_bytes.labels("disk").set(self.disk.capacity_bytes if self.disk else 0)
        self._closed = False

    # ---- lookup --------------------------------------------------------------------------
    def lookup(self, chain: Sequence[ChunkKey]) -> int:
        """Leading chunks of ``chain`` available in any tier (see module docstring)."""
        start = time.perf_counter()
        found = Counter[str]()
        with self._lock:
            n = 0
            for key in chain:
                if self.cpu.contains(key) or key in self._staged:
                    found["cpu"] += 1
                elif self.disk is not None and self.disk.contains(key):
                    found["disk"] += 1
                else:
                    break
                n += 1
        m = self.metrics
        m.lookups_chunks.inc(len(chain))
        m.lookups_tokens.inc(len(chain) * self.chunk_tokens)
        for tier, count in found.items():
            m.lookup_hit_chunks.labels(tier).inc(count)
            m.lookup_hit_tokens.labels(tier).inc(count * self.chunk_tokens)
        m.lookup_seconds.observe(time.perf_counter() - start)
        return n

    # ---- load ----------------------------------------------------------------------------
    def prepare_load(self, chain: Sequence[ChunkKey], max_chunks: int | None = None) -> LoadHandle:
        """Pin and return the longest available prefix of ``chain`` (at most ``max_chunks``)."""
        limit = len(chain) if max_chunks is None else min(max_chunks, len(chain))
        handle = LoadHandle([], [], [])
        promote: list[tuple[int, ChunkKey, np.ndarray, bool]] = []  # (pos, key, buffer, reserved page)
        with self._lock:
            for i in range(limit):
                key = chain[i]
                if self.cpu.contains(key):
                    self._pins[key] += 1
                    handle.pinned.append(key)
                    handle.keys.append(key)
                    handle.buffers.append(self.cpu.view(key))
                    handle.tiers.append("cpu")
                elif key in self._staged:  # a private copy, immutable: no pin needed
                    handle.keys.append(key)
                    handle.buffers.append(self._staged[key])
                    handle.tiers.append("cpu")
                elif self.disk is not None and self.disk.contains(key):
                    self._disk_pins[key] += 1
                    page = self.cpu.reserve(key) if self._free_page_locked() else None
                    buf = page if page is not None else np.empty(self.chunk_bytes, dtype=np.uint8)
                    promote.append((i, key, buf, page is not None))
                    handle.keys.append(key)
                    handle.buffers.append(buf)
                    handle.tiers.append("disk")
                else:
                    break
        if promote:
            self._promote(chain, handle, promote)
        else:
            self._update_usage()
        return handle

    def _promote(self, chain: Sequence[ChunkKey], handle: LoadHandle,
                 promote: list[tuple[int, ChunkKey, np.ndarray, bool]]) -> None:
        assert self.disk is not None and self._readers is not None
        disk = self.disk
        t0 = time.perf_counter()
        oks = list(self._readers.map(lambda job: disk.get_into(job[1], memoryview(job[2])), promote))
        seconds = time.perf_counter() - t0
        failed = [pos for (pos, *_rest), ok in zip(promote, oks) if not ok]
        cut = min(failed) if failed else None  # handle position == chain position (a prefix)
        with self._lock:
            for (pos, key, _buf, reserved), ok in zip(promote, oks):
                self._disk_pins[key] -= 1
                if self._disk_pins[key] <= 0:
                    del self._disk_pins[key]
                if not ok:
                    self.counters["corrupt_chunks"] += 1
                    self.metrics.corrupt_chunks.labels("disk").inc()
                    self.disk_policy.remove(key)
                    self._note_locked(key)
                if cut is not None and pos >= cut:
                    if reserved:
                        self.cpu.abort(key)
                    continue
                if reserved:
                    self.cpu.commit(key)
                    parent = chain[pos - 1] if pos > 0 else None
                    self._parent[key] = parent
                    self.cpu_policy.insert(key, parent)
                    self._note_locked(key)
                    self._pins[key] += 1
                    handle.pinned.append(key)
            if cut is not None:  # everything from the first unusable chunk on is dropped
                for key in handle.keys[cut:]:
                    if key in handle.pinned:
                        handle.pinned.remove(key)
                        self._unpin_locked(key)
                del handle.keys[cut:], handle.buffers[cut:], handle.tiers[cut:]
        loaded = sum(1 for (pos, *_r), ok in zip(promote, oks) if ok and (cut is None or pos < cut))
        self.metrics.moved("disk_to_cpu", loaded * self.chunk_bytes, seconds)
        self._update_usage()

    def complete_load(self, handle: LoadHandle, success: bool, first_chunk: int = 0) -> None:
        """Unpin a load's chunks; count hits only if ``success``.  Idempotent.

        Args:
            handle: from :meth:`prepare_load`.
            success: whether the chunks reached their destination.
            first_chunk: chunks before this index were pinned but not delivered (the engine's own
                prefix cache already held them); they are not counted as hits.
        """
        if not self._release(handle, refresh=success):
            return
        if not success:
            self.counters["failed_loads"] += 1
            self.metrics.failed_loads.inc()
            return
        by_tier = Counter(handle.tiers[first_chunk:])
        for tier, count in by_tier.items():
            self.counters[f"hits_{tier}"] += count
            self.metrics.load_hit_chunks.labels(tier).inc(count)
            self.metrics.load_hit_tokens.labels(tier).inc(count * self.chunk_tokens)

    def cancel_load(self, handle: LoadHandle) -> None:
        """Unpin a load that will not happen (request aborted, or nothing left to load).

        Neither a hit nor a failed load is counted.  Idempotent.
        """
        self._release(handle, refresh=False)

    def _release(self, handle: LoadHandle, refresh: bool) -> bool:
        """Unpin ``handle`` once; on ``refresh`` mark its chunks used.  False if already released."""
        with self._lock:
            if handle.done:
                return False
            handle.done = True
            for key in handle.pinned:
                self._unpin_locked(key)
            handle.pinned = []
            if refresh and handle.keys:
                self.cpu_policy.touch([k for k in handle.keys if self.cpu.contains(k)])
                on_disk = [k for k, t in zip(handle.keys, handle.tiers) if t == "disk"]
                if on_disk:
                    self.disk_policy.touch(on_disk)
        self._update_usage()
        return True

    def _unpin_locked(self, key: ChunkKey) -> None:
        self._pins[key] -= 1
        if self._pins[key] <= 0:
            del self._pins[key]

    # ---- store ---------------------------------------------------------------------------
    def prepare_store(self, chain: Sequence[ChunkKey], start: int = 0) -> StoreHandle:
        """Reserve cpu pages for ``chain[start:]`` chunks not stored yet (see module docstring)."""
        handle = StoreHandle([], [], [], [])
        with self._lock:
            for i in range(start, len(chain)):
                key = chain[i]
                if self.cpu.contains(key) or key in self._staged or \
                        (self.disk is not None and self.disk.indexed(key)):
                    continue
                page = self.cpu.reserve(key) if self._free_page_locked() else None
                if page is None:
                    dropped = len(chain) - i
                    self.counters["dropped_saves"] += dropped
                    self.metrics.dropped_saves.inc(dropped)
                    break
                handle.keys.append(key)
                handle.indices.append(i)
                handle.parents.append(chain[i - 1] if i > 0 else None)
                handle.buffers.append(page)
        return handle

    def complete_store(self, handle: StoreHandle, success: bool) -> None:
        """Publish (``success``) or release the reserved pages.  Idempotent."""
        with self._lock:
            if handle.done:
                return
            handle.done = True
            for key, parent in zip(handle.keys, handle.parents):
                if not success:
                    self.cpu.abort(key)
                    continue
                self.cpu.commit(key)
                self._parent[key] = parent
                self.cpu_policy.insert(key, parent)
                self._note_locked(key)
                if self.disk is not None and self.config.write_mode == "write-through":
                    self._enqueue_locked(WriteJob(key, parent, None, evict_after=False))
            if success:
                self.counters["saved_chunks"] += len(handle.keys)
                self._spill_ahead_locked()
        self._update_usage()

    # ---- convenience ---------------------------------------------------------------------
    def put(self, chain: Sequence[ChunkKey], datas: Sequence[bytes | memoryview | np.ndarray]) -> int:
        """Store ``datas[i]`` (``chunk_bytes`` each) under ``chain[i]``; returns chunks newly stored."""
        handle = self.prepare_store(chain)
        ok = False
        try:
            t0 = time.perf_counter()
            for idx, buf in zip(handle.indices, handle.buffers):
                np.copyto(buf, np.frombuffer(datas[idx], dtype=np.uint8))
            self.metrics.moved("engine_to_cpu", handle.num_chunks * self.chunk_bytes, time.perf_counter() - t0)
            ok = True
        finally:
            self.complete_store(handle, ok)
        return handle.num_chunks

    def get(self, chain: Sequence[ChunkKey]) -> list[bytes]:
        """Bytes of the longest available prefix of ``chain`` (copies)."""
        handle = self.prepare_load(chain)
        try:
            out = [buf.tobytes() for buf in handle.buffers]
        except BaseException:
            self.complete_load(handle, False)
            raise
        self.complete_load(handle, True)
        return out

    # ---- lifecycle and checks ------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued disk writes are done; False if ``timeout_s`` passed first."""
        if timeout_s is None:
            self._queue.join()
            return True
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued writes (up to ``timeout_s``) and stop the worker threads.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout_s)
        for _ in self._workers:
            try:
                self._queue.put(None, timeout=1.0)
            except queue.Full:
                break
        for t in self._workers:
            t.join(timeout=5.0)
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()

    def _update_usage(self) -> None:
        m = self.metrics
        m.usage_bytes.labels("cpu").set(self.cpu.usage().used_bytes)
        if self.disk is not None:
            m.usage_bytes.labels("disk").set(self.disk.usage().used_bytes)
        for tier, pins in (("cpu", len(self._pins)), ("disk", len(self._disk_pins))):
            m.pinned_chunks.labels(tier).set(pins)
            m.pinned_bytes.labels(tier).set(pins * self.chunk_bytes)
        m.dirty_bytes.set(self.dirty_bytes())

    def stats(self) -> dict[str, Any]:
        """Counters and usage, as plain numbers (for tests, logs and ``bench-store``)."""
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
            out["cpu"] = self.cpu.usage()._asdict()
            out["disk"] = self.disk.usage()._asdict() if self.disk else None
            out["corrupt_chunks"] = self.disk.corrupt if self.disk else 0
            out["pinned"] = sum(self._pins.values()) + sum(self._disk_pins.values())
            out["pinned_chunks"] = {"cpu": len(self._pins), "disk": len(self._disk_pins)}
            out["dirty_bytes"] = self.dirty_bytes()
            out["queued_writes"] = self._queue.unfinished_tasks
            return out

    def check_integrity(self, expect_idle: bool = True) -> None:
        """Assert the store's invariants (see module docstring).

        Args:
            expect_idle: also require that no chunk is pinned and no write is queued.

        Raises:
            AssertionError: naming the broken invariant.
        """
        with self._lock:
            self.cpu.check()
            usage = self.cpu.usage()
            assert usage.used_bytes + usage.free_bytes == usage.capacity_bytes
            resident = set(self.cpu.keys())
            tracked = set(self.cpu_policy.keys())
            assert resident == tracked, \
                f"cpu policy tracks {len(tracked)} chunks but {len(resident)} are resident"
            if self.disk is not None:
                self.disk.check()
                d = self.disk.usage()
                assert d.used_bytes + d.free_bytes == d.capacity_bytes
                stray = set(self.disk_policy.keys()) - set(self.disk.keys())
                assert not stray, f"disk policy tracks {len(stray)} chunks that are not on disk"
            if expect_idle:
                assert not self._pins and not self._disk_pins, \
                    f"pins left behind: {len(self._pins)} cpu, {len(self._disk_pins)} disk"
                assert not self._spilling and not self._staged and self._queue.unfinished_tasks == 0, \
                    "disk writes still in flight"
