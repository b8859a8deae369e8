"""kvtier's own time on a full cpu-tier hit, without an engine: the loop to iterate on (issue 33).

``scripts/full_hit.py`` measures the hit in a real engine (minutes per run, noisy on a shared
machine: the tail's forward is most of the TTFT). This times the same kvtier calls in seconds:

- **scheduler**: vLLM's real ``Scheduler`` with ``KVTierConnector`` (the set-up of
  ``tests/integrations/test_vllm_scheduler.py``: no model runner; the workers' index report is
  fed in as a worker would send it), the ``mid`` geometry's KV cache spec (24 layers, 2 KV heads of
  64, bf16, 128-token blocks: vLLM's CPU default). Per full hit (vLLM's own prefix cache reset
  first): ``get_num_new_matched_tokens`` (the lookup, part of full_hit.py's own time),
  ``update_state_after_alloc`` and ``build_connector_meta`` (on the TTFT's path too);
- **worker**: the worker side over a cpu-tier store and host tensors shaped as the ``mid``
  geometry's caches (``WorkerSide.over``, as scripts/gpu_runner.py builds it), one synchronous
  ``LoadJob`` per hit as the scheduler ships it: ``start_load`` minus the copy into the engine's
  blocks (``loader.load_pages``) is the rest of full_hit.py's own time (the load beyond the copy;
  ``prepare_load`` runs inside it).

**Cold caches, as in the engine**: before each timed hit (each side) the script copies
``--flush-mib`` MiB (default 128) through the CPU caches, as the engine's forward pass does
between two hits (the ``mid`` model's weights and activations): kvtier's hit path then finds its
index, policy and mirror out of the caches, as it does in the engine.  With ``--flush-mib 0`` the
hits run back to back on warm caches, which put the own time at 4,000 tokens ~0.3 ms below what
``scripts/full_hit.py`` measured in the engine (2026-12-05: 565-720 µs warm, 850-860 µs with
128 MiB flushed, 880-1,010 µs in the engine at load ~3).

A synchronous load's bookkeeping after the copy (``syncload.finish_sync``: a cpu-tier load's request
context and record, then ``LoadPath.finish``) runs on the worker's finisher thread (``worker/finisher.py``): ``start_load`` no longer includes it, and ``--parts``
shows it apart, timed on that thread (the script joins it after each timed ``start_load``).

Prints medians (and the minimum: the least disturbed hit on a shared machine) per hit and per
chunk. ``--profile`` adds cProfile's top functions of the worker's ``start_load``; ``--parts`` adds
each part of the hit (:data:`PARTS`: the calls the lookup and ``start_load`` make), timed inclusive
with ``perf_counter`` around the live methods, median per hit (each wrapper adds ~0.2 us warm).

Usage::

    python scripts/hit_cost.py [--prompt-tokens 4000] [--repeats 300] [--flush-mib 128] [--profile] [--parts]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BLOCK = CHUNK = 128
LAYERS, KV_HEADS, HEAD = 24, 2, 64  # the mid geometry (kvtier.launch.testmodel_geometry)


class CacheFlush:
    """Evicts the CPU caches' contents: one copy of ``mib`` MiB between two buffers (0: nothing)."""

    def __init__(self, mib: int) -> None:
        self.src = torch.ones(mib << 18, dtype=torch.float32) if mib > 0 else None
        self.dst = torch.zeros_like(self.src) if self.src is not None else None

    def __call__(self) -> None:
        if self.src is not None and self.dst is not None:
            self.dst.copy_(self.src)


