"""Registration: what a worker rank builds once vLLM hands it the engine's KV caches
(``register_kv_caches``): each KV cache group's layout, the namespace (with the identity
fingerprint), the per-group copiers, the rank's :class:`~kvtier.core.store.TieredStore` and the
:class:`~kvtier.integrations.vllm.worker.loader.LoadPath` (one load's path, which the worker side
runs on its loader threads).

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import Namespace
from kvtier.core.store import TieredStore
from kvtier.core.tiers.base import RegistersMemory
from kvtier.integrations.vllm.cache_groups import GroupSpec, is_dense
from kvtier.integrations.vllm.worker.copy import GroupCopiers
from kvtier.integrations.vllm.worker.direct import DirectTargets
from kvtier.integrations.vllm.worker.identity import effective_config_digest, model_fingerprint
from kvtier.integrations.vllm.worker.layout import KVLayout, detect_group_layouts, detect_layout
from kvtier.integrations.vllm.worker.loader import LoadPath

log = logging.getLogger(__name__)


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside vLLM's parallel state)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - parallel state not initialised (single-process tools)
        return 0


def rank_name(parallel_config: Any, rank: int) -> str:
    """How this worker's log lines name it: ``rank R`` (its tensor-parallel rank), and, where the engine
    is one of several data-parallel engines, ``rank R (data-parallel rank D)``: both engines of
    ``--data-parallel-size 2`` have a rank 0.  ``D`` is vLLM's ``data_parallel_index``, which keeps the
    engine's place where vLLM reconfigures a dense model's engines as independent ones of DP 1
    (vllm/v1/engine/core.py ``run_engine_core``, ``ParallelConfig.reconfigure_for_independent_dp_rank``);
    so data-parallel engine 0 of a dense model reads ``rank R``."""
    index = getattr(parallel_config, "data_parallel_index", None)
    dp_rank = int(index if index is not None else getattr(parallel_config, "data_parallel_rank", 0) or 0)
    if dp_rank or int(getattr(parallel_config, "data_parallel_size", 1) or 1) > 1:
        return f"rank {rank} (data-parallel rank {dp_rank})"
    return f"rank {rank}"


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
    (:func:`~kvtier.integrations.vllm.engine_config.resolved_config`): two engines whose chunk sizes
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


@dataclass
class Registered:
    """What :func:`register` built for one rank.

    Attributes:
        layout: the first KV cache group's layout.
        copiers: one copier per KV cache group, over pages of ``copiers.page_bytes``.
        store: the rank's store.
        load_path: the rank's load path (:class:`~kvtier.integrations.vllm.worker.side.AsyncLoader` runs it).
        namespace: the rank's namespace (its digest names the store; :func:`key_root` the keys).
    """

    layout: KVLayout
    copiers: GroupCopiers
    store: TieredStore
    load_path: LoadPath
    namespace: Namespace


def register(vllm_config: Any, kv_cache_config: Any, config: KVTierConfig, groups: Sequence[GroupSpec],
             kv_caches: dict[str, torch.Tensor], tp_size: int, rank: int) -> Registered:
    """Build one rank's layout, namespace, copiers, store and loader over vLLM's ``kv_caches``.

    A dense model has one layout; a hybrid model one per KV cache group, pages of the largest
    group's size.  ``config.chunk_tokens`` must be resolved
    (:func:`~kvtier.integrations.vllm.engine_config.engine_config`).

    Raises:
        ConfigError: a cache layout kvtier cannot copy (:mod:`~kvtier.integrations.vllm.worker.layout`),
            or a store the configuration cannot build (a cpu tier smaller than one chunk, ...).
    """
    assert isinstance(config.chunk_tokens, int)
    chunk_tokens = config.chunk_tokens
    mc = vllm_config.model_config
    fingerprint = model_fingerprint(str(mc.model), mc.revision, getattr(mc, "tokenizer", None))
    dense = is_dense(groups)
    if dense:
        first = detect_layout(kv_caches, kv_cache_config.num_blocks,
                              _backend_name(vllm_config, next(iter(kv_caches), "")))
        layouts = {groups[0].index: first}
    else:
        layouts = detect_group_layouts(kv_caches, kv_cache_config, lambda name: _backend_name(vllm_config, name))
        first = layouts[min(layouts)]
    amx = request_amx_permission() if first.device == "cpu" else False
    namespace = build_namespace(vllm_config, kv_cache_config, first, config, tp_size, rank, fingerprint,
                                group_layouts=None if dense else layouts)
    copiers = GroupCopiers(groups, chunk_tokens, layouts, kv_caches)
    store = TieredStore(config, namespace, copiers.page_bytes, tp_size)
    _pin_top_tier(store, first, rank)
    # block-level load errors where vLLM takes them (one full-attention KV cache group), a load that
    # succeeds or fails whole otherwise
    one_group = len(kv_cache_config.kv_cache_groups) == 1 and dense
    load_path = LoadPath(store, copiers, chunk_tokens, partial=one_group, wait_s=config.load_wait_s,
                         direct=DirectTargets.of(store, copiers) if one_group else None,
                         sync_within_s=config.shared_deadline_s)
    if dense:
        log.info("kvtier: rank %d layout %s, chunk %d tokens = %d bytes, namespace %s, identity %s, AMX %s",
                 rank, first.describe(), chunk_tokens, store.chunk_bytes, namespace.digest().hex(), fingerprint,
                 "requested" if amx else "not available")
        _warn_small_cpu_tier(store, config, vllm_config.model_config.max_model_len, tp_size, rank)
    else:
        log.info("kvtier: rank %d hybrid model, %s; chunk %d tokens, page %d bytes, namespace %s, identity %s, "
                 "AMX %s", rank, ", ".join(f"group {g.index} {g.kind.value} {layouts[g.index].describe()}"
                                           for g in groups),
                 chunk_tokens, copiers.page_bytes, namespace.digest().hex(), fingerprint,
                 "requested" if amx else "not available")
    return Registered(first, copiers, store, load_path, namespace)


def _pin_top_tier(store: TieredStore, layout: KVLayout, rank: int) -> None:
    """KV cache on a GPU: register the top tier's pages and the store's landing buffers (where a
    lower-tier read lands when no cpu page is free: :mod:`kvtier.core.landing`) as pinned host
    memory, so the copy path DMAs straight between engine blocks and the buffer a chunk is in (a
    failure is logged, and the copies stage through a pinned buffer)."""
    if layout.device.startswith("cuda"):
        t0 = time.monotonic()
        pinned = store.cpu.pin_host_memory()
        log.info("kvtier: rank %d top tier pages %s (%.1f s)", rank,
                 "pinned: GPU copies go straight to them" if pinned else "pageable: GPU copies are staged",
                 time.monotonic() - t0)
        landing = store.mover.landing  # where lower-tier reads land without a cpu page (kvtier.core.landing)
        why = landing.pin(store.cpu) if isinstance(store.cpu, RegistersMemory) else "the top tier registers no memory"
        if why is not None:
            log.warning("kvtier: rank %d landing buffers (%d MiB) are not pinned (%s); loads of chunks read "
                        "without a cpu page are staged", rank, landing.region.nbytes >> 20, why)


def _warn_small_cpu_tier(store: TieredStore, config: KVTierConfig, max_model_len: int, tp_size: int,
                         rank: int) -> None:
    """Warn when the cpu tier cannot hold one longest prompt plus the disk write queue.

    Every saved chunk passes through a cpu page, and with a disk tier each queued write pins its
    page until written (up to ``save_queue_depth``); with fewer pages, saves are dropped
    (``kvtier_dropped_saves_total``) even though the config is valid.
    """
    assert isinstance(config.chunk_tokens, int)
    pages = store.cpu.usage().capacity_bytes // store.chunk_bytes
    longest = -(-max_model_len // config.chunk_tokens)
    queued = config.save_queue_depth if config.disk_path and config.disk_gib > 0 else 0
    if pages < longest + queued:
        need_gib = (longest + queued) * store.chunk_bytes * tp_size / (1 << 30)
        log.warning("kvtier: rank %d cpu tier holds %d chunks, fewer than one max_model_len prompt (%d chunks) "
                    "plus the disk write queue (save_queue_depth %d): saves will be dropped "
                    "(kvtier_dropped_saves_total); raise cpu_gib to at least %.3f", rank, pages,
                    longest, queued, need_gib)
