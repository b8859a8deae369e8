"""From a KV geometry and a deployment, the HBM KV budget and the offload tiers to recommend.

Rule (the hierarchy model shared with ``kvtier simulate`` and ``kvtier audit``,
:mod:`kvtier.simulate.hierarchy`)::

    hbm_kv_budget   = tp × (gpu_memory × gpu_memory_utilization − weights / tp − overhead)
    warm_set        = from a trace: the smallest LRU capacity reaching 95 % of its ceiling;
                      else bytes_per_session × sessions_kept_warm × 1.15     (~15% headroom)
    cpu tier        = min(warm_set, host RAM − reserves), only if larger than hbm_kv_budget
    disk tier       = min(warm_set, NVMe / 1.1), only if larger than the tiers above

The how-to's ``(warm_set − hbm_kv_budget) × 1.15`` is not used: kvtier's tiers are inclusive (every
chunk the engine computes is stored), so a cpu tier no larger than the engine's KV cache serves
nothing.  All sizes are totals across tensor-parallel ranks (vLLM's ``--kv-offloading-size``
convention, operator's guide § "Sizing math"); per-rank figures are named so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvtier.core.errors import UserError
from kvtier.simulate.cost import Throughputs
from kvtier.simulate.hierarchy import (
    MIN_STAGING_GIB,
    SESSION_HEADROOM,
    StackCurve,
    cpu_room_gib,
    disk_slower_than_prefill,
    host_reserve_gib,
    plan_tiers,
    room_text,
    usable_nvme_gib,
    warm_set_from_trace,
)
from kvtier.size.geometry import KVGeometry
from kvtier.size.hardware import MAX_GPU_MEMORY_GIB
from kvtier.size.recipe import round_total

GIB = 1 << 30
HEADROOM = SESSION_HEADROOM
"""Headroom factor on a warm set given as sessions × context (how-to: "add ~15% headroom")."""
MIN_CPU_GIB = MIN_STAGING_GIB
"""Smallest DRAM tier recommended next to a disk tier (GiB, total): kvtier's store stages every chunk
through its cpu tier on the way to and from disk, so a disk tier with ``cpu_gib: 0`` cannot work."""


MAX_GIB = float(1 << 20)
"""Largest memory size accepted anywhere (GiB): 1 PiB, past any host or GPU, far below float overflow."""
MAX_COUNT = 100_000_000
"""Largest ``--context`` (tokens) and ``--sessions`` accepted."""


def check_finite(label: str, value: float | None, maximum: float = MAX_GIB) -> None:
    """Raise UserError when ``value`` is inf, NaN (Typer accepts both as floats) or above ``maximum``."""
    if value is not None and not math.isfinite(value):
        raise UserError(f"{label} must be a finite number, got {value}.")
    if value is not None and value > maximum:
        raise UserError(f"{label} must be at most {maximum:,.0f}, got {value:g}.")


@dataclass(frozen=True)
class Deployment:
    """How the model is served.

    Attributes:
        tp: tensor-parallel size.
        kv_dtype: ``"bf16"``, ``"fp16"`` or ``"fp8"``; dtype_bytes: its bytes per element.
        gpu_memory_gib: memory of one GPU (GiB) or None when unknown.
        gpu_memory_utilization: vLLM's fraction of GPU memory it may use.
        weights_gib: whole-model weights (GiB), split evenly over the TP ranks, or None.
        overhead_gib: per-GPU activation / CUDA graph overhead outside the KV cache (GiB).
        context_tokens: typical context of one session (tokens) or None.
        sessions: sessions to keep warm or None.
        host_ram_gib: host RAM of the node (GiB) or None.
        host_reserve_gib: host RAM kept back for the node and vLLM's workers (GiB); None: the rule
            :func:`kvtier.simulate.hierarchy.host_reserve_gib` (16 GiB + 16 GiB per GPU).
        nvme_gib: NVMe capacity for the disk tier (GiB) or None (no disk tier sized).
        node_gib: the host's node pool (GiB, ``--node-gib``) or None: it comes out of the DRAM the cpu tier
            may take, which stays no larger than it (:func:`kvtier.simulate.hierarchy.cpu_room_gib`).
    """

    tp: int = 1
    kv_dtype: str = "bf16"
    dtype_bytes: int = 2
    gpu_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    weights_gib: float | None = None
    overhead_gib: float = 4.0
    context_tokens: int | None = None
    sessions: int | None = None
    host_ram_gib: float | None = None
    host_reserve_gib: float | None = None
    nvme_gib: float | None = None
    node_gib: float | None = None

    @property
    def reserve_gib(self) -> float:
        """Host RAM kept back, GiB: as given, else 16 GiB for the node + 16 GiB per GPU (TP)."""
        return self.host_reserve_gib if self.host_reserve_gib is not None else host_reserve_gib(self.tp)

    def check(self) -> None:
        """Raise UserError for values that cannot describe a deployment."""
        for label, number in (("--gpu-memory-gib", self.gpu_memory_gib), ("--weights-gib", self.weights_gib),
                              ("--host-ram-gib", self.host_ram_gib), ("--overhead-gib", self.overhead_gib),
                              ("--host-reserve-gib", self.host_reserve_gib), ("--nvme-gib", self.nvme_gib)):
            check_finite(label, number)
        if self.gpu_memory_gib is not None and self.gpu_memory_gib > MAX_GPU_MEMORY_GIB:
            mib = self.gpu_memory_gib / 1024
            raise UserError(f"--gpu-memory-gib {self.gpu_memory_gib:,.6g} is beyond any GPU (at most "
                            f"{MAX_GPU_MEMORY_GIB:,.0f} GiB per GPU): if it is MiB (as nvidia-smi prints), that is "
                            f"--gpu-memory-gib {mib:,.4g}; give one GPU's memory in GiB.")
        if not 0 < self.gpu_memory_utilization <= 1:  # nan and inf fail too (a GiB bound said 1e300 was the fault)
            raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        for label, value in (("--gpu-memory-gib", self.gpu_memory_gib), ("--weights-gib", self.weights_gib),
                             ("--host-ram-gib", self.host_ram_gib), ("--overhead-gib", self.overhead_gib),
                             ("--host-reserve-gib", self.host_reserve_gib), ("--nvme-gib", self.nvme_gib)):
            if value is not None and value < 0:
                raise UserError(f"{label} must not be negative, got {value}.")
        for label, count in (("--context", self.context_tokens), ("--sessions", self.sessions)):
            check_finite(label, count, MAX_COUNT)
            if count is not None and count < 1:
                raise UserError(f"{label} must be at least 1, got {count}.")


@dataclass
class SizeReport:
    """Everything ``kvtier size`` prints.  Bytes are int bytes, ``*_gib`` are GiB (2**30 bytes)."""

    model: str
    source: str
    kind: str
    tp: int
    kv_dtype: str
    kv_bytes_per_token: int
    kv_bytes_per_token_per_rank: int
    kv_bytes_per_token_tp1: int
    kv_heads_per_rank: int
    sliding_window: int | None
    state_bytes_per_sequence: int
    context_tokens: int | None = None
    bytes_per_session: int | None = None
    hbm_kv_budget_bytes: int | None = None
    hbm_kv_tokens: int | None = None
    hbm_sessions: int | None = None
    sessions: int | None = None
    warm_set_bytes: int | None = None
    recommended_offload_gib: float | None = None
    host_ram_gib: float | None = None
    cpu_gib: float | None = None
    disk_gib: float | None = None
    notes: list[str] = field(default_factory=list)
    groups: list[dict[str, object]] = field(default_factory=list)
    host_reserve_gib: float | None = None
    nvme_gib: float | None = None
    trace: str | None = None
    cpu_staging: bool = False
    predicted_hits: dict[str, float] | None = None
    offload_no_room: str | None = None
    """Why no tier is recommended although the warm set exceeds the engine's KV cache (None: not that case)."""
    recommendation_notes_at: int | None = None
    """Index in ``notes`` of the first note about the recommended tiers (None: none recommended); not in JSON."""

    @property
    def offload_needed(self) -> bool | None:
        if self.offload_no_room is not None:  # needed, though the host leaves no tier worth its DRAM
            return True
        if self.recommended_offload_gib is None:
            return None
        return self.recommended_offload_gib > 0

    def to_json(self) -> dict[str, object]:
        """The ``--json`` object; its first four keys are the ones issue 6 fixes."""
        return {
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_per_rank": self.kv_bytes_per_token_per_rank,
            "hbm_kv_tokens": self.hbm_kv_tokens,
            "recommended_offload_gib": self.recommended_offload_gib,
            "offload_needed": self.offload_needed,
            "offload_no_room": self.offload_no_room,
            "model": self.model,
            "source": self.source,
            "kind": self.kind,
            "tp": self.tp,
            "kv_dtype": self.kv_dtype,
            "kv_bytes_per_token_tp1": self.kv_bytes_per_token_tp1,
            "kv_heads_per_rank": self.kv_heads_per_rank,
            "sliding_window": self.sliding_window,
            "state_bytes_per_sequence": self.state_bytes_per_sequence,
            "context_tokens": self.context_tokens,
            "bytes_per_session": self.bytes_per_session,
            "hbm_kv_budget_bytes": self.hbm_kv_budget_bytes,
            "hbm_sessions": self.hbm_sessions,
            "sessions": self.sessions,
            "warm_set_bytes": self.warm_set_bytes,
            "host_ram_gib": self.host_ram_gib,
            "cpu_gib": self.cpu_gib,
            "disk_gib": self.disk_gib,
            "notes": list(self.notes),
            "groups": [dict(g) for g in self.groups],
            "host_reserve_gib": self.host_reserve_gib,
            "nvme_gib": self.nvme_gib,
            "trace": self.trace,
            "cpu_staging": self.cpu_staging,
            "predicted_hits": dict(self.predicted_hits) if self.predicted_hits is not None else None,
        }


