"""Cost of kvtier's KV events: vLLM scheduler step time with events off and on, same run.

A real vLLM 0.32 ``Scheduler`` (the tiny test model's config, one full-attention KV cache group)
with kvtier's scheduler-side connector, stepped in this process without workers: every step
``schedule()`` then ``update_from_output()`` with a ``ModelRunnerOutput`` whose
``kv_connector_worker_meta`` is the rank report a worker would send for the step's saves (every
saved page lands in the cpu tier; every 4th step one old chunk moves to disk and one leaves), so
the mirror changes, the event tracker runs and the events are built as in an engine.  Arms, run
interleaved (ABC ABC ...), each a fresh scheduler over the same workload:

- ``off``: no ``--kv-events-config``;
- ``vllm``: events on (publisher ``null``) with kvtier's tracker removed: vLLM's own GPU events only;
- ``kvtier``: events on, kvtier's events too.

Printed: the mean step time per arm (median over rounds) and kvtier's share, ``(kvtier - vllm) / off``;
and, less noisy on a shared machine, the time spent inside kvtier's event tracker (``record``,
``observe``, ``take_events``, timed per call) over the same steps' total time.
Usage: ``PYTHONPATH=src python scripts/bench_kv_events.py [--rounds 5] [--steps 400]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvtier.integrations.vllm.protocol import KVTierWorkerMeta, RankReport

BLOCK = 128
NUM_BLOCKS = 4096
PROMPT = 1024
CONCURRENT = 8


def build(model: Path, events: bool) -> Scheduler:
    extra = {"cpu_gib": 1}
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), max_model_len=4096, dtype="bfloat16"),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64, max_model_len=4096,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="KVTierConnector",
                                            kv_connector_module_path="kvtier.integrations.vllm",
                                            kv_role="kv_both", kv_load_failure_policy="recompute",
                                            kv_connector_extra_config=extra),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if events else None)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=vllm_config.model_config.dtype)
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],  # no worker: no tensors
                                    kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(vllm_config, kv_cache_config, StructuredOutputManager(vllm_config), block_size=BLOCK)


def run(sched: Scheduler, steps: int, kvtier_events: bool, seed: int) -> list[float]:
    side = sched.connector.scheduler_side  # type: ignore[union-attr]
    if not kvtier_events:
        side.events = None
        side.settle._more = None
    hasher_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hasher_fn)
    hasher = get_request_block_hasher(BLOCK, hasher_fn)
    root = b"\x07" * 16
    report = KVTierWorkerMeta({0: RankReport(root, [], full=True)})  # the first step's snapshot
    times: list[float] = []
    held: list[bytes] = []
    counts: dict[str, float] = {"saved_chunks": 0, "events": 0, "tracker_s": 0.0}
    if kvtier_events:  # the time spent inside the event tracker, measured directly (a wrapper per call)
        tracker = side.events

        def timed(fn: Any, count: bool = False) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                out = fn(*args, **kwargs)
                counts["tracker_s"] += time.perf_counter() - t
                if count:
                    counts["events"] += len(out)
                return out
            return call
        tracker.record = timed(tracker.record)
        tracker.observe = timed(tracker.observe)
        tracker.take_events = timed(tracker.take_events, count=True)
    n = 0
    for step in range(steps):
        while len(sched.running) + len(sched.waiting) < CONCURRENT:  # new conversations keep arriving
            n += 1
            tokens = [(seed * 7919 + n * 131 + i) % 30000 for i in range(PROMPT)]
            sched.add_request(Request(f"r{n}", tokens, SamplingParams(max_tokens=16, ignore_eos=True), None,
                                      block_hasher=hasher))
        t0 = time.perf_counter()
        out = sched.schedule()
        meta = out.kv_connector_metadata
        changes: list[tuple[bytes, str | None]] = []
        for save in getattr(meta, "saves", ()):
            for page in save.pages:
                changes.append((page.key, "cpu"))
                counts["saved_chunks"] += 1
                held.append(page.key)
        if step % 4 == 3 and len(held) > 8:  # a spill and an eviction
            changes += [(held[-8], "disk"), (held.pop(0), None)]
        req_ids = list(out.num_scheduled_tokens)
        report.ranks[0].changes += changes
        model_out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                      sampled_token_ids=[[1] for _ in req_ids],
                                      kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=report))
        sched.update_from_output(out, model_out)
        times.append(time.perf_counter() - t0)
        if step < steps // 10:  # warm-up steps left out of the tracker's time as of the step times
            counts["tracker_s"] = 0.0
        report = KVTierWorkerMeta({0: RankReport(root, [])})
    counts["finished"] = n - len(sched.running) - len(sched.waiting)
    run.counts = counts  # type: ignore[attr-defined]
    return times


def live(workdir: Path) -> None:
    """A real server (the tiny model, cpu + disk tiers, events published over ZMQ) under
    ``kvtier bench run --workload prefix-repetition``: the scheduler time the events cost
    (``kvtier_kv_events_seconds_total``) over the run's wall time, during which the engine steps
    without pause but for the gaps between a reply and the next request (closed loop, 4 requests in
    flight): the wall time stands for the steps' time."""
    import subprocess
    import sys

    from kvtier.launch.serve import Server, ServerSpec, transfer_config
    from kvtier.launch.testmodel import write_model
    from kvtier.tools.scrape import fetch_metrics

    model = write_model(workdir / "tiny", "tiny", weights="none")
    kvtier = {"cpu_gib": 0.25, "disk_path": str(workdir / "disk"), "disk_gib": 1}
    events = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:25557","topic":"kv"}'
    spec = ServerSpec(model=str(model), max_model_len=4096, cache_tokens=8192, kv_transfer_config=transfer_config(kvtier),
                      extra_args=("--kv-events-config", events))
    with Server(spec, workdir / "server.log").start(600) as server:
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "run", "--url", server.base_url,
                        "--workload", "prefix-repetition", "--prefix-len", "2000", "--num-prefixes", "16",
                        "--num-requests", "96", "--no-progress"], check=True)
        wall = time.monotonic() - t0
        time.sleep(3)  # the idle engine's last steps report the last counters
        m: dict[str, float] = {}  # summed over vLLM's labels (engine, model_name)
        for line in fetch_metrics(server.base_url).splitlines():
            if line.startswith("kvtier_kv_events_"):
                name = line.split("{")[0].split()[0]
                m[name] = m.get(name, 0.0) + float(line.rsplit(None, 1)[1])
    spent = m.get("kvtier_kv_events_seconds_total", 0.0)
    print(f"live: {m.get('kvtier_kv_events_stored_total', 0):.0f} stored, {m.get('kvtier_kv_events_removed_total', 0):.0f} "
          f"removed; events {spent * 1e3:.1f} ms of {wall:.1f} s of steps: {spent / wall * 100:.3f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--live", action="store_true", help="measure on a real server under a bench workload")
    args = parser.parse_args()
    from kvtier.launch.testmodel import write_model

    if args.live:
        live(Path(tempfile.mkdtemp()))
        return

    model = write_model(Path(tempfile.mkdtemp()) / "tiny", "tiny", weights="none")
    medians: dict[str, list[float]] = {"off": [], "vllm": [], "kvtier": []}
    stored: list[Any] = []
    inside: list[float] = []
    for r in range(args.rounds):
        for arm in ("off", "vllm", "kvtier"):
            sched = build(model, events=arm != "off")
            times = run(sched, args.steps, kvtier_events=arm == "kvtier", seed=r)
            # the mean step (saves, hence events, come in prefill steps only: a median step is a decode
            # step without any), warm-up steps left out
            medians[arm].append(statistics.fmean(times[args.steps // 10:]))
            stored.append((arm, dict(run.counts)))  # type: ignore[attr-defined]
            if arm == "kvtier":
                inside.append(run.counts["tracker_s"] / sum(times[args.steps // 10:]))  # type: ignore[attr-defined]
            sched.shutdown()
    off, vllm_only, kv = (statistics.median(medians[a]) for a in ("off", "vllm", "kvtier"))
    print(f"mean step, µs: off {off * 1e6:.1f}, vLLM events {vllm_only * 1e6:.1f}, + kvtier events {kv * 1e6:.1f}")
    print(f"kvtier events' share of the step: {(kv - vllm_only) / off * 100:+.2f} % "
          f"(rounds {args.rounds} x {args.steps} steps; per-round medians {medians})")
    print(f"time inside kvtier's event tracker / step time, same steps: median {statistics.median(inside) * 100:.2f} % "
          f"(rounds: {', '.join(f'{x * 100:.2f}' for x in inside)})")
    print(f"work per arm of the last round (saved chunks, kvtier events, requests finished): {stored[-3:]}")


if __name__ == "__main__":
    main()
