"""Storage tiers: where chunk bytes live.

See :mod:`kvtier.core.tiers.base` for the contract and :mod:`kvtier.core.tiers.registry` for
tiers by name.  Only the always-present tiers are imported here; ``redis`` loads on demand.
"""

from kvtier.core.tiers.base import GetResult, PutResult, StagingTier, Tier, TierUsage
from kvtier.core.tiers.cpu import CpuTier
from kvtier.core.tiers.disk import DiskTier
from kvtier.core.tiers.registry import TierContext, available_tiers, make_tier

__all__ = ["CpuTier", "DiskTier", "GetResult", "PutResult", "StagingTier", "Tier", "TierContext", "TierUsage",
           "available_tiers", "make_tier"]