PARTS = (  # (module, attribute path, label): the hit's parts, nested as they call each other
    ("kvtier.integrations.vllm.scheduler.side", "SchedulerSide.get_num_new_matched_tokens", "lookup"),
    ("kvtier.integrations.vllm.scheduler.requests", "RequestState.keys", "  chunk keys (RequestState.keys)"),
    ("kvtier.integrations.vllm.scheduler.steps", "PagePlanner.lookup", "  plan from the mirror"),
    ("kvtier.integrations.vllm.scheduler.side", "SyncBudget.offer", "  synchronous budget offer"),
    ("kvtier.integrations.vllm.worker.side", "WorkerSide.start_load", "start_load"),
    ("kvtier.integrations.vllm.worker.syncload", "load_now", "  load_now"),
    ("kvtier.core.mover", "Mover.prepare_load", "    prepare_load"),
    ("kvtier.core.index", "Index.plan_load", "      Index.plan_load"),
    ("kvtier.integrations.vllm.worker.syncload", "load_pages", "    copy"),
    ("kvtier.integrations.vllm.worker.finisher", "Finisher.submit", "    hand-off (Finisher.submit)"),
    ("kvtier.core.index", "Index.gate_evictions", "  gate_evictions"),
    ("kvtier.integrations.vllm.worker.syncload", "finish_sync", "finish_sync (on the finisher's thread)"),
    ("kvtier.integrations.vllm.worker.syncload", "RequestRecord", "  RequestRecord()"),
    ("kvtier.integrations.vllm.worker.syncload", "job_context", "  job_context"),
    ("kvtier.integrations.vllm.worker.loader", "LoadPath.finish", "  LoadPath.finish"),
    ("kvtier.integrations.vllm.worker.loader", "tokens_by_tier", "    tokens_by_tier"),
    ("kvtier.integrations.vllm.worker.loader", "EngineLoad", "    EngineLoad()"),
    ("kvtier.core.mover", "Mover.complete_load", "    complete_load"),
    ("kvtier.core.index", "Index.release", "      Index.release"),
    ("kvtier.core.policies.adaptive", "AdaptivePolicy.touch", "        policy touch"),
    ("kvtier.core.mover", "Tee.emit", "      events (Tee.emit)"),
    ("kvtier.integrations.vllm.worker.loader", "load_facts", "    load_facts"),
)


