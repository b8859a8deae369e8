"""Worker side of the connector: owns this rank's store, copies blocks in and out.

- ``register_kv_caches``: detect the layout, build the namespace and the rank's
  :class:`~kvtier.core.store.TieredStore`, start the rank's service for the scheduler side.
- ``start_load``: before the forward pass, copy each load job's pinned chunks into its blocks;
  a job that cannot be completed reports all its blocks through ``take_errors`` (vLLM's
  ``get_block_ids_with_load_errors``), so the engine recomputes them.
- ``save``: after the forward pass, copy each save job's full chunks out of the engine into
  cpu pages and publish them; disk spill then happens on the store's threads.  The copy is
  finished when the call returns, so no save outlives the blocks it reads (a preempted or
  aborted request's blocks can be reused at once).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import defaultdict
from typing import Any

import torch

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import Namespace
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.copy import BlockCopier, Span
from kvtier.integrations.vllm.layout import KVLayout, detect_layout
from kvtier.integrations.vllm.protocol import KVTierMetadata, LoadJob, SaveJob
from kvtier.integrations.vllm.service import RankService, ServiceServer, authkey_for, service_address
from kvtier.integrations.vllm.stats import KVTierStats

log = logging.getLogger(__name__)

_STORE_COUNTERS = ("evictions_cpu", "evictions_disk", "dropped_saves", "corrupt_chunks")
# Every rank moves the same tokens (its own KV heads of them), and vLLM sums the ranks' stats:
# token counters are reported by rank 0 only; bytes, seconds and store counters by every rank.
_RANK0_ONLY = ("loaded_tokens_cpu", "loaded_tokens_disk", "reloaded_tokens", "saved_tokens", "load_failed_blocks")


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


def build_namespace(vllm_config: Any, kv_cache_config: Any, layout: KVLayout, config: KVTierConfig,
                    tp_size: int, tp_rank: int) -> Namespace:
    """Everything that changes this rank's KV bytes (see :class:`kvtier.core.keys.Namespace`)."""
    model_config = vllm_config.model_config
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    layers = hashlib.blake2b("\0".join(layout.layer_names).encode(), digest_size=8).hexdigest()
    kv_layout = getattr(kv_cache_config, "kv_cache_layout", None)
    return Namespace(
        model=f"{model_config.model}@{model_config.revision or ''}",
        kv_dtype=f"{vllm_config.cache_config.cache_dtype}:{str(layout.dtype).removeprefix('torch.')}",
        num_layers=layout.num_layers,
        num_kv_heads=int(getattr(spec, "num_kv_heads", 0)),
        head_size=int(getattr(spec, "head_size", 0)),
        layout=layout.describe(),
        tp_size=tp_size,
        tp_rank=tp_rank,
        chunk_tokens=config.chunk_tokens,
        extra=(("block_size", str(vllm_config.cache_config.block_size)),
               ("kv_cache_layout", str(getattr(kv_layout, "name", kv_layout))),
               ("layers", layers),
               ("spec", type(spec).__name__)),
    )


