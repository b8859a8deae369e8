"""``adaptive-unguarded``: the adaptive policy without its LRU guard, the selector alone.

Only for comparison (the simulator's tables in docs/simulate.md, and the tests that show the hazard the guard
bounds); the default is the guarded ``adaptive`` of :mod:`kvtier.core.policies.adaptive`.
"""

from __future__ import annotations

from kvtier.core.policies.adaptive import AdaptivePolicy


class UnguardedAdaptivePolicy(AdaptivePolicy):
    """``adaptive`` without its LRU guard (``guard=False``)."""

    name = "adaptive-unguarded"

    def __init__(self) -> None:
        super().__init__(guard=False)
