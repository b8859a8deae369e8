"""How much of the LRU→Belady gap could an online policy close?  (docs/simulate.md, "What an
online policy could reach".)

Replays one trace at one cpu capacity (% of its distinct chunks; no engine tier, 512-token chunks,
or the bundled trace's 40 GiB engine tier of 64 MiB chunks) with references that know *more*
than an online policy but less than Belady:

- ``bit``: told, at each use, whether the chunk will ever be used again (never when); evicts
  chunks that will not first, least recently used among equals.  Measures how much of Belady's
  lead is *which* chunks return.
- ``lhd``: LHD (Beckmann et al., "LHD: improving cache hit rate by maximizing hit density",
  NSDI 2018): evicts the sampled leaf with the lowest hit density for its class (prior uses:
  0, 1, 2, 3+) and age since last use; densities learned online from its own hits and evictions.
- ``lhd-known``: the same with the density tables learned from a whole first replay of the same
  trace at the same capacity, then frozen: a policy that knows each class's reuse-time
  distribution in advance (a non-monotone one too: think times), but not the sequence.
- ``a0`` (synthetic rag and batch only): knows each chunk's probability of use per request from
  the generator's own parameters (Zipf over documents, hot set, templates) and keeps the most
  probable ones (A0, optimal under the independent reference model; Aho, Denning and Ullman,
  JACM 1971).  ``lfu``: the online estimate of the same, every past use counted (no forgetting).

    PYTHONPATH=src .venv/bin/python scripts/policy_bounds.py --regime chat --seed 1 --requests 4000 --pct 5
    PYTHONPATH=src .venv/bin/python scripts/policy_bounds.py --regime rag --seed 9 --requests 3000 \\
        --set zipf_s=0.6 --pct 10
    PYTHONPATH=src .venv/bin/python scripts/policy_bounds.py --bundled --pct 2 --skip lhd,lhd-known

Prints token hit ratios (%) and the share of the LRU→Belady gap each closes.  Simulator-only
code: none of these references is a policy the store can use.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from collections.abc import Callable
from importlib import resources
from typing import Any

from kvtier.core.policies import make_policy
from kvtier.core.policies.base import EvictionPolicy, always_evictable, heap_victim
from kvtier.simulate import synth, synth_blocks
from kvtier.simulate.belady import BeladyPolicy, TraceOracle
from kvtier.simulate.replay import OfflinePolicy, chunk_parents, engine_prefix_hits, replay
from kvtier.simulate.trace import Trace, read_trace

AGES, CLASSES, SAMPLES = 64, 4, 32


class RankedLeaves(EvictionPolicy):
    """Leaves first, lowest ``rank(key)`` first (computed at each use), then least recent."""

    def __init__(self, rank: Callable[[Any], Any]) -> None:
        self.rank = rank
        self.nodes: dict[Any, list[Any]] = {}  # key -> [parent, depth, seq]
        self.children: dict[Any, int] = {}
        self.heap: list[Any] = []
        self.seq = itertools.count()
        self.clock = 0

    def insert(self, key: Any, parent: Any) -> None:
        if key in self.nodes:
            self.touch([key])
            return
        self.clock += 1
        up = self.nodes.get(parent)
        self.nodes[key] = [parent, up[1] + 1 if up else 0, 0]
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1
        self.queue(key)

    def queue(self, key: Any) -> None:
        node = self.nodes[key]
        node[2] = s = next(self.seq)
        heapq.heappush(self.heap, ((self.rank(key), self.clock, -node[1]), s, key))

    def touch(self, keys: Any) -> None:
        self.clock += 1
        for key in keys:
            if key in self.nodes:
                self.queue(key)

    def remove(self, key: Any) -> None:
        node = self.nodes.pop(key, None)
        if node is not None and node[0] is not None:
            left = self.children[node[0]] - 1
            if left:
                self.children[node[0]] = left
            else:
                del self.children[node[0]]
                if node[0] in self.nodes:
                    self.queue(node[0])

    def victim(self, evictable: Any = always_evictable) -> Any:
        nodes, children = self.nodes, self.children
        return heap_victim(self.heap, lambda e: (n := nodes.get(e[2])) is None or n[2] != e[1] or e[2] in children,
                           evictable)

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, key: object) -> bool:
        return key in self.nodes

    def keys(self) -> Any:
        return self.nodes.keys()


class BitOracle(RankedLeaves, OfflinePolicy):
    """Knows whether each chunk is used again after the current request (not when)."""

    def __init__(self, last_use: dict[Any, int]) -> None:
        super().__init__(lambda key: last_use.get(key, -1) > self.now)
        self.now = 0

    def advance(self, request_index: int) -> None:
        self.now = request_index


class CountedLFU(RankedLeaves):
    """Every past use counted, never forgotten (the online estimate of popularity)."""

    def __init__(self) -> None:
        self.seen: dict[Any, int] = {}
        super().__init__(lambda key: self.seen.get(key, 0))

    def insert(self, key: Any, parent: Any) -> None:
        if key not in self.nodes:
            self.seen[key] = self.seen.get(key, 0) + 1
        super().insert(key, parent)

    def touch(self, keys: Any) -> None:
        for key in keys:
            if key in self.nodes:
                self.seen[key] = self.seen.get(key, 0) + 1
        super().touch(keys)


class _Node:
    __slots__ = ("cls", "depth", "idx", "parent", "time")


class LHD(EvictionPolicy):
    """Hit density by (class, age) as in LHD, leaves only, ``SAMPLES`` sampled leaves per victim."""

    def __init__(self, frozen: list[list[float]] | None = None, coarse: int = 1) -> None:
        self.clock, self.events, self.coarse = 0, 0, coarse
        self.nodes: dict[Any, _Node] = {}
        self.children: dict[Any, int] = {}
        self.keys_list: list[Any] = []
        self.rng = random.Random(1)
        self.uses: dict[Any, int] = {}
        self.hits = [[0.0] * AGES for _ in range(CLASSES)]
        self.evictions = [[0.0] * AGES for _ in range(CLASSES)]
        self.frozen = frozen is not None
        self.density = frozen if frozen is not None else [[1.0 / (a + 1) for a in range(AGES)] for _ in range(CLASSES)]

    def age(self, node: _Node) -> int:
        return min((self.clock - node.time) // self.coarse, AGES - 1)

    def insert(self, key: Any, parent: Any) -> None:
        if key in self.nodes:
            self.touch([key])
            return
        self.clock += 1
        node = _Node()
        node.time, node.parent = self.clock, parent
        up = self.nodes.get(parent) if parent is not None else None
        node.depth = up.depth + 1 if up else 0
        uses = self.uses.get(key, 0)
        self.uses[key] = uses + 1
        node.cls = min(uses, CLASSES - 1)
        node.idx = len(self.keys_list)
        self.keys_list.append(key)
        self.nodes[key] = node
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1
        self.tick()

    def touch(self, keys: Any) -> None:
        for key in keys:
            node = self.nodes.get(key)
            if node is None:
                continue
            self.hits[node.cls][self.age(node)] += 1
            uses = self.uses.get(key, 0)
            self.uses[key] = uses + 1
            node.cls = min(uses, CLASSES - 1)
            node.time = self.clock
            self.tick()

    def tick(self) -> None:
        self.events += 1
        if self.events >= max(256, len(self.nodes)) and not self.frozen:
            self.events = 0
            self.recompute()

    def recompute(self) -> None:
        """Hit density per age: expected hits over expected remaining lifetime (LHD, §3), then
        decay the counts (x0.9) and re-coarsen ages to span ~8 tier-sizes of insertions."""
        for c in range(CLASSES):
            hits, evictions, density = self.hits[c], self.evictions[c], self.density[c]
            hits_up = events_up = life_up = 0.0
            for a in range(AGES - 1, -1, -1):
                hits_up += hits[a]
                events_up += hits[a] + evictions[a]
                life_up += events_up
                density[a] = hits_up / life_up if life_up > 0 else 0.0
                hits[a] *= 0.9
                evictions[a] *= 0.9
        self.coarse = max(1, (8 * max(len(self.nodes), 1)) // AGES)

    def remove(self, key: Any) -> None:
        node = self.nodes.pop(key, None)
        if node is None:
            return
        if not self.frozen:
            self.evictions[node.cls][self.age(node)] += 1
        last = self.keys_list.pop()
        if last != key:
            self.keys_list[node.idx] = last
            self.nodes[last].idx = node.idx
        if node.parent is not None:
            left = self.children[node.parent] - 1
            if left:
                self.children[node.parent] = left
            else:
                del self.children[node.parent]

    def victim(self, evictable: Any = always_evictable) -> Any:
        keys, nodes, children = self.keys_list, self.nodes, self.children
        best, best_rank, found = None, None, 0
        for _ in range(8 * SAMPLES):
            key = keys[int(self.rng.random() * len(keys))]
            if key in children or not evictable(key):
                continue
            node = nodes[key]
            rank = (self.density[node.cls][self.age(node)], -node.depth)
            if best_rank is None or rank < best_rank:
                best, best_rank = key, rank
            found += 1
            if found >= SAMPLES:
                break
        if best is None:
            best = next((k for k in keys if k not in children and evictable(k)), None)
        return best

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, key: object) -> bool:
        return key in self.nodes

    def keys(self) -> Any:
        return self.nodes.keys()


def synthetic(regime: str, seed: int, requests: int, sets: dict[str, str]) -> tuple[Trace, dict[Any, float]]:
    """The trace as ``kvtier trace synth`` writes it (ids renumbered as the reader does), and each
    chunk's probability of use per request for rag and batch (empty for other regimes)."""
    params = synth.make_params(regime, sets)
    owner: dict[int, Any] = {}
    plain = synth_blocks.Blocks.ids

    def ids(self: Any, prefix: Any, num_tokens: int) -> tuple[int, ...]:
        out = plain(self, prefix, num_tokens)
        for block in out:
            owner.setdefault(block, prefix)
        return out

    synth_blocks.Blocks.ids = ids  # type: ignore[method-assign]
    try:
        records = synth.generate(regime, params, requests, seed)
    finally:
        synth_blocks.Blocks.ids = plain  # type: ignore[method-assign]
    dense: dict[int, int] = {}
    keys = [[dense.setdefault(h, len(dense)) for h in r.hash_ids[: r.input_length // 512]] for r in records]
    trace = Trace(regime, 512, [r.timestamp_ms / 1000 for r in records], [r.input_length for r in records], keys)
    probability: dict[Any, float] = {}
    if regime == "rag":
        total = sum(1 / (r + 1) ** params.zipf_s for r in range(params.documents))
        probability = {dense[b]: 1 / (p[1] + 1) ** params.zipf_s / total for b, p in owner.items() if b in dense}
    elif regime == "batch":
        template = (1 - params.hot_share) / params.templates
        hot = params.hot_share / params.hot_prompts
        probability = {dense[b]: template if p[0] == "template" else hot for b, p in owner.items() if b in dense}
    return trace, probability


def references(trace: Trace, capacity: int, engine_chunks: int, probability: dict[Any, float],
               skip: set[str]) -> dict[str, float]:
    """Token hit ratio (%) of lru, lru-tail, default, belady and each reference not in ``skip``
    (``lfu`` and ``a0`` only when ``probability`` is given), one cpu tier of ``capacity`` chunks."""
    engine, parents = engine_prefix_hits(trace, engine_chunks), chunk_parents(trace)

    def ratio(make: Callable[[], EvictionPolicy]) -> float:
        counts = replay(trace, engine, capacity, 0, make, parents)
        return 100 * (counts.engine_hits + counts.cpu_hits) * trace.block_tokens / counts.prompt_tokens

    oracle = TraceOracle(trace)
    last_use = {key: uses[-1] for key, uses in oracle.uses.items()}  # last use that can hit
    rows = {name: ratio(lambda n=name: make_policy(n)) for name in ("lru", "lru-tail", "default")}
    rows["belady"] = ratio(lambda: BeladyPolicy(oracle))
    if "bit" not in skip:
        rows["bit"] = ratio(lambda: BitOracle(last_use))
    if "lhd" not in skip:
        rows["lhd"] = ratio(LHD)
    if "lhd-known" not in skip:
        learned: list[LHD] = []
        ratio(lambda: learned.append(LHD()) or learned[-1])
        learned[-1].recompute()
        tables, coarse = learned[-1].density, learned[-1].coarse
        rows["lhd-known"] = ratio(lambda: LHD(frozen=[row[:] for row in tables], coarse=coarse))
    if probability:
        rows["lfu"] = ratio(CountedLFU)
        rows["a0"] = ratio(lambda: RankedLeaves(lambda key: probability.get(key, 0.0)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regime")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--set", action="append", default=[], help="regime parameter NAME=VALUE")
    parser.add_argument("--bundled", action="store_true", help="the bundled Mooncake trace (40 GiB engine tier)")
    parser.add_argument("--pct", type=float, required=True, help="cpu capacity, %% of distinct chunks")
    parser.add_argument("--skip", default="", help="references to skip, comma-separated")
    args = parser.parse_args()
    probability: dict[Any, float] = {}
    engine_chunks = 0
    if args.bundled:
        path = resources.files("kvtier") / "data" / "mooncake_conversation_trace.jsonl.gz"
        with resources.as_file(path) as file:
            trace = read_trace(file)
        engine_chunks = 640  # 40 GiB of 64 MiB chunks
    else:
        trace, probability = synthetic(args.regime, args.seed, args.requests, dict(s.split("=", 1) for s in args.set))
    capacity = max(1, round(trace.num_unique_chunks * args.pct / 100))
    rows = references(trace, capacity, engine_chunks, probability, set(args.skip.split(",")))
    best_lru, belady = max(rows["lru"], rows["lru-tail"]), rows["belady"]
    gap = belady - best_lru
    print(f"capacity {capacity} chunks ({args.pct:g} % of {trace.num_unique_chunks:,} distinct)")
    for name, value in rows.items():
        closed = f"{100 * (value - best_lru) / gap:6.1f} %" if gap > 0 and name not in ("lru", "lru-tail") else ""
        print(f"  {name:10s} {value:6.2f} {closed}")


if __name__ == "__main__":
    main()
