"""The scheduler's half of a reset: clearing, from vLLM's scheduler process, the tiers that outlive the workers.

vLLM calls ``reset_cache()`` on the scheduler-side connector
(:meth:`~kvtier.integrations.vllm.scheduler.side.SchedulerSide.reset_cache`); the workers' stores get
the order only with the next step's metadata, and an idle engine runs no step.  What a restart
would find (the disk tier's files, the shared tier's keys under ``reset_scope: all``) is therefore
removed here at once, for every rank's namespace, through each tier's registry hook
(:func:`kvtier.core.purge.reset_outside`); the cpu tier dies with its process and is
cleared by the workers.  :class:`Resets` keeps the engine's resets: their epoch, the order the
next step ships, their counters.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.purge import reset_outside as tier_reset
from kvtier.core.tiers.registry import reset_tiers
from kvtier.integrations.vllm.protocol import ResetOrder

if TYPE_CHECKING:
    from kvtier.integrations.vllm.scheduler.events import KVEventTracker
    from kvtier.integrations.vllm.scheduler.remote import RemoteLookups
    from kvtier.integrations.vllm.scheduler.steps import IndexMirror

log = logging.getLogger(__name__)


@dataclass
class ResetOutcome:
    """What :func:`reset_outside` did.

    Attributes:
        removed: chunk keys removed, by tier (all ranks' namespaces together, each key once).
        problems: one phrase per tier and namespace that could not be cleared whole.
        unknown_namespaces: ranks whose namespace was not reported yet (a fresh engine that ran no
            step): their tiers are cleared by the workers when the order arrives, before any load.
    """

    removed: dict[str, list[bytes]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    unknown_namespaces: int = 0

    def describe(self) -> str:
        """``"12 disk chunks"``-style summary for a log line."""
        parts = [f"{len(keys)} {tier} chunks" for tier, keys in self.removed.items()]
        if self.unknown_namespaces:
            parts.append(f"{self.unknown_namespaces} ranks not reported yet (cleared at their first step)")
        return ", ".join(parts) or "nothing outside the workers"


def reset_outside(config: KVTierConfig, tiers: Sequence[str], namespaces: Sequence[bytes]) -> ResetOutcome:
    """Run the reset hook of each tier in ``tiers`` over each rank's namespace in ``namespaces``
    (``b""``: not reported yet).  Never raises: a failure is a problem in the outcome."""
    out = ResetOutcome(unknown_namespaces=sum(1 for ns in namespaces if not ns))
    for tier in tiers:
        for namespace in namespaces:
            if not namespace:
                continue
            try:
                result = tier_reset(tier, config, namespace)
            except (ConfigError, OSError) as exc:
                out.problems.append(f"{tier} tier of namespace {namespace.hex()}: {exc}")
                continue
            if result is None:
                continue
            out.removed.setdefault(tier, []).extend(bytes(k) for k in result.keys)
            if not result.ok:
                out.problems.append(f"{tier} tier of namespace {namespace.hex()}: {result.reason}")
    # every rank stores its own KV heads of a chunk under the same key: one key per chunk
    out.removed = {tier: list(dict.fromkeys(keys)) for tier, keys in out.removed.items()}
    return out


class Resets:
    """The resets vLLM asked of this engine's scheduler side.

    Args:
        config: kvtier configuration (``reset_scope``, the tiers' settings).
    """

    def __init__(self, config: KVTierConfig) -> None:
        self.config = config
        self.epoch = 0  # resets acknowledged so far
        self.order: ResetOrder | None = None  # shipped with the next step's metadata (take_order)
        self.counts: dict[str, int] = {}  # reset counters not yet sent to /metrics (take_counts)

    def run(self, mirror: IndexMirror, events: KVEventTracker | None, remote: RemoteLookups | None) -> bool:
        """vLLM's external prefix-cache reset (``/reset_prefix_cache?reset_external=true``): clear the
        tiers ``reset_scope`` names, for this engine's namespaces only.

        "Done" (the return value ``True``) means, when this returns: no hit is planned from anything
        held before (the mirror is emptied and drops the ranks' reports until they applied the
        order; the caller drops the hits it offered); the order rides the next step's metadata, where
        every rank fails its loads that started before (recomputed), then clears its store before
        that step's loads and saves; the tiers that outlive the process (disk files, the shared
        tier's keys under ``all``) are already cleared here, for every rank's namespace, and a disk
        directory carries a marker until its rank applied the order, so a restart before the next
        step serves nothing of before either (:mod:`kvtier.core.tiers.disk.reset`).  The cpu tier is
        emptied by the next step, which an idle engine takes for it (the caller wakes ``Settle``).

        Returns:
            ``False`` (one log line saying why) when a tier could not be cleared (a disk file not
            removed, the shared server unreachable); the rest is done all the same.
        """
        self.epoch += 1
        tiers = tuple(reset_tiers(self.config.reset_scope))
        planned = forget_mirror(mirror, self.epoch)
        if events is not None:
            events.reset()  # every announced chunk: BlockRemoved at the next step
        if remote is not None:
            remote.forget_all()  # answers asked before the reset may count chunks it removes
        self.order = ResetOrder(self.epoch, tiers)
        outcome = reset_outside(self.config, tiers, mirror.namespaces)
        removed = {t: list(dict.fromkeys((*planned.get(t, ()), *outcome.removed.get(t, ()))))
                   for t in dict.fromkeys((*planned, *outcome.removed))}
        # what the mirror held (every rank, in the slowest tier of each) and what was removed here; the
        # KV events' BlockRemoved come from KVEventTracker.reset: every chunk the router was told of
        log.debug("kvtier: reset removed %s", ", ".join(f"{len(keys)} {tier} chunks" for tier, keys in
                                                       removed.items()) or "nothing the scheduler knew of")
        self._count("resets")
        if outcome.problems:
            self._count("reset_failures")
            log.warning("kvtier: reset (scope %s) not complete: %s; the other tiers were cleared",
                        self.config.reset_scope, "; ".join(outcome.problems))
            return False
        log.info("kvtier: reset %d (scope %s: %s): no hit is planned from before it; removed %s; the workers "
                 "clear their stores at the next step", self.epoch, self.config.reset_scope, ", ".join(tiers),
                 outcome.describe())
        return True

    def take_order(self) -> ResetOrder | None:
        """The order for the next step's metadata (once)."""
        order, self.order = self.order, None
        return order

    def take_counts(self) -> dict[str, int]:
        """``resets`` and ``reset_failures`` since the last call."""
        counts, self.counts = self.counts, {}
        return counts

    def _count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1


def forget_mirror(mirror: IndexMirror, epoch: int) -> dict[str, list[bytes]]:
    """``mirror`` (:class:`~kvtier.integrations.vllm.scheduler.steps.IndexMirror`) forgets every rank's view;
    its ``apply`` drops reports older than ``epoch`` from now on.

    Returns:
        what the mirror held, by tier (a chunk held by every rank, in the slowest of its tiers):
        what the scheduler had planned hits from until now.
    """
    held: dict[str, list[bytes]] = {}
    if mirror.ready:
        for key in mirror.ranks[0]:
            tier = mirror.tier(key)
            if tier is not None:
                held.setdefault(tier, []).append(key)
    mirror.epoch = epoch
    for index in mirror.ranks:
        index.clear()
    return held
