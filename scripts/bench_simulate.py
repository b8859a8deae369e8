"""Speed of ``kvtier simulate`` on the bundled Mooncake trace, against a reference in the same run.

Measures (1) the wall time of the whole sweep as the command runs it (read the trace, 6 cpu
capacities × the policies, 2 worker processes), and (2) per policy, the CPU time of one replay at
256 GiB next to the reference: a bare ``OrderedDict`` LRU over the same chunk stream (no tiers,
no policy object), the least a Python replay can cost.  Run from the repository root:

    .venv/bin/python scripts/bench_simulate.py
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from importlib import resources

from kvtier.simulate.replay import chunk_parents, engine_prefix_hits, replay
from kvtier.simulate.sweep import _SHARED, SweepSpec, _make, run_sweep
from kvtier.simulate.trace import read_trace

GIB = 1 << 30
CHUNK_BYTES = 131_072 * 512  # Llama-3.1-8B, bf16, 512-token chunks: 64 MiB
CAPACITIES = (64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0)
POLICIES = ("lru", "lru-tail", "default", "belady")


def bare_lru(chunk_keys: list[list[int]], capacity: int) -> int:
    """The reference: prompt-order LRU on a plain OrderedDict, counting resident chunks."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for keys in chunk_keys:
        for key in keys:
            if key in cache:
                hits += 1
                cache.move_to_end(key)
            else:
                cache[key] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


def cpu_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    path = resources.files("kvtier") / "data" / "mooncake_conversation_trace.jsonl.gz"
    start = time.perf_counter()
    trace = read_trace(str(path))
    run_sweep(trace, SweepSpec(CHUNK_BYTES, 40.0, CAPACITIES, 0.0, POLICIES), workers=2)
    wall = time.perf_counter() - start
    print(f"sweep: {len(CAPACITIES)} capacities x {len(POLICIES)} policies, {trace.num_requests:,} requests: "
          f"{wall:.1f} s wall (2 workers)")

    capacity = int(256 * GIB // CHUNK_BYTES)
    reference = cpu_time(lambda: bare_lru(trace.chunk_keys, capacity))
    print(f"reference (bare OrderedDict LRU, one pass, {capacity} chunks): {reference:.3f} s CPU")
    engine = engine_prefix_hits(trace, int(40 * GIB // CHUNK_BYTES))
    parents = chunk_parents(trace)
    _SHARED.update(trace=trace)
    for policy in POLICIES:
        seconds = cpu_time(lambda p=policy: replay(trace, engine, capacity, 0, lambda: _make(p), parents))
        print(f"{policy:>9}: {seconds:.3f} s CPU per replay = {seconds / reference:.1f}x reference")


if __name__ == "__main__":
    main()