class WorkerSide:
    """Per-rank state of the worker-side connector."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: KVTierConfig, engine_id: str,
                 dp_rank: int) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        self.blocks_per_chunk = config.chunk_tokens // self.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = _tp_rank()
        self.address = service_address(engine_id, dp_rank, self.tp_rank)
        self.authkey = authkey_for(engine_id)
        self.service: RankService | None = None
        self.server: ServiceServer | None = None
        self.copier: BlockCopier | None = None
        self.layout: KVLayout | None = None
        self._errors: set[int] = set()
        self._counters: defaultdict[str, float] = defaultdict(float)
        self._store_seen: dict[str, int] = {}
        self._gauges_sent: dict[str, float] = {}

    # ---- setup -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches), "")
        self.layout = detect_layout(kv_caches, self.kv_cache_config.num_blocks,
                                    _backend_name(self.vllm_config, first))
        namespace = build_namespace(self.vllm_config, self.kv_cache_config, self.layout, self.config,
                                    self.tp_size, self.tp_rank)
        store = TieredStore(self.config, namespace, self.layout.chunk_bytes(self.blocks_per_chunk), self.tp_size)
        self.service = RankService(store)
        self.copier = BlockCopier(self.layout, kv_caches, self.blocks_per_chunk)
        self.server = ServiceServer(self.service, self.address, self.authkey)
        log.info("kvtier: rank %d layout %s, chunk %d tokens = %d bytes, namespace %s, service %s",
                 self.tp_rank, self.layout.describe(), self.config.chunk_tokens, store.chunk_bytes,
                 namespace.digest().hex(), self.address)

    # ---- loads -------------------------------------------------------------------------------
    def start_load(self, meta: KVTierMetadata) -> None:
        for job in meta.loads:
            self._load_one(job)

    def _load_one(self, job: LoadJob) -> None:
        assert self.service is not None and self.copier is not None
        handle = self.service.take(job.req_id)
        if handle is None or handle.num_chunks < job.num_chunks:
            log.warning("kvtier: load of request %s found %s pinned chunks of %d; recomputing",
                        job.req_id, handle.num_chunks if handle else 0, job.num_chunks)
            if handle is not None:
                self.service.store.complete_load(handle, False)
            self._fail(job)
            return
        k = self.blocks_per_chunk
        spans, tiers = [], []
        for c in range(job.first_block // k, job.num_chunks):
            lo, hi = max(job.first_block, c * k), (c + 1) * k
            spans.append(Span(handle.buffers[c], lo - c * k, job.block_ids[lo - job.first_block:hi - job.first_block]))
            tiers.append(handle.tiers[c])
        ok = False
        t0 = time.perf_counter()
        try:
            self.copier.load(spans)
            ok = True
        except Exception:
            log.exception("kvtier: copying request %s's chunks into the engine failed; recomputing", job.req_id)
        finally:
            self.service.store.complete_load(handle, ok, first_chunk=job.first_block // k)
        if not ok:
            self._fail(job)
            return
        assert self.layout is not None
        num_blocks = sum(len(s.block_ids) for s in spans)
        self._counters["load_seconds"] += time.perf_counter() - t0
        self._counters["load_bytes"] += num_blocks * self.layout.block_bytes * self.layout.num_layers
        for span, tier in zip(spans, tiers):
            # vLLM counts hits of re-admitted (preempted) requests apart; so do we, so that
            # kvtier_loaded_tokens_total matches vllm:external_prefix_cache_hits_total.
            name = "reloaded_tokens" if job.resumed else f"loaded_tokens_{tier}"
            self._counters[name] += len(span.block_ids) * self.block_size

    def _fail(self, job: LoadJob) -> None:
        self._errors.update(job.block_ids)
        self._counters["load_failed_blocks"] += len(job.block_ids)

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # ---- saves -------------------------------------------------------------------------------
    def save(self, meta: KVTierMetadata) -> None:
        for job in meta.saves:
            try:
                self._save_one(job)
            except Exception:  # a failed save is a future miss, never an engine failure
                log.exception("kvtier: saving request %s's chunks failed", job.req_id)

    def _save_one(self, job: SaveJob) -> None:
        assert self.service is not None and self.copier is not None and self.layout is not None
        store = self.service.store
        chain = self.service.chain(job.keys, job.chunk_end)
        if len(chain) < job.chunk_end:
            return
        handle = store.prepare_store(chain, start=job.chunk_start)
        if not handle.num_chunks:
            return
        k = self.blocks_per_chunk
        spans = [Span(buf, 0, job.block_ids[(idx - job.chunk_start) * k:(idx - job.chunk_start + 1) * k])
                 for idx, buf in zip(handle.indices, handle.buffers)]
        ok = False
        t0 = time.perf_counter()
        try:
            self.copier.save(spans)
            ok = True
        finally:
            store.complete_store(handle, ok)
        seconds = time.perf_counter() - t0
        self._counters["save_seconds"] += seconds
        self._counters["save_bytes"] += handle.num_chunks * store.chunk_bytes
        self._counters["saved_tokens"] += handle.num_chunks * store.chunk_tokens
        store.metrics.moved("engine_to_cpu", handle.num_chunks * store.chunk_bytes, seconds)

    # ---- metrics and lifecycle ---------------------------------------------------------------
    def stats(self) -> KVTierStats | None:
        """This step's counters and the store's current usage; ``None`` if nothing changed."""
        if self.service is None:
            return None
        store = self.service.store
        snapshot = store.stats()
        counters: dict[str, float] = {k: v for k, v in self._counters.items()
                                      if v and (self.tp_rank == 0 or k not in _RANK0_ONLY)}
        self._counters.clear()
        for name in _STORE_COUNTERS:
            now = int(snapshot.get(name, 0) or 0)
            delta = now - self._store_seen.get(name, 0)
            self._store_seen[name] = now
            if delta:
                counters[name] = delta
        disk = snapshot.get("disk") or {}
        gauges = {"usage_bytes_cpu": snapshot["cpu"]["used_bytes"], "capacity_bytes_cpu": snapshot["cpu"]["capacity_bytes"],
                  "usage_bytes_disk": disk.get("used_bytes", 0), "capacity_bytes_disk": disk.get("capacity_bytes", 0)}
        if not counters and gauges == self._gauges_sent:
            return None
        self._gauges_sent = gauges
        return KVTierStats(data={"counters": counters, "gauges": dict(gauges)})

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.service is not None:
            self.service.store.close()
