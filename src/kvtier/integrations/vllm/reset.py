"""The scheduler's half of a reset: clearing, from vLLM's scheduler process, the tiers that outlive the workers.

vLLM calls ``reset_cache()`` on the scheduler-side connector
(:meth:`~kvtier.integrations.vllm.scheduler.SchedulerSide.reset_cache`); the workers' stores get
the order only with the next step's metadata, and an idle engine runs no step.  What a restart
would find (the disk tier's files, the shared tier's keys under ``reset_scope: all``) is therefore
removed here at once, for every rank's namespace, through each tier's registry hook
(:func:`kvtier.core.purge.reset_outside`); the cpu tier dies with its process and is
cleared by the workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.purge import reset_outside as tier_reset


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
