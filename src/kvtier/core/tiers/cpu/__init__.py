"""The cpu tier: the top tier, host DRAM of one rank's process (one pool of fixed-size pages, one
chunk per page; nothing outlives the process).

Modules:

- :mod:`~kvtier.core.tiers.cpu.tier`: :class:`~kvtier.core.tiers.cpu.tier.CpuTier` and its factory.

Its plug-in object is :data:`kvtier.core.tiers.builtin.CPU`.  Nothing is imported here: a
submodule is loaded only by the code that names it.
"""
