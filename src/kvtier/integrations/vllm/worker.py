"""Worker side of the connector: owns this rank's store and bytes, moves blocks in and out.

- ``register_kv_caches``: request AMX tile permission (see below), detect the layout, build the
  namespace (with the identity fingerprint) and the rank's :class:`~kvtier.core.store.TieredStore`.
- ``start_load``: hand each load job to the :class:`~kvtier.integrations.vllm.loader.AsyncLoader`
  (returns at once), or, for a synchronous job (a cpu-tier hit within ``sync_load_max_bytes``),
  copy it here before the forward; ``finished_loads`` reports ended asynchronous loads (vLLM's
  ``get_finished``) and ``take_errors`` the blocks any load could not fill
  (``get_block_ids_with_load_errors``).  In a step that computes no tokens
  (``KVTierMetadata.no_forward``) with a load in flight, ``finished_loads`` first waits up to
  ``idle_step_wait_s`` for one to end, so an engine whose requests are all parked does not spin.
- ``save``: after the forward pass, copy each save job's full chunks out of the engine into cpu
  pages and publish them (a bounded memcpy on the engine's thread); disk writes then happen on
  the store's threads through its bounded queue (full: dropped and counted).  The copy is done
  when the call returns, so no save outlives the blocks it reads and vLLM may free them at once.
- ``worker_meta``: this rank's index changes for the scheduler's mirror (vLLM carries them).
- a reset order (``KVTierMetadata.reset``): applied in ``start_load`` before the step's loads:
  the store is cleared (:meth:`~kvtier.core.store.TieredStore.clear`), loads started before it
  end failed (:class:`~kvtier.integrations.vllm.loader.AsyncLoader` compares the store's epoch),
  and the next report carries the order's epoch with a full snapshot.
- ``shutdown``: stop loading, write dirty DRAM chunks to disk within ``shutdown_flush_s``
  (what misses the deadline is counted and logged), stop the store.

AMX: on Intel CPUs with AMX, a process must ask the kernel for permission to use AMX tiles
before its first AMX instruction.  oneDNN asks on its first large bf16 GEMM, which a cold prefill
always has; a fresh engine whose very first forward runs over connector-loaded KV reaches vLLM's
AMX attention kernel first and dies with SIGILL.  ``torch._C._cpu._init_amx()`` (where it exists)
asks up front.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from typing import Any

import torch

from kvtier.core.config import KVTierConfig
from kvtier.core.handles import EngineSave
from kvtier.core.keys import ChunkKey, Namespace
from kvtier.core.stats import StoreStats
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.group_io import GroupCopiers
from kvtier.integrations.vllm.groups import GroupKind, engine_plan, resolved_config
from kvtier.integrations.vllm.identity import effective_config_digest, model_fingerprint
from kvtier.integrations.vllm.layout import KVLayout, detect_group_layouts, detect_layout
from kvtier.integrations.vllm.loader import AsyncLoader
from kvtier.integrations.vllm.protocol import (
    KVTierMetadata,
    KVTierWorkerMeta,
    RankReport,
    ResetOrder,
    SaveJob,
)
from kvtier.integrations.vllm.stats import KVTierStats, store_counters, store_gauges

log = logging.getLogger(__name__)

MAX_INDEX_CHANGES = 4096  # index changes per rank per step sent to the scheduler (a snapshot goes whole)
ENGINE_RESCAN_S = 2.0
"""``disk_rescan_s`` of an engine that leaves it unset: it learns of the chunk files other engines
sharing its disk directory wrote or removed this often (the disk tier's lookups never touch the
filesystem, :meth:`~kvtier.core.tiers.disk.tier.DiskTier.contains`)."""


def role_config(config: KVTierConfig, kv_role: str | None) -> KVTierConfig:
    """``config`` with the engine's defaults: with a disk tier, every role rescans the directory
    every :data:`ENGINE_RESCAN_S` seconds (``disk_rescan_s`` unset; an explicit value, 0
    included, is kept): a consumer for a producer's new chunks, replicas for each other's, and
    every engine for the files the others evicted, so that engines on one directory bound it
    together."""
    if config.disk_rescan_s is None and config.disk_path:
        return config.model_copy(update={"disk_rescan_s": ENGINE_RESCAN_S})
    return config


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - parallel state not initialised (single-process tools)
        return 0


def _backend_name(vllm_config: Any, layer_name: str) -> str:
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    backend = getattr(ctx.get(layer_name), "attn_backend", None)
    try:
        return str(backend.get_name()) if backend is not None else "unknown"
    except Exception:  # noqa: BLE001 - the name only labels the namespace
        return "unknown"


def request_amx_permission() -> bool:
    """Ask the kernel for AMX tile permission (``torch._C._cpu._init_amx``); False where unavailable."""
    init_amx = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if init_amx is None:
        return False
    try:
        return bool(init_amx())
    except Exception:  # noqa: BLE001 - no AMX on this CPU: nothing to ask for
        return False


def build_namespace(vllm_config: Any, kv_cache_config: Any, layout: KVLayout, config: KVTierConfig,
                    tp_size: int, tp_rank: int, fingerprint: str,
                    group_layouts: dict[int, KVLayout] | None = None) -> Namespace:
    """Everything that changes this rank's KV bytes (see :class:`kvtier.core.keys.Namespace`).

    ``group_layouts`` (hybrid models): every KV cache group's layout, all in the namespace.
    ``config.chunk_tokens`` must be resolved
    (:func:`~kvtier.integrations.vllm.groups.resolved_config`): two engines whose chunk sizes
    differ never share a key space.

    Raises:
        TypeError: ``config.chunk_tokens`` is still ``"auto"``.
    """
    if not isinstance(config.chunk_tokens, int):
        raise TypeError("build_namespace needs a resolved chunk_tokens (an int); call resolved_config first")
    model_config = vllm_config.model_config
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    names = list(layout.layer_names)
    description = layout.describe()
    spec_names = type(spec).__name__
    if group_layouts:
        names = [n for g in sorted(group_layouts) for n in group_layouts[g].layer_names]
        description = "|".join(f"g{g}={group_layouts[g].describe()}" for g in sorted(group_layouts))
        spec_names = ",".join(type(grp.kv_cache_spec).__name__ for grp in kv_cache_config.kv_cache_groups)
    layers = hashlib.blake2b("\0".join(names).encode(), digest_size=8).hexdigest()
    kv_layout = getattr(kv_cache_config, "kv_cache_layout", None)
    return Namespace(
        model=f"{model_config.model}@{model_config.revision or ''}",
        kv_dtype=f"{vllm_config.cache_config.cache_dtype}:{str(layout.dtype).removeprefix('torch.')}",
        num_layers=len(names),
        num_kv_heads=int(getattr(spec, "num_kv_heads", 0)),
        head_size=int(getattr(spec, "head_size", 0)),
        layout=description,
        tp_size=tp_size,
        tp_rank=tp_rank,
        chunk_tokens=config.chunk_tokens,
        extra=(("block_size", str(vllm_config.cache_config.block_size)),
               ("identity", fingerprint),
               ("effective_config", effective_config_digest(model_config)),
               ("weights", _weights_source(vllm_config)),
               ("kv_cache_layout", str(getattr(kv_layout, "name", kv_layout))),
               ("layers", layers),
               ("spec", spec_names)),
    )


def _weights_source(vllm_config: Any) -> str:
    """``"dummy"`` when vLLM makes up the weights (``--load-format dummy``), else ``"files"``: KV of
    made-up weights must never meet KV of the real ones, whatever the files on disk are."""
    load_format = getattr(getattr(vllm_config, "load_config", None), "load_format", None)
    return "dummy" if str(getattr(load_format, "value", load_format)) == "dummy" else "files"


def key_root(namespace: Namespace) -> bytes:
    """The root chunk keys are chained from: the namespace minus the rank, so every rank (and the
    scheduler's mirror) names a chunk alike while each rank's bytes live in its own directory."""
    return dataclasses.replace(namespace, tp_rank=-1).digest()


class WorkerSide:
    """Per-rank state of the worker-side connector."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: KVTierConfig) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.config = config = resolved_config(config, kv_cache_config)  # ConfigError: a misfit chunk_tokens
        assert isinstance(config.chunk_tokens, int)
        self.chunk_tokens: int = config.chunk_tokens
        self.block_size = vllm_config.cache_config.block_size
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = _tp_rank()
        self.store: TieredStore | None = None
        self.loader: AsyncLoader | None = None
        self.layout: KVLayout | None = None
        self.key_root = b""
        self.namespace = b""
        self._store_seen: StoreStats | None = None
        self._busy = False  # chunks pinned at the last stats() (loads or disk writes in flight)
        self._busy_reported: bool | None = None  # busy as last told to the scheduler
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        # this step's synchronous loads that came up short: req -> first chunk not filled
        self._sync_cut: dict[str, int] = {}
        self._no_forward = False  # this step computes no tokens: finished_loads may wait (idle_step_wait_s)
        self._closed = False
        self.reset_epoch = 0  # the last reset order applied (RankReport.epoch)
        self.plan = engine_plan(vllm_config, kv_cache_config, self.chunk_tokens)
        # saved tokens are counted on one group's pages: the first full-attention group (none: not counted)
        self._token_group = next((g.index for g in self.plan.groups if g.kind is GroupKind.FULL), -1)
        self.groups: GroupCopiers | None = None

    # ---- setup -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        mc = self.vllm_config.model_config
        fingerprint = model_fingerprint(str(mc.model), mc.revision, getattr(mc, "tokenizer", None))
        if self.plan.is_hybrid:
            self._register_groups(kv_caches, fingerprint)
            return
        first = next(iter(kv_caches), "")
        self.layout = detect_layout(kv_caches, self.kv_cache_config.num_blocks,
                                    _backend_name(self.vllm_config, first))
        amx = request_amx_permission() if self.layout.device == "cpu" else False
        namespace = build_namespace(self.vllm_config, self.kv_cache_config, self.layout, self.config,
                                    self.tp_size, self.tp_rank, fingerprint)
        self.key_root = key_root(namespace)
        self.namespace = namespace.digest()
        self.groups = GroupCopiers(self.plan, {self.plan.groups[0].index: self.layout}, kv_caches)
        self.store = TieredStore(self.config, namespace, self.groups.page_bytes, self.tp_size)
        self._pin_top_tier()
        self._start_loader()
        log.info("kvtier: rank %d layout %s, chunk %d tokens = %d bytes, namespace %s, identity %s, AMX %s",
                 self.tp_rank, self.layout.describe(), self.chunk_tokens, self.store.chunk_bytes,
                 namespace.digest().hex(), fingerprint, "requested" if amx else "not available")
        self._warn_small_cpu_tier()

    def _pin_top_tier(self) -> None:
        """KV cache on a GPU: register the top tier's pages as pinned host memory, so the copy path
        DMAs straight between engine blocks and tier pages (a failure is logged by the tier, and the
        copies stage through a pinned buffer)."""
        assert self.store is not None and self.layout is not None
        if self.layout.device.startswith("cuda"):
            t0 = time.monotonic()
            pinned = self.store.cpu.pin_host_memory()
            log.info("kvtier: rank %d top tier pages %s (%.1f s)", self.tp_rank,
                     "pinned: GPU copies go straight to them" if pinned else "pageable: GPU copies are staged",
                     time.monotonic() - t0)

    def _start_loader(self) -> None:
        """The loader: block-level load errors where vLLM takes them (one full-attention KV cache
        group), a load that succeeds or fails whole otherwise."""
        assert self.store is not None and self.groups is not None
        one_group = len(self.kv_cache_config.kv_cache_groups) == 1 and self.plan.groups[0].kind is GroupKind.FULL
        self.loader = AsyncLoader(self.store, self.groups, self.chunk_tokens, self.config.io_threads,
                                  partial=one_group, wait_s=self.config.load_wait_s)

    def _warn_small_cpu_tier(self) -> None:
        """Warn when the cpu tier cannot hold one longest prompt plus the disk write queue.

        Every saved chunk passes through a cpu page, and with a disk tier each queued write pins its
        page until written (up to ``save_queue_depth``); with fewer pages, saves are dropped
        (``kvtier_dropped_saves_total``) even though the config is valid.
        """
        assert self.store is not None
        pages = self.store.cpu.usage().capacity_bytes // self.store.chunk_bytes
        longest = -(-self.vllm_config.model_config.max_model_len // self.chunk_tokens)
        queued = self.config.save_queue_depth if self.config.disk_path and self.config.disk_gib > 0 else 0
        if pages < longest + queued:
            need_gib = (longest + queued) * self.store.chunk_bytes * self.tp_size / (1 << 30)
            log.warning("kvtier: rank %d cpu tier holds %d chunks, fewer than one max_model_len prompt (%d chunks) "
                        "plus the disk write queue (save_queue_depth %d): saves will be dropped "
                        "(kvtier_dropped_saves_total); raise cpu_gib to at least %.3f", self.tp_rank, pages,
                        longest, queued, need_gib)

    def _register_groups(self, kv_caches: dict[str, torch.Tensor], fingerprint: str) -> None:
        """Hybrid model: one layout and copier per KV cache group, pages of the largest group's size."""
        layouts = detect_group_layouts(kv_caches, self.kv_cache_config,
                                       lambda name: _backend_name(self.vllm_config, name))
        first = layouts[min(layouts)]
        self.layout = first
        amx = request_amx_permission() if first.device == "cpu" else False
        namespace = build_namespace(self.vllm_config, self.kv_cache_config, first, self.config,
                                    self.tp_size, self.tp_rank, fingerprint, group_layouts=layouts)
        self.key_root = key_root(namespace)
        self.namespace = namespace.digest()  # reported to the scheduler, which asks the shared tier under it
        self.groups = GroupCopiers(self.plan, layouts, kv_caches)
        self.store = TieredStore(self.config, namespace, self.groups.page_bytes, self.tp_size)
        self._pin_top_tier()
        self._start_loader()
        log.info("kvtier: rank %d hybrid model, %s; chunk %d tokens, page %d bytes, namespace %s, identity %s, "
                 "AMX %s", self.tp_rank, ", ".join(f"group {g.index} {g.kind.value} {layouts[g.index].describe()}"
                                                   for g in self.plan.groups),
                 self.chunk_tokens, self.groups.page_bytes, namespace.digest().hex(), fingerprint,
                 "requested" if amx else "not available")

    # ---- loads -------------------------------------------------------------------------------
    def start_load(self, meta: KVTierMetadata) -> None:
        """This step's reset order, then its loads: asynchronous ones handed to the loader threads,
        synchronous ones (``LoadJob.sync``) copied here, before the forward; their unfilled blocks
        are this step's load errors and their requests' saves this step stop at the first chunk
        not filled (KV computed over a block that was not loaded is wrong)."""
        assert self.loader is not None
        self._sync_cut = {}
        self._no_forward = meta.no_forward
        if meta.reset is not None:
            self.apply_reset(meta.reset)
        for job in meta.loads:
            if job.sync:
                errors, first_unfilled = self.loader.load_now(job)
                self._errors |= errors
                if first_unfilled is not None:
                    self._sync_cut[job.req_id] = first_unfilled
            else:
                self.loader.submit(job)

    def finished_loads(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose load ended (either way) since the last call; ``finished_req_ids``
        (requests vLLM finished) lets loads not started yet be skipped.

        In a step that computes no tokens (the last :meth:`start_load`'s ``meta.no_forward``) with a
        load in flight, it first blocks until a load ends or ``idle_step_wait_s`` passes (every rank
        the same bound at most), and a load that ended meanwhile is in this call's answer: vLLM
        would otherwise run the next empty step at once, spinning the engine's thread against the
        loader threads.  A step that computes tokens never waits."""
        if self.loader is None:
            return set()
        if finished_req_ids:
            self.loader.abort(finished_req_ids)
        no_forward, self._no_forward = self._no_forward, False  # one wait per step at most
        if no_forward and self.config.idle_step_wait_s > 0:
            self.loader.wait_ended(self.config.idle_step_wait_s)
        finished, errors, failed = self.loader.take()
        self._errors |= errors
        self._failed |= failed
        return finished

    def take_failed(self) -> set[str]:
        """Requests whose load failed whole (several KV cache groups: vLLM recomputes them from the start)."""
        failed, self._failed = self._failed, set()
        return failed

    def take_errors(self) -> set[int]:
        """Blocks of ended loads that could not be filled (vLLM recomputes from the first one)."""
        errors, self._errors = self._errors, set()
        return errors

    def apply_reset(self, order: ResetOrder) -> None:
        """Clear ``order.tiers`` of this rank's store (see the module docstring); a tier that could not
        be cleared whole is logged (the scheduler has already answered vLLM)."""
        assert self.store is not None
        t0 = time.monotonic()
        results = self.store.clear(order.tiers)
        self.reset_epoch = order.epoch
        problems = [f"{tier}: {r.reason}" for tier, r in results.items() if not r.ok]
        log.info("kvtier: rank %d reset %d cleared %s in %.2f s%s", self.tp_rank, order.epoch,
                 ", ".join(f"{tier} ({len(r.keys)} chunks)" for tier, r in results.items()) or "nothing",
                 time.monotonic() - t0, f"; not whole: {'; '.join(problems)}" if problems else "")

    # ---- saves -------------------------------------------------------------------------------
    def save(self, meta: KVTierMetadata) -> None:
        for job in meta.saves:
            cut = self._sync_cut.get(job.req_id)
            if cut is not None:  # its synchronous load came up short: chunks from there on hold wrong KV
                job = dataclasses.replace(job, pages=tuple(p for p in job.pages if p.chunk < cut))
                if not job.pages:
                    continue
            try:
                self._save_one(job)
            except Exception:  # a failed save is a future miss, never an engine failure
                log.exception("kvtier: saving request %s's chunks failed", job.req_id)

    def _save_one(self, job: SaveJob) -> None:
        """Copy the job's pages not stored yet out of the engine; the store counts what was saved.
        Then pin the prompt's pages the job names when the request asked for a TTL pin."""
        assert self.store is not None and self.groups is not None
        store = self.store
        chain = [ChunkKey(job.parent)] if job.parent else []
        chain += [ChunkKey(p.key) for p in job.pages]
        first = len(chain) - len(job.pages)  # the parent only names the first page's parent
        t0 = time.perf_counter()
        handle = store.prepare_store(chain, start=first, tenant=job.tenant)
        if handle.num_chunks:
            stored = [job.pages[i - first] for i in handle.indices]
            ok = False
            try:
                self.groups.save(list(zip(stored, handle.buffers)))
                ok = True
            finally:
                # tokens: those of the full-attention chunks stored (one group's pages count each chunk once)
                tokens = sum(1 for p in stored if p.group == self._token_group) * self.chunk_tokens
                store.complete_store(handle, ok, EngineSave(tokens, self.groups.moved_bytes(stored),
                                                            time.perf_counter() - t0))
        if job.pin_s > 0:
            store.ttl_pin([ChunkKey(p.key) for p in job.pages if p.chunk < job.pin_chunks], job.pin_s)

    # ---- worker -> scheduler -----------------------------------------------------------------
    def worker_meta(self) -> KVTierWorkerMeta | None:
        """This rank's index changes since the last step (the first one is a full snapshot)."""
        if self.store is None:
            return None
        delta = self.store.drain_changes(MAX_INDEX_CHANGES)
        if not delta.changes and not delta.full and self._busy == self._busy_reported:
            return None
        self._busy_reported = self._busy
        report = RankReport(self.key_root, [(bytes(key), tier) for key, tier in delta.changes], delta.full,
                            self.namespace, busy=self._busy, epoch=self.reset_epoch)
        return KVTierWorkerMeta({self.tp_rank: report})

    # ---- metrics and lifecycle ---------------------------------------------------------------
    def stats(self) -> KVTierStats | None:
        """The change of the store's snapshot since the last call, and its usage.

        Sent every step, even unchanged: vLLM sums one step's reports over the tensor-parallel
        ranks, so a rank that skipped an unchanged report would drop out of the summed gauges."""
        if self.store is None:
            return None
        snapshot = self.store.stats()
        counters = store_counters(snapshot, self._store_seen, self.tp_rank)
        self._store_seen = snapshot
        gauges = dict(store_gauges(snapshot))
        self._busy = snapshot.queued_writes > 0 or any(t.pinned_chunks for t in snapshot.tiers.values())
        if self.tp_rank == 0:  # vLLM sums the ranks' gauges: one rank reports the engine's chunk size
            gauges["chunk_tokens"] = self.chunk_tokens
        return KVTierStats(data={"counters": counters, "gauges": gauges})

    def shutdown(self) -> None:
        """Stop loading, flush dirty chunks to disk within ``shutdown_flush_s``, stop the store.  Idempotent."""
        if self._closed or self.store is None:
            return
        self._closed = True
        if self.loader is not None:
            self.loader.shutdown()
        t0 = time.monotonic()
        written, missed = self.store.flush_dirty(self.config.shutdown_flush_s)
        if missed:
            log.warning("kvtier: rank %d shutdown flush wrote %d dirty chunks to disk in %.1f s; %d (%.1f MiB) "
                        "missed shutdown_flush_s=%s and are lost", self.tp_rank, written, time.monotonic() - t0,
                        missed, missed * self.store.chunk_bytes / (1 << 20), self.config.shutdown_flush_s)
        else:  # logged with nothing dirty too, so that an operator can tell the graceful path ran
            log.info("kvtier: rank %d shutdown flush wrote %d dirty chunks to disk in %.1f s",
                     self.tp_rank, written, time.monotonic() - t0)
        t1 = time.monotonic()
        self.store.close(timeout_s=max(self.config.shutdown_flush_s - (t1 - t0), 1.0))
        if time.monotonic() - t1 > 1.0:  # vLLM sends SIGTERM after VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5)
            log.warning("kvtier: rank %d store close (queued writes, tier threads) took %.1f s",
                        self.tp_rank, time.monotonic() - t1)
