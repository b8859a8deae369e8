"""``kvtier simulate --recommend --host-ram-gib/--nvme-gib``: kvtier size's tiers for the trace, replayed.

The tiers come from :func:`kvtier.simulate.hierarchy.plan_tiers`, the function ``kvtier size --trace``
calls with the same inputs, so the two commands print the same sizes; the replay then measures what
those tiers serve on the trace, beside what the model predicts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.simulate.hierarchy import (
    PredictedHits,
    disk_slower_than_prefill,
    host_reserve_gib,
    plan_tiers,
    replay_plan,
    stack_curve,
    usable_dram_gib,
    usable_nvme_gib,
    warm_set_from_trace,
)

if TYPE_CHECKING:
    from rich.console import Console

    from kvtier.simulate.cost import Throughputs
    from kvtier.simulate.sweep import SweepSpec
    from kvtier.simulate.trace import Trace


def _hits(label: str, hits: PredictedHits) -> str:
    return (f"  {label:<9} {hits.total:6.1%} = engine {hits.engine:.1%} + cpu {hits.cpu:.1%} + disk "
            f"{hits.disk:.1%}")


def print_plan(console: Console, trace: Trace, spec: SweepSpec, policy: str, tp: int, host_ram_gib: float | None,
               reserve_gib: float | None, nvme_gib: float | None, rates: Throughputs) -> None:
    """Print the tiers ``kvtier size`` recommends for ``trace`` at ``spec``'s engine size and chunk bytes,
    then one replay of them under ``policy`` (measured next to predicted token hit ratios)."""
    curve = stack_curve(trace)
    warm = warm_set_from_trace(curve, spec.chunk_bytes)
    reserve = reserve_gib if reserve_gib is not None else host_reserve_gib(tp)
    dram = usable_dram_gib(host_ram_gib, reserve) if host_ram_gib is not None else None
    nvme = usable_nvme_gib(nvme_gib) if nvme_gib is not None else None
    slower = disk_slower_than_prefill(spec.chunk_bytes / trace.block_tokens, rates)
    tiers = plan_tiers(warm, spec.engine_gib, dram, nvme, curve, spec.chunk_bytes, slower)

    def say(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    say(f"kvtier size's tiers for this trace (the same model, kvtier.simulate.hierarchy): warm set {warm:,.0f} GiB "
        f"(95% of the {curve.ceiling:.1%} ceiling), engine {spec.engine_gib:,.0f} GiB"
        + (f", DRAM usable {dram:,.0f} GiB ({host_ram_gib:,.0f} − {reserve:,.0f} reserved)" if dram is not None else "")
        + (f", NVMe usable {nvme:,.0f} GiB" if nvme is not None else ""))
    staging = " (staging only)" if tiers.staging else ""
    say(f"  cpu {tiers.cpu_gib:,.0f} GiB{staging}, disk {tiers.disk_gib:,.0f} GiB")
    for note in tiers.notes:
        say(f"  - {note}")
    if tiers.hits is None or tiers.offload_gib == 0:
        return
    say(f"replaying the trace once through those tiers (policy {policy}; the disk write-through, kvtier's "
        "default write_mode, as the tiers above assume) ...")
    measured = replay_plan(trace, tiers, spec.chunk_bytes, policy)
    say(_hits("predicted", tiers.hits))
    say(_hits("replayed", measured))
