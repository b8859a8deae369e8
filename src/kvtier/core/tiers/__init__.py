"""Storage tiers: where chunk bytes live.

See :mod:`kvtier.core.tiers.base` for the contract and :mod:`kvtier.core.tiers.registry` for
tiers by name.  Names are imported on first use (PEP 562), so importing one submodule (e.g. the
registry, which :mod:`kvtier.core.stats` reads) never loads the others; ``redis`` loads on demand.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.core.tiers.base import GetResult, PutResult, StagingTier, Tier, TierUsage
    from kvtier.core.tiers.cpu.tier import CpuTier
    from kvtier.core.tiers.disk.tier import DiskTier
    from kvtier.core.tiers.factory import TierContext, make_tier
    from kvtier.core.tiers.registry import available_tiers

_WHERE = {"GetResult": "base", "PutResult": "base", "StagingTier": "base", "Tier": "base", "TierUsage": "base",
          "CpuTier": "cpu.tier", "DiskTier": "disk.tier", "TierContext": "factory", "available_tiers": "registry",
          "make_tier": "factory"}

__all__ = ["CpuTier", "DiskTier", "GetResult", "PutResult", "StagingTier", "Tier", "TierContext", "TierUsage",
           "available_tiers", "make_tier"]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{where}"), name)