def hbm_kv_budget_bytes(dep: Deployment) -> int | None:
    """KV bytes vLLM can keep in HBM across all ranks, floored at 0; None without GPU memory or weights."""
    if dep.gpu_memory_gib is None or dep.weights_gib is None:
        return None
    per_gpu = dep.gpu_memory_gib * dep.gpu_memory_utilization - dep.weights_gib / dep.tp - dep.overhead_gib
    return max(0, int(per_gpu * GIB)) * dep.tp


def plan(geometry: KVGeometry, dep: Deployment, curve: StackCurve | None = None,
         rates: Throughputs | None = None) -> SizeReport:
    """Size the KV cache of ``geometry`` served as ``dep``; with ``curve`` (the trace's,
    :func:`kvtier.simulate.hierarchy.stack_curve`) the warm set is read from it instead of
    sessions × context; ``rates`` (default :class:`~kvtier.simulate.cost.Throughputs`, kvtier simulate's) decide
    whether a disk tier pays.

    Raises:
        UserError: a deployment value is invalid or TP does not fit the model's heads.
    """
    dep.check()
    geometry.check_tp(dep.tp)
    tp, nbytes = dep.tp, dep.dtype_bytes
    report = SizeReport(
        model=geometry.name,
        source=geometry.source,
        kind=geometry.kind,
        tp=tp,
        kv_dtype=dep.kv_dtype,
        kv_bytes_per_token=geometry.kv_bytes_per_token(tp, nbytes),
        kv_bytes_per_token_per_rank=geometry.kv_bytes_per_token_per_rank(tp, nbytes),
        kv_bytes_per_token_tp1=geometry.kv_bytes_per_token(1, nbytes),
        kv_heads_per_rank=geometry.kv_heads_per_rank(tp),
        sliding_window=geometry.sliding_window,
        state_bytes_per_sequence=geometry.state_bytes_per_sequence(tp),
        context_tokens=dep.context_tokens,
        sessions=dep.sessions,
        host_ram_gib=dep.host_ram_gib,
        host_reserve_gib=dep.reserve_gib if dep.host_ram_gib is not None else None,
        nvme_gib=dep.nvme_gib,
        trace=curve.name if curve is not None else None,
    )
    if len(geometry.groups(tp, nbytes)) > 1:  # a hybrid: one KV cache group per layer kind in vLLM
        report.groups = [{"kind": g.kind, "num_layers": g.num_layers, "bytes_per_token": g.bytes_per_token,
                          "held_tokens": g.held_tokens, "state_bytes_per_sequence": g.state_bytes_per_sequence}
                         for g in geometry.groups(tp, nbytes)]
    if report.kv_bytes_per_token > report.kv_bytes_per_token_tp1:
        why = "the MLA latent has no head dimension" if geometry.mla else f"{geometry.num_kv_heads} KV heads < TP {tp}"
        report.notes.append(
            f"KV is replicated across ranks ({why}): the TP-wide total is "
            f"{report.kv_bytes_per_token / report.kv_bytes_per_token_tp1:g}× the single-GPU figure."
        )
    if dep.context_tokens is not None:
        report.bytes_per_session = geometry.bytes_per_sequence(dep.context_tokens, tp, nbytes)
    budget = hbm_kv_budget_bytes(dep)
    if budget is None:
        missing = [what for what, value in (("--gpu (or --gpu-memory-gib)", dep.gpu_memory_gib),
                                             ("--weights-gib", dep.weights_gib)) if value is None]
        report.notes.append(f"HBM budget unknown: give {' and '.join(missing)}.")
    else:
        report.hbm_kv_budget_bytes = budget
        report.hbm_kv_tokens = budget // report.kv_bytes_per_token if report.kv_bytes_per_token else None
        if report.bytes_per_session:
            report.hbm_sessions = budget // report.bytes_per_session
        if budget == 0:
            report.notes.append("The weights leave no HBM for KV at this TP and utilization.")
    if curve is not None:
        chunk_bytes = report.kv_bytes_per_token * curve.block_tokens
        report.warm_set_bytes = int(warm_set_from_trace(curve, chunk_bytes) * GIB)
        if budget is not None:
            _recommend(report, budget, dep, report.warm_set_bytes, rates, curve, chunk_bytes)
    elif dep.sessions is not None and report.bytes_per_session is not None:
        report.warm_set_bytes = report.bytes_per_session * dep.sessions
        if budget is not None:
            _recommend(report, budget, dep, int(report.warm_set_bytes * HEADROOM), rates)
    elif dep.sessions is not None or dep.context_tokens is not None:
        report.notes.append("Give both --sessions and --context (or --trace) to size the offload tier.")
    return report


