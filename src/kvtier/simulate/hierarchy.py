"""One model of the KV cache hierarchy, shared by ``kvtier size``, ``kvtier simulate`` and ``kvtier audit``.

**Inclusive tiers.**  kvtier, like vLLM's native offload (``OffloadingConnector``), stores every chunk
the engine computes (write-through from the engine: vLLM drops HBM blocks without telling a
connector, so they are saved when computed; docs/architecture.md), and its disk tier in the default
``write_mode: write-through`` takes every chunk the cpu tier takes.  Each tier therefore holds the
most recent chunks of the tier above it as well as its own: with eviction by recency in both, a cpu
tier not larger than the engine's KV cache holds nothing the engine does not already hold, and
serves nothing (``kvtier simulate`` on the bundled Mooncake trace, Llama-3.1-70B at TP 8 on 8× H200,
847 GiB of HBM KV: a 414 GiB cpu tier under ``--policy lru`` serves 0.0 % of prompt tokens; see
docs/size.md "Worked example").  A disk tier likewise serves only past ``max(engine, cpu)``.

**The curve.**  Under that model the whole stack behaves as one LRU cache as large as its largest
tier, and an LRU cache of ``c`` chunks hits exactly the uses whose reuse distance (distinct chunks
since the previous use; Mattson et al., "Evaluation techniques for storage hierarchies", IBM Systems
Journal 9(2), 1970) is below ``c``.  :func:`stack_curve` computes every distance of a trace once
(:func:`kvtier.simulate.reuse.reuse_distances`); :meth:`StackCurve.hit_ratio` then gives the token
hit ratio of any capacity: prompt tokens of chunks that may hit (the last token of a prompt is
always recomputed, :func:`kvtier.simulate.replay.lookup_limits`) over all prompt tokens, the
quantity ``kvtier simulate`` reports as "hit".  A tier between capacities ``a < b`` serves
``hit_ratio(b) − hit_ratio(a)``.

**The sizing rule** (:func:`plan_tiers`; sizes GiB, totals across tensor-parallel ranks)::

    warm set W  = the smallest capacity reaching 95 % of the ceiling (a trace), or
                  sessions × bytes per session × 1.15 (no trace; the how-to's ~15 % headroom)
    W ≤ engine  : no offload tier
    cpu         = min(W, usable DRAM), kept only if larger than the engine's KV cache
    disk        = min(W, usable NVMe), kept only if W is larger than max(engine, cpu) and the
                  disk is too; with a disk and no cpu worth keeping, a staging cpu tier of
                  :data:`MIN_STAGING_GIB` (kvtier passes every chunk through its cpu tier)

**Reserves** (:func:`usable_dram_gib`, :func:`usable_nvme_gib`): DRAM left for the cpu tier is host RAM
minus :data:`NODE_RESERVE_GIB` for the node and :data:`WORKER_RESERVE_GIB` per vLLM worker (one per
GPU), unless the operator gives the reserve; NVMe left for the disk tier is the capacity over
:data:`NVME_HEADROOM`, the room ``kvtier audit`` asks a disk tier's volume to keep.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvtier.simulate.cost import Throughputs
from kvtier.simulate.replay import lookup_limits
from kvtier.simulate.reuse import reuse_distances
from kvtier.simulate.trace import Trace

GIB = 1 << 30
SHARE = 0.95
"""Share of the ceiling (a cache that never evicts) the warm set must reach; ``kvtier simulate
--recommend`` reads its curves with the same share."""
SESSION_HEADROOM = 1.15
"""Headroom on a warm set given as sessions × context (the how-to's "add ~15 % headroom"); a warm set
measured on a trace needs none."""
MIN_STAGING_GIB = 4.0
"""cpu tier kept in front of a disk tier when no larger cpu tier is worth its DRAM (GiB): kvtier stages
every chunk through its cpu tier, so a disk tier with ``cpu_gib: 0`` cannot work (kvtier.core.config)."""
NODE_RESERVE_GIB = 16.0
"""Host RAM kept for the operating system and node agents (GiB): kvtier size's default since its first
release (docs/size.md)."""
WORKER_RESERVE_GIB = 16.0
"""Host RAM kept per vLLM worker (one per GPU), GiB: what the shipped manifests give vLLM's own process
next to the cpu tier ("vLLM's own ~16 GiB", deploy/kubernetes/local-tiers/vllm.yaml resources)."""
NVME_HEADROOM = 1.10
"""A disk tier's volume must be this much larger than ``disk_gib`` (file system, chunk files in flight):
kvtier audit's rule ``kvtier-disk-volume-unfit`` (kvtier/audit/rules/deploy.py ``VOLUME_HEADROOM``)."""


def host_reserve_gib(workers: int) -> float:
    """Host RAM kept back from the cpu tier, GiB: the node's plus one worker's per GPU (``workers`` ≥ 1)."""
    return NODE_RESERVE_GIB + WORKER_RESERVE_GIB * max(1, workers)


def usable_dram_gib(host_ram_gib: float, reserve_gib: float) -> float:
    """DRAM the cpu tier may take, GiB (never negative)."""
    return max(0.0, host_ram_gib - reserve_gib)


def cpu_room_gib(host_ram_gib: float | None, reserve_gib: float, node_gib: float | None) -> float | None:
    """DRAM one engine's cpu tier may take, GiB; None: not capped (no host RAM, no node pool given).

    The node pool (docs/node.md: the DRAM tier shared by the host's engines) is host RAM too, so it
    comes out of host RAM less reserves; and the cpu tier stays no larger than the pool, which must
    hold at least one engine's hot set (kvtier audit ``kvtier-node-pool-below-working-set``)::

        cpu ≤ min(host RAM − reserves − node_gib, node_gib)
    """
    room = None if host_ram_gib is None else usable_dram_gib(host_ram_gib, reserve_gib + (node_gib or 0.0))
    return room if not node_gib else node_gib if room is None else min(room, node_gib)


def room_text(host_ram_gib: float | None, reserve_gib: float, node_gib: float | None, reserve_why: str = "") -> str:
    """How :func:`cpu_room_gib` came out, for a note: ``464 GiB = 512 − 48 reserved`` (then ``reserve_why``;
    ``0 GiB = max(0, 40 − 48 reserved)`` when the reserves take it all;
    with a pool: ``− 128 node pool``, and ``, at most the 128 GiB node pool ...``)."""
    room = cpu_room_gib(host_ram_gib, reserve_gib, node_gib)
    text = f"{gib_text(room or 0.0)} GiB"
    if host_ram_gib is not None:  # none left: max(0, …), not '0 GiB = 40 − 48 reserved'
        short = host_ram_gib < reserve_gib + (node_gib or 0.0)
        text += f" = {'max(0, ' if short else ''}{gib_text(host_ram_gib)} − {gib_text(reserve_gib)} reserved{reserve_why}"
        text += (f" − {gib_text(node_gib)} node pool" if node_gib else "") + (")" if short else "")
    if node_gib and room == node_gib:
        text += f"{',' if host_ram_gib is not None else ':'} at most the {gib_text(node_gib)} GiB node pool, which must hold one engine's cpu tier"
        half = usable_dram_gib(host_ram_gib, reserve_gib) / 2 if host_ram_gib is not None else 0.0
        if half > node_gib:  # DRAM left idle: a larger pool lets both grow
            text += f" (a {gib_text(half)} GiB pool, kvtier node serve --node-gib {gib_text(half)}, would use it all)"
    return text


def usable_nvme_gib(nvme_gib: float) -> float:
    """NVMe the disk tier may take, GiB: the capacity over :data:`NVME_HEADROOM`."""
    return max(0.0, nvme_gib / NVME_HEADROOM)


@dataclass(frozen=True)
class StackCurve:
    """Token hit ratio of an inclusive LRU stack as a function of its capacity, for one trace.

    Attributes:
        name: the trace's name.
        block_tokens: tokens per chunk.
        prompt_tokens: all prompt tokens of the trace.
        footprint_chunks: distinct chunks (a stack this large never evicts).
        distances: sorted reuse distances (chunks) of the uses that may hit, shape ``[k]``.
    """

    name: str
    block_tokens: int
    prompt_tokens: int
    footprint_chunks: int
    distances: tuple[int, ...]

    def hit_ratio(self, chunks: float) -> float:
        """Prompt tokens served by a stack of ``chunks`` chunks / prompt tokens (0 for 0 chunks)."""
        if chunks <= 0 or not self.prompt_tokens:
            return 0.0
        hits = bisect.bisect_left(self.distances, int(chunks))  # distance < capacity
        return hits * self.block_tokens / self.prompt_tokens

    @property
    def ceiling(self) -> float:
        """Hit ratio of a stack that never evicts."""
        return len(self.distances) * self.block_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def chunks_for(self, ratio: float) -> int:
        """The smallest capacity (chunks) whose hit ratio reaches ``ratio`` (≤ the ceiling); 0 for 0."""
        needed = -(-ratio * self.prompt_tokens // self.block_tokens)  # uses that must hit, rounded up
        if needed <= 0:
            return 0
        index = min(int(needed), len(self.distances)) - 1
        return self.distances[index] + 1


def stack_curve(trace: Trace) -> StackCurve:
    """The :class:`StackCurve` of ``trace`` (one pass, about 2 s for the bundled 12,031 requests)."""
    limits = lookup_limits(trace)
    distances = reuse_distances(trace)
    hits: list[int] = []
    position = 0
    for keys, limit in zip(trace.chunk_keys, limits):
        for index in range(len(keys)):
            distance = distances[position + index]
            if distance is not None and index < limit:
                hits.append(distance)
        position += len(keys)
    return StackCurve(trace.name, trace.block_tokens, sum(trace.num_tokens), trace.num_unique_chunks,
                      tuple(sorted(hits)))


@dataclass(frozen=True)
class PredictedHits:
    """Token hit ratios the curve predicts: what each tier serves (the curve between the capacity of
    the tier above and its own) and the whole stack, as ``kvtier simulate`` reports them."""

    engine: float
    cpu: float
    disk: float
    total: float


@dataclass(frozen=True)
class TierPlan:
    """Sizes of the offload tiers, GiB totals across TP ranks, and why.

    Attributes:
        engine_gib: the engine's KV cache (HBM), GiB.
        warm_set_gib: what the whole stack must hold, GiB.
        cpu_gib: the cpu tier (0: none needed).
        disk_gib: the disk tier (0: none).
        staging: ``cpu_gib`` is only the staging tier in front of the disk tier (it serves nothing).
        hits: predicted token hit ratios per serving tier (None without a trace).
        notes: one sentence per decision.
    """

    engine_gib: float
    warm_set_gib: float
    cpu_gib: float
    disk_gib: float
    staging: bool = False
    hits: PredictedHits | None = None
    notes: tuple[str, ...] = ()

    @property
    def offload_gib(self) -> float:
        """cpu + disk, GiB."""
        return self.cpu_gib + self.disk_gib


def disk_slower_than_prefill(bytes_per_token: float, rates: Throughputs) -> str | None:
    """Why a disk tier would not pay (loading a token from disk, then over PCIe, takes longer than
    recomputing it: :mod:`kvtier.simulate.cost`'s first-order model), or None when it pays.  The one test
    ``kvtier simulate --recommend`` and ``kvtier size`` apply."""
    load_s = bytes_per_token / (rates.disk_gb_per_s * 1e9) + bytes_per_token / (rates.cpu_gb_per_s * 1e9)
    if load_s < 1 / rates.prefill_tokens_per_s:
        return None
    return (f"slower than prefill ({rates.disk_gb_per_s:g} GB/s vs {rates.prefill_tokens_per_s:,.0f} tok/s)")


def warm_set_from_trace(curve: StackCurve, chunk_bytes: int, share: float = SHARE) -> float:
    """GiB the stack must hold to reach ``share`` of ``curve``'s ceiling."""
    return curve.chunks_for(share * curve.ceiling) * chunk_bytes / GIB


def gib_text(gib: float) -> str:
    """``gib`` as the size table prints it, two decimals, without trailing zeros (1.44, 1, 847.39):
    the notes and the table state the same figure."""
    return f"{gib:,.2f}".rstrip("0").rstrip(".")


def plan_tiers(warm_set_gib: float, engine_gib: float, dram_gib: float | None, nvme_gib: float | None,
               curve: StackCurve | None = None, chunk_bytes: int | None = None,
               disk_slower: str | None = None, dram_what: str = "the DRAM left after reserves") -> TierPlan:
    """The tiers to buy (the rule of the module docstring).

    Args:
        warm_set_gib: what the stack must hold, GiB.
        engine_gib: the engine's KV cache, GiB (all ranks).
        dram_gib: usable DRAM for the cpu tier (after reserves), GiB; None: unknown (not capped).
        nvme_gib: usable NVMe for the disk tier (after headroom), GiB; None: no NVMe given (no disk tier).
        curve, chunk_bytes: the trace's curve and bytes per chunk, for the predicted hit ratios.
        disk_slower: :func:`disk_slower_than_prefill`'s reason, when loading from disk does not pay: no disk tier.
        dram_what: what ``dram_gib`` is, for the notes (with a node pool: :func:`room_text`).

    Returns:
        the plan; ``cpu_gib == disk_gib == 0`` when the engine holds the warm set or no tier would serve.
    """
    notes: list[str] = []
    if warm_set_gib <= engine_gib:
        notes.append(f"Offload not needed: the warm set ({gib_text(warm_set_gib)} GiB) fits in the engine's KV cache "
                     f"({gib_text(engine_gib)} GiB).")
        return TierPlan(engine_gib, warm_set_gib, 0.0, 0.0, hits=_predict(curve, chunk_bytes, engine_gib, 0, 0),
                        notes=tuple(notes))
    cpu = warm_set_gib if dram_gib is None else min(warm_set_gib, dram_gib)
    staging = False
    if cpu <= engine_gib:
        notes.append(f"No cpu tier worth its DRAM: {dram_what} ({gib_text(cpu)} GiB) is not larger "
                     f"than the engine's KV cache ({gib_text(engine_gib)} GiB), and kvtier's tiers are inclusive (every "
                     "chunk the engine computes is stored), so such a cpu tier holds nothing the engine does not.")
        cpu = 0.0
    above = max(engine_gib, cpu)
    disk = 0.0
    if warm_set_gib > above:
        if disk_slower is not None:
            notes.append(f"No disk tier: loading a chunk from it is {disk_slower}: recomputing is faster. Give "
                         "--disk-gb-per-s (the drives' read bandwidth together) and --prefill-tokens-per-s if yours "
                         "differ.")
        elif nvme_gib is None:
            what = "the cpu tier" if cpu else "the engine's KV cache"
            notes.append(f"The warm set ({gib_text(warm_set_gib)} GiB) is larger than {what} ({gib_text(above)} GiB): give "
                         "--nvme-gib to size a disk tier for the rest.")
        else:
            disk = min(warm_set_gib, nvme_gib)
            if disk <= above:
                notes.append(f"No disk tier: the {gib_text(nvme_gib)} GiB of NVMe usable is not larger than the tiers "
                             f"above it ({gib_text(above)} GiB), which it would only repeat (write-through holds every "
                             "chunk of the cpu tier).")
                disk = 0.0
            else:
                notes.append(f"Disk tier {gib_text(disk)} GiB: " + (f"all the NVMe usable ({gib_text(nvme_gib)} GiB), less than "
                             "the warm set" if disk < warm_set_gib else "the whole warm set") + ", as a write-through "
                             "disk tier also holds every chunk of the cpu tier.")
    if disk and not cpu:
        cpu, staging = MIN_STAGING_GIB, True
        notes.append(f"A {MIN_STAGING_GIB:g} GiB cpu tier stages chunks in front of the disk tier (kvtier passes "
                     "every chunk through its cpu tier); it serves nothing itself.")
    elif cpu and dram_gib is not None and cpu < warm_set_gib:
        notes.append(f"cpu tier {gib_text(cpu)} GiB: all {dram_what} (the warm set is "
                     f"{gib_text(warm_set_gib)} GiB).")
    serving_cpu = 0.0 if staging else cpu
    return TierPlan(engine_gib, warm_set_gib, round(cpu, 2), round(disk, 2), staging,
                    _predict(curve, chunk_bytes, engine_gib, serving_cpu, disk), tuple(notes))


def _predict(curve: StackCurve | None, chunk_bytes: int | None, engine_gib: float, cpu_gib: float,
             disk_gib: float) -> PredictedHits | None:
    """Predicted token hit ratios: each tier serves the curve between the tier above and itself."""
    if curve is None or not chunk_bytes:
        return None
    per_gib = GIB / chunk_bytes
    engine = curve.hit_ratio(engine_gib * per_gib)
    with_cpu = max(engine, curve.hit_ratio(cpu_gib * per_gib))
    total = max(with_cpu, curve.hit_ratio(disk_gib * per_gib))
    return PredictedHits(engine, with_cpu - engine, total - with_cpu, total)


def replay_plan(trace: Trace, tiers: TierPlan, chunk_bytes: int, policy: str = "lru") -> PredictedHits:
    """Replay ``trace`` through ``tiers`` (``kvtier simulate``'s replay: the engine as vLLM's block pool,
    the cpu and disk tiers under ``policy``, the disk write-through as kvtier's default ``write_mode``)
    and return the token hit ratios it measures, to set beside :attr:`TierPlan.hits`.  One replay:
    about a minute on the bundled trace.

    Raises:
        ValueError: unknown policy name.
    """
    from kvtier.core.policies import make_policy
    from kvtier.simulate.replay import engine_prefix_hits, replay

    def chunks(gib: float) -> int:
        return int(gib * GIB / chunk_bytes + 1e-6)

    engine = engine_prefix_hits(trace, chunks(tiers.engine_gib))
    counts = replay(trace, engine, chunks(tiers.cpu_gib), chunks(tiers.disk_gib), lambda: make_policy(policy),
                    write_through=True)
    share = trace.block_tokens / counts.prompt_tokens
    served = (counts.engine_hits * share, counts.cpu_hits * share, counts.disk_hits * share)
    return PredictedHits(*served, sum(served))
