"""Eviction policies, shared by the real store and the simulator (``kvtier.simulate``).

See :mod:`kvtier.core.policies.base` for the contract and :func:`make_policy` for names.
"""

from kvtier.core.policies.base import EvictionPolicy
from kvtier.core.policies.registry import DEFAULT_POLICY, available_policies, make_policy

__all__ = ["DEFAULT_POLICY", "EvictionPolicy", "available_policies", "make_policy"]