@dataclass(frozen=True)
class TierSplit:
    """An offload tier (GiB, totals across TP) split into a DRAM share and a disk share, with why."""

    cpu_gib: float
    disk_gib: float
    notes: tuple[str, ...] = ()


def split_tier(total_gib: float, host_ram_gib: float | None, host_reserve_gib: float, tp: int = 1,
               node_gib: float | None = None) -> TierSplit:
    """Put ``total_gib`` in host RAM, spilling to disk what exceeds the DRAM the cpu tier may take:
    ``host_ram_gib − host_reserve_gib``, less a node pool of ``node_gib`` and no larger than it
    (:func:`kvtier.simulate.hierarchy.cpu_room_gib`).

    Without ``host_ram_gib`` or ``node_gib`` everything stays in DRAM.  A disk share always comes with at least
    :data:`MIN_CPU_GIB` of DRAM (kvtier stages chunks through its cpu tier), even when that eats
    into the reserve; a note says so.  The notes name the sizes the recipes print, which round each
    share up to whole GiB per rank (``tp`` ranks, :func:`kvtier.size.recipe.round_total`).
    """

    room = cpu_room_gib(host_ram_gib, host_reserve_gib, node_gib)
    if room is None:
        return TierSplit(total_gib, 0.0)
    usable, usable_text = room, room_text(host_ram_gib, host_reserve_gib, node_gib)
    if total_gib <= usable:
        return TierSplit(total_gib, 0.0, (f"The tier fits in usable host RAM ({usable_text}).",))
    cpu = round(max(usable, min(MIN_CPU_GIB, total_gib)), 2)
    disk = round(max(0.0, total_gib - cpu), 2)
    disk_recipe, cpu_recipe = round_total(disk, tp), round_total(cpu, tp)
    rounded = (f" ({disk:g} GiB rounded up to whole GiB on each of {tp} ranks)" if tp > 1 and disk_recipe != disk
               else "")
    notes = [
        (f"The tier ({total_gib:g} GiB) exceeds usable host RAM ({usable_text}): put {disk_recipe:g} GiB on a disk "
         f"tier{rounded} or keep fewer sessions warm.")
    ]
    if cpu_recipe > usable:
        notes.append(
            f"A disk tier needs a DRAM tier in front of it (kvtier stages every chunk through its cpu tier), "
            f"so the recipe keeps {cpu_recipe:g} GiB of DRAM although only {usable:g} GiB is usable: "
            "lower --host-reserve-gib or add host RAM."
        )
    if 0 < disk_recipe <= cpu_recipe:  # docs/size.md § Inclusive tiers: the stack is as large as its largest tier
        notes.append(f"The disk tier ({disk_recipe:g} GiB) is no larger than the cpu tier ({cpu_recipe:g} GiB): in write_mode "
                     "write-through (the default) it takes every chunk the cpu tier takes, so it holds only what that "
                     f"tier holds (hits after a restart aside) and the cache is {cpu_recipe:g} GiB, not {total_gib:g}.")
    return TierSplit(cpu, disk, tuple(notes))