def time_parts(parts: dict[str, list[float]]) -> Callable[[bool], None]:
    """Wrap every :data:`PARTS` call on its class or module; returns ``end_hit(keep)``, which files
    the sums since its last call under ``parts`` (``keep``) or drops them."""
    import importlib

    sums: dict[str, float] = {}
    for module, path, label in PARTS:
        owner: Any = importlib.import_module(module)
        *outer, attr = path.split(".")
        for name in outer:
            owner = getattr(owner, name)
        real = getattr(owner, attr)

        def timed(*a: Any, _real: Any = real, _label: str = label, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                sums[_label] = sums.get(_label, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)

    def end_hit(keep: bool) -> None:
        if keep:
            for label, s in sums.items():
                parts[label].append(s)
        sums.clear()
    return end_hit


def _line(name: str, times: list[float], chunks: int) -> str:
    med = statistics.median(times)
    return (f"{name:34s} median {med * 1e6:8.1f} us (min {min(times) * 1e6:7.1f}) "
            f"= {med * 1e6 / chunks:5.1f} us/chunk")


def scheduler_side(prompt_tokens: int, repeats: int, model_dir: Path, flush: CacheFlush,
                   end_hit: Callable[[bool], None] = lambda keep: None) -> tuple[int, dict[str, list[float]]]:
    """Per-hit seconds of the scheduler-side connector's calls on a full hit."""
    from vllm import SamplingParams
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from kvtier.integrations.vllm.protocol import KVTierWorkerMeta, RankReport
    from kvtier.integrations.vllm.scheduler.requests import RequestChain
    from kvtier.launch.testmodel import write_model

    num_blocks = prompt_tokens // BLOCK + 64
    model = write_model(model_dir / "mid", "mid", weights="none")
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", seed=0, max_model_len=8192),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8192, max_model_len=8192,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"cpu_gib": 0.25, "async_saves": False}),
        device_config=DeviceConfig("cpu"))
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)], spec)])
    kv_cache_config.hash_block_size = BLOCK  # as the engine core sets it (vllm/v1/engine/core.py)
    init_none_hash(sha256)
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=True,
                          structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)
    rng = random.Random(3)
    prompt = [rng.randrange(1, 8000) for _ in range(prompt_tokens)]

    def request(req_id: str) -> Any:
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, 0)
        return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
                       pooling_params=None, mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))

    def output(step: Any, running: list[Any], **connector: Any) -> Any:
        ids = [r.request_id for r in running if r.request_id in step.num_scheduled_tokens]
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=[[7] for _ in ids],
                                 kv_connector_output=KVConnectorOutput(**connector) if connector else None)

    root = bytes(range(16))
    first = request("keys")
    keys = RequestChain(first, root, CHUNK).upto(first.all_token_ids, (prompt_tokens - 1) // CHUNK)
    step = scheduler.schedule()  # the workers' first report: every chunk in the cpu tier
    scheduler.update_from_output(step, output(step, [], kv_connector_worker_meta=KVTierWorkerMeta(
        {0: RankReport(root, [(k, "cpu") for k in keys], True, namespace=b"n" * 16)})))
    times: dict[str, list[float]] = defaultdict(list)
    timing: dict[str, float] = {}
    connector = scheduler.connector

    def timed(name: str) -> None:
        real = getattr(connector, name)

        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                timing[name] = time.perf_counter() - t0
        setattr(connector, name, call)

    names = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta")
    for name in names:
        timed(name)
    for i in range(repeats):
        if not scheduler.reset_prefix_cache():
            raise RuntimeError("vLLM refused reset_prefix_cache")
        req = request(f"hit{i}")
        flush()
        timing.clear()
        end_hit(False)
        scheduler.add_request(req)
        step = scheduler.schedule()
        end_hit(True)
        loads = step.kv_connector_metadata.loads
        if not (loads and loads[0].sync and loads[0].hit_tokens == len(keys) * CHUNK):
            raise RuntimeError(f"not a synchronous full hit: {loads}")
        for name in names:
            times[name].append(timing[name])
        scheduler.update_from_output(step, output(step, [req]))
        step = scheduler.schedule()
        scheduler.update_from_output(step, output(step, []))
    return len(keys), times


def worker_side(chunks: int, repeats: int, profile: bool, flush: CacheFlush,
                end_hit: Callable[[bool], None] = lambda keep: None) -> dict[str, list[float]]:
    """Per-hit seconds of a synchronous full hit's ``start_load``, and of its copy."""
    from kvtier.core.config import KVTierConfig
    from kvtier.core.keys import Namespace, chunk_keys
    from kvtier.core.store import TieredStore
    from kvtier.integrations.vllm.cache_groups import GroupKind, GroupSpec
    from kvtier.integrations.vllm.connector import worker_stats
    from kvtier.integrations.vllm.protocol import KVTierMetadata, LoadJob, PageMove, SaveJob
    from kvtier.integrations.vllm.worker import syncload
    from kvtier.integrations.vllm.worker.copy import GroupCopiers
    from kvtier.integrations.vllm.worker.layout import detect_layout
    from kvtier.integrations.vllm.worker.loader import LoadPath
    from kvtier.integrations.vllm.worker.registration import Registered
    from kvtier.integrations.vllm.worker.side import WorkerSide

    num_blocks = chunks + 8
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros((2, num_blocks, BLOCK, KV_HEADS, HEAD),
                                                              dtype=torch.bfloat16) for i in range(LAYERS)}
    layout = detect_layout(caches, num_blocks, "hit_cost")
    group = GroupSpec(index=0, kind=GroupKind.FULL, block_size=BLOCK, layer_names=tuple(caches), window_tokens=0,
                      page_bytes=layout.block_bytes)
    copiers = GroupCopiers((group,), CHUNK, {0: layout}, caches)
    config = KVTierConfig(chunk_tokens=CHUNK, tiers=("cpu",), cpu_gib=0.25, async_saves=False)
    namespace = Namespace("hit_cost", str(layout.dtype), layout.num_layers, 1, layout.block_bytes, layout.describe(),
                          chunk_tokens=CHUNK)
    store = TieredStore(config, namespace, copiers.page_bytes)
    side = WorkerSide.over(config, (group,), Registered(layout, copiers, store,
                                                        LoadPath(store, copiers, CHUNK, partial=True), namespace))
    keys = chunk_keys(b"\0" * 16, list(range(chunks * CHUNK)), CHUNK)
    pages = tuple(PageMove(bytes(k), 0, c, 0, (c,)) for c, k in enumerate(keys))

    def rest_of_step(meta: Any) -> None:  # as vLLM's model runner calls the connector after start_load_kv
        side.save(meta)
        side.finished_saves()
        side.finished_loads(set())
        side.worker_meta()
        worker_stats(side)  # the connector's get_kv_connector_stats on a worker

    meta = KVTierMetadata(saves=[SaveJob("save", pages)])
    side.start_load(meta)
    rest_of_step(meta)
    rest_of_step(KVTierMetadata())
    if store.lookup(keys) != chunks:
        raise RuntimeError("the save did not store every chunk")
    copy_s: list[float] = []
    real_load: Callable[..., None] = syncload.load_pages  # the copy a synchronous load makes (load_now)

    def timed_load(*a: Any, **k: Any) -> None:
        t0 = time.perf_counter()
        real_load(*a, **k)
        copy_s.append(time.perf_counter() - t0)

    syncload.load_pages = timed_load
    times: dict[str, list[float]] = defaultdict(list)
    profiler = cProfile.Profile() if profile else None
    for i in range(repeats):
        meta = KVTierMetadata(loads=[LoadJob(f"hit{i}", pages, 0, chunks * CHUNK, ("cpu",) * chunks, sync=True)])
        copy_s.clear()
        flush()
        end_hit(False)
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        side.start_load(meta)
        t1 = time.perf_counter()
        side.finisher.join()  # (the hit's bookkeeping, handed off: its parts are this hit's)
        end_hit(True)
        if profiler is not None:
            profiler.disable()
        times["start_load - copy"].append(t1 - t0 - copy_s[0])
        times["copy"].append(copy_s[0])
        rest_of_step(meta)
    store.check_integrity(expect_idle=True)
    side.shutdown()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--flush-mib", type=int, default=128,
                        help="MiB copied through the CPU caches before each timed hit, as the engine's forward does "
                             "(0: warm caches)")
    parser.add_argument("--profile", action="store_true", help="cProfile the worker's start_load")
    parser.add_argument("--parts", action="store_true", help="time each part of the hit (PARTS), median per hit")
    args = parser.parse_args()
    if not 2 * CHUNK <= args.prompt_tokens <= 8000 or args.repeats < 1 or args.flush_mib < 0:
        print("hit_cost.py: --prompt-tokens from 256 to 8000, --repeats at least 1, --flush-mib 0 or more")
        return 2
    flush = CacheFlush(args.flush_mib)
    parts: dict[str, list[float]] = defaultdict(list)
    end_hit = time_parts(parts) if args.parts else (lambda keep: None)
    with tempfile.TemporaryDirectory() as tmp:
        chunks, sched = scheduler_side(args.prompt_tokens, args.repeats, Path(tmp), flush, end_hit)
    worker = worker_side(chunks, args.repeats, args.profile, flush, end_hit)
    print(f"{args.prompt_tokens}-token prompt, {chunks} chunks, {args.repeats} full hits, "
          f"{args.flush_mib} MiB through the caches before each")
    for name, times in (*sched.items(), *worker.items()):
        print(_line(name, times, chunks))
    own = [a + b for a, b in zip(sched["get_num_new_matched_tokens"], worker["start_load - copy"])]
    print(_line("own (lookup + start_load - copy)", own, chunks))
    if parts:
        print("\nparts, inclusive (wrapped), median per hit:")
        for _module, _path, label in PARTS:
            if parts.get(label):
                print(f"  {label:40s} {statistics.median(parts[label]) * 1e6:8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
