"""Replay a trace through a model of the tiers and count hits, per tier.

The model, one request at a time in arrival order (no overlap between requests)::

    lookup:  chunk 0 .. a-1   hit in the engine's own prefix cache (tier 0, HBM)
             chunk a .. b-1   each found in cpu, else in disk (a chunk is only useful if every
                              chunk before it is available, so the walk stops at the first miss)
             chunk b ..       recomputed (prefill), as is the partial tail chunk
    then:    every full chunk of the prompt is resident in tier 0 (computed or loaded), and is
             offered to the cpu tier: resident ones are touched, missing ones are stored
             (write-through from the engine, like vLLM's offloading connector and LMCache:
             the engine drops HBM blocks silently, so they must be saved when computed).
             A chunk evicted from cpu spills to disk and to the shared tier (write-back, kvtier's
             TieredStore), each if its admission takes it (``judge(key, uses in cpu)``,
             :mod:`kvtier.core.policies.admission`); a disk or shared hit is promoted to cpu (it
             is stored there again) and stays where it was.  The shared tier (Redis/Valkey) evicts
             least recently used first (Redis ``maxmemory-policy allkeys-lru``); lookups go cpu,
             disk, shared.

Only the first ``(num_tokens - 1) // block_tokens`` chunks may hit: when a whole prompt is cached
the engine still recomputes the last token to get logits, and its block with it (vLLM
``vllm/v1/core/kv_cache_manager.py``, ``get_computed_blocks``: ``max_cache_hit_length =
request.num_tokens - 1``).

Tier 0 is modelled as vLLM's block pool: LRU with a prompt's tail evicted first
(:class:`kvtier.core.policies.lru.TailFirstLRUPolicy`).  It does not depend on the cpu/disk
policy or capacity (every prompt chunk ends up in HBM either way), so :func:`engine_prefix_hits`
is computed once per trace and shared by every run of a sweep.

The cpu and disk tiers are driven through the very objects the store uses
(:mod:`kvtier.core.policies`); the simulator owns only residency sets and counters.  Keys are
the trace's dense ``int`` ids (policies need only hashable keys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.core.policies.admission import make_admission
from kvtier.core.policies.base import EvictionPolicy
from kvtier.core.policies.lru import LRUPolicy, TailFirstLRUPolicy
from kvtier.simulate.trace import Trace


def lookup_limits(trace: Trace) -> list[int]:
    """Per request, how many leading chunks may hit: ``min(len(keys), (num_tokens - 1) // block)``."""
    block = trace.block_tokens
    return [min(len(keys), (tokens - 1) // block) for keys, tokens in zip(trace.chunk_keys, trace.num_tokens)]


def engine_prefix_hits(trace: Trace, engine_chunks: int) -> list[int]:
    """Per request, the number of leading chunks found in the engine's prefix cache (tier 0).

    Args:
        trace: the trace.
        engine_chunks: tier-0 capacity in chunks (0 disables the tier).

    Returns:
        shape ``[num_requests]``, each ``<= lookup_limits(trace)[i]``.
    """
    limits = lookup_limits(trace)
    if engine_chunks <= 0:
        return [0] * trace.num_requests
    policy = TailFirstLRUPolicy()
    resident: set[Any] = set()
    hits: list[int] = []
    for keys, limit in zip(trace.chunk_keys, limits):
        a = 0
        while a < limit and keys[a] in resident:
            a += 1
        hits.append(a)
        _admit(keys, resident, policy, engine_chunks)
    return hits


def _admit(keys: list[Any], resident: set[Any], policy: EvictionPolicy, capacity: int) -> None:
    """After a request, all of ``keys`` are in HBM; then the pool evicts down to ``capacity``.

    vLLM holds every block of a running request and frees them when it finishes, tail first
    (``touch`` in prompt order makes the tail-first LRU rank the head most recent), so the
    request's own head is the last of its chunks to go."""
    parent = None
    for key in keys:
        if key not in resident:
            resident.add(key)
            policy.insert(key, parent)
        parent = key
    policy.touch(keys)
    while len(resident) > capacity:
        victim = policy.victim()
        assert victim is not None  # the simulator never pins
        policy.remove(victim)
        resident.discard(victim)


@dataclass(frozen=True)
class ReplayCounts:
    """What one replay counted.  Chunk counts; multiply by ``block_tokens`` or chunk bytes.

    Attributes:
        prompt_tokens: sum of prompt lengths (tokens).
        lookup_chunks: chunks that could have hit (sum of :func:`lookup_limits`).
        engine_hits, cpu_hits, disk_hits: chunks served by each tier (not recomputed).
        cpu_stores, disk_stores: chunks written into each tier.
        cpu_evictions, disk_evictions: chunks evicted from each tier.
        shared_hits, shared_stores, shared_evictions: the same for the shared tier.
        cpu_loads, disk_loads, shared_loads: requests served at least one chunk by that tier
            (each pays the tier's latency once).
        rejected: chunks a lower tier's admission turned away.
    """

    prompt_tokens: int
    lookup_chunks: int
    engine_hits: int
    cpu_hits: int
    disk_hits: int
    cpu_stores: int
    disk_stores: int
    cpu_evictions: int
    disk_evictions: int
    shared_hits: int = 0
    shared_stores: int = 0
    shared_evictions: int = 0
    cpu_loads: int = 0
    disk_loads: int = 0
    shared_loads: int = 0
    rejected: int = 0


class OfflinePolicy(EvictionPolicy):
    """A policy that knows the future (simulator-only): the replay tells it the current request."""

    def advance(self, request_index: int) -> None:
        """The replay is now at request ``request_index`` (0-based, increasing)."""
        raise NotImplementedError


PolicyFactory = Callable[[], EvictionPolicy]


def chunk_parents(trace: Trace) -> dict[int, int | None]:
    """Each chunk id's parent (the chunk before it in the prompt; ``None`` for a first chunk).

    Keys are chained, so a chunk has one parent whatever request it appears in."""
    parents: dict[int, int | None] = {}
    for keys in trace.chunk_keys:
        parent = None
        for key in keys:
            parents[key] = parent
            parent = key
    return parents


def replay(trace: Trace, engine_hits: list[int], cpu_chunks: int, disk_chunks: int,
           make_policy: PolicyFactory, parents: dict[int, int | None] | None = None, *, shared_chunks: int = 0,
           admission: tuple[str, str] = ("all", "all"), write_through: bool = False) -> ReplayCounts:
    """Replay ``trace`` with one fresh policy per tier from ``make_policy``.

    Args:
        trace: the trace.
        engine_hits: :func:`engine_prefix_hits` for the engine capacity.
        cpu_chunks: cpu-tier capacity in chunks (>= 0).
        disk_chunks: disk-tier capacity in chunks (>= 0; 0 means no disk tier).
        make_policy: returns a fresh policy (called once per tier).
        parents: :func:`chunk_parents` of the trace (computed if not given; pass it when
            sweeping to compute it once).
        shared_chunks: shared-tier capacity in chunks (0: none).
        admission: admission policy names of the disk and the shared tier.
        write_through: the disk tier takes every chunk the cpu tier stores, when it stores it (kvtier's
            default ``write_mode: write-through``), instead of the chunks the cpu tier evicts (``write-back``,
            where admission applies); a cpu victim then needs no spill to disk.

    Returns:
        the counts of this run.
    """
    cpu_policy = make_policy()
    cpu_policy.set_capacity_below(disk_chunks + shared_chunks)  # as the store tells its cpu tier's policy
    disk_policy = make_policy() if disk_chunks > 0 else None
    if parents is None:
        parents = chunk_parents(trace)
    disk_admits = make_admission(admission[0]).judge
    shared_admits = make_admission(admission[1]).judge
    shared: set[Any] = set()
    shared_lru = LRUPolicy()
    uses: dict[Any, int] = {}  # cpu-resident chunk -> times served from cpu
    shared_hits = shared_stores = shared_evictions = cpu_loads = disk_loads = shared_loads = rejected = 0
    clocked = [p for p in (cpu_policy, disk_policy) if isinstance(p, OfflinePolicy)]
    cpu: set[Any] = set()
    disk: set[Any] = set()
    # Bound methods hoisted out of the loop: this loop runs ~300k chunks per replay.
    cpu_touch, cpu_insert = cpu_policy.touch, cpu_policy.insert
    cpu_victim, cpu_remove = cpu_policy.victim, cpu_policy.remove
    cpu_hits = disk_hits = cpu_stores = disk_stores = cpu_evictions = disk_evictions = 0
    limits = lookup_limits(trace)
    # Policies are typed for ChunkKey (bytes); the simulator's dense int ids work the same way.
    all_keys: list[list[Any]] = trace.chunk_keys  # type: ignore[assignment]
    parent_of: dict[Any, Any] = parents  # type: ignore[assignment]
    for r, keys in enumerate(all_keys):
        for policy in clocked:
            policy.advance(r)  # type: ignore[attr-defined]
        limit = limits[r]
        j = engine_hits[r]
        from_disk: list[Any] = []
        from_shared: list[Any] = []
        served = 0
        while j < limit:
            key = keys[j]
            if key in cpu:
                served += 1
                uses[key] = uses.get(key, 0) + 1
            elif key in disk:
                from_disk.append(key)
            elif key in shared:
                from_shared.append(key)
            else:
                break
            j += 1
        if served:
            cpu_hits += served
            cpu_loads += 1
        if from_disk:
            disk_hits += len(from_disk)
            disk_loads += 1
            assert disk_policy is not None
            disk_policy.touch(from_disk)
        if from_shared:
            shared_hits += len(from_shared)
            shared_loads += 1
            shared_lru.touch(from_shared)
        resident = [k for k in keys if k in cpu]
        if resident:
            cpu_touch(resident)
        if len(resident) == len(keys):
            continue
        parent = None
        for key in keys:
            if key not in cpu:
                cpu.add(key)
                cpu_insert(key, parent)
                cpu_stores += 1
                if write_through and disk_policy is not None and key not in disk:
                    disk.add(key)
                    disk_policy.insert(key, parent)
                    disk_stores += 1
                    if len(disk) > disk_chunks:
                        gone = disk_policy.victim()
                        assert gone is not None
                        disk_policy.remove(gone)
                        disk.discard(gone)
                        disk_evictions += 1
                if len(cpu) > cpu_chunks:
                    victim = cpu_victim()
                    assert victim is not None  # the simulator never pins
                    cpu_remove(victim)
                    cpu.discard(victim)
                    cpu_evictions += 1
                    used = uses.pop(victim, 0)
                    if shared_chunks > 0 and victim not in shared:
                        if shared_admits(victim, used):
                            shared.add(victim)
                            shared_lru.insert(victim, None)
                            shared_stores += 1
                            if len(shared) > shared_chunks:
                                gone = shared_lru.victim()
                                assert gone is not None  # the shared tier is over its size: not empty
                                shared_lru.remove(gone)
                                shared.discard(gone)
                                shared_evictions += 1
                        else:
                            rejected += 1
                    if write_through:
                        pass  # the disk tier took it when the cpu tier stored it
                    elif disk_policy is not None and victim not in disk and not disk_admits(victim, used):
                        rejected += 1
                    elif disk_policy is not None and victim not in disk:
                        disk.add(victim)
                        disk_policy.insert(victim, parent_of[victim])
                        disk_stores += 1
                        if len(disk) > disk_chunks:
                            gone = disk_policy.victim()
                            assert gone is not None
                            disk_policy.remove(gone)
                            disk.discard(gone)
                            disk_evictions += 1
            parent = key
    return ReplayCounts(sum(trace.num_tokens), sum(limits), sum(engine_hits), cpu_hits, disk_hits,
                        cpu_stores, disk_stores, cpu_evictions, disk_evictions, shared_hits, shared_stores,
                        shared_evictions, cpu_loads, disk_loads, shared_loads, rejected)