def _recommend(report: SizeReport, budget: int, dep: Deployment, warm_bytes: int, rates: Throughputs | None,
               curve: StackCurve | None = None, chunk_bytes: int | None = None) -> None:
    """Fill the report's tiers from :func:`kvtier.simulate.hierarchy.plan_tiers`."""
    if warm_bytes / GIB > MAX_GIB:
        raise UserError(f"the warm set needs a {warm_bytes / GIB:,.0f} GiB offload tier, more than the "
                        f"{MAX_GIB:,.0f} GiB kvtier size sizes (the bound of --offload-gib); lower --sessions or "
                        "--context.")
    dram = cpu_room_gib(dep.host_ram_gib, dep.reserve_gib, dep.node_gib)
    nvme = usable_nvme_gib(dep.nvme_gib) if dep.nvme_gib is not None else None
    slower = disk_slower_than_prefill(report.kv_bytes_per_token, rates or Throughputs())
    what = "the DRAM beside the node pool it may take" if dep.node_gib else "the DRAM left after reserves"
    tiers = plan_tiers(warm_bytes / GIB, budget / GIB, dram, nvme, curve, chunk_bytes, slower, what)
    report.recommended_offload_gib = round(tiers.offload_gib, 2)
    report.recommendation_notes_at = len(report.notes)
    report.notes.extend(tiers.notes)
    if tiers.hits is not None:
        report.predicted_hits = asdict(tiers.hits)
    if tiers.offload_gib == 0:
        if warm_bytes > budget and dram is not None:  # needed, but the host leaves no tier worth its DRAM
            room = (f"host RAM {dep.host_ram_gib:,.4g} GiB ≤ reserve {dep.reserve_gib:,.4g} GiB"
                    if dep.host_ram_gib is not None and dep.host_ram_gib <= dep.reserve_gib else
                    f"the DRAM the cpu tier may take ({room_text(dep.host_ram_gib, dep.reserve_gib, dep.node_gib)}) "
                    f"is not larger than the engine's KV cache ({budget / GIB:,.4g} GiB)")
            fix = "give --nvme-gib for a disk tier, add host RAM or lower --host-reserve-gib" \
                if dep.nvme_gib is None and not slower else "add host RAM or lower --host-reserve-gib (the notes say why no disk tier)"
            report.offload_no_room = f"{room}; {fix}"
        return
    report.cpu_gib, report.disk_gib, report.cpu_staging = tiers.cpu_gib, tiers.disk_gib, tiers.staging
    if dram is not None:
        reserve = ("" if dep.host_ram_gib is None else " (as given)" if dep.host_reserve_gib is not None else
                   f" (16 GiB for the OS and node agents + 16 GiB for each of {dep.tp} vLLM workers)")
        report.notes.append(f"DRAM for the cpu tier: {room_text(dep.host_ram_gib, dep.reserve_gib, dep.node_gib, reserve)}.")
        if tiers.cpu_gib > dram:
            report.notes.append(f"The {tiers.cpu_gib:g} GiB staging cpu tier exceeds usable host RAM ({dram:g} GiB): "
                                "lower --host-reserve-gib or add host RAM.")


