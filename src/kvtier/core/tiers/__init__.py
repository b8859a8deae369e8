"""Storage tiers: where chunk bytes live.  See :mod:`kvtier.core.tiers.base` for the contract."""

from kvtier.core.tiers.base import Tier, TierUsage
from kvtier.core.tiers.cpu import CpuTier
from kvtier.core.tiers.disk import DiskTier

__all__ = ["CpuTier", "DiskTier", "Tier", "TierUsage"]