def check_engine_starts(report: SizeReport, dep: Deployment, context: int | None) -> None:
    """Refuse a deployment whose engine would not start: the weights leave no HBM for KV, or less
    than one sequence of ``--context`` tokens (vLLM stops at startup: "No available memory for the
    cache blocks" / "To serve at least one request with the model's max seq len ... KV cache is
    needed", vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory).

    Raises:
        UserError: naming the budget and what would make room.
    """
    budget = report.hbm_kv_budget_bytes
    if budget is None:
        return
    one = report.bytes_per_session if context is not None else None
    if budget > 0 and (one is None or budget >= one):
        return
    tp = dep.tp
    usable = (dep.gpu_memory_gib or 0.0) * dep.gpu_memory_utilization
    what = (f"{dep.gpu_memory_gib:g} GiB × {dep.gpu_memory_utilization:g} = {usable:.2f} GiB per GPU, less the "
            f"weights' {(dep.weights_gib or 0.0) / tp:.2f} GiB and --overhead-gib {dep.overhead_gib:g}, leaves no HBM for the "
            "KV cache" if budget <= 0 else
            f"the HBM left for the KV cache ({budget / GIB:.2f} GiB) is less than one {context:,}-token sequence "
            f"needs ({(one or 0) / GIB:.2f} GiB)")
    raise UserError(f"vLLM would not start: {what} at TP {tp}; give a larger --tp, a GPU with more memory, a "
                    "higher --gpu-memory-utilization, a shorter --context or, if you measured less, a smaller "
                    "--overhead-gib (no offload recipe is printed for an engine that cannot start).")
