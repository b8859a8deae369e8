"""Tiers by name, imported lazily (so ``redis`` stays optional until a redis tier is configured).

Adding a tier is one module with a ``from_config(ctx: TierContext) -> Tier | None`` function
(``None`` when the configuration does not ask for the tier), one line in :data:`TIER_FACTORIES`,
and one fixture in ``tests/core/test_tier_conformance.py``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, cast

from prometheus_client import CollectorRegistry

from kvtier.core.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.base import Tier

TIER_FACTORIES: dict[str, str] = {
    "cpu": "kvtier.core.tiers.cpu:from_config",
    "disk": "kvtier.core.tiers.disk:from_config",
    "redis": "kvtier.core.tiers.redis:from_config",
}
"""Tier name -> ``module:function`` building it from a :class:`TierContext`."""


class TierContext(NamedTuple):
    """What a tier factory gets: the configuration and the facts of one rank's store.

    Attributes:
        config: the kvtier configuration.
        namespace: 16-byte namespace digest (a tier never returns another namespace's chunks).
        chunk_bytes: payload bytes of one chunk.
        tp_size: tensor-parallel size (local capacities are totals / ``tp_size``).
        registry: prometheus registry for the tier's own metrics.
    """

    config: KVTierConfig
    namespace: bytes
    chunk_bytes: int
    tp_size: int
    registry: CollectorRegistry


def available_tiers() -> list[str]:
    """Registered tier names, in the default order."""
    return list(TIER_FACTORIES)


def make_tier(name: str, ctx: TierContext) -> Tier | None:
    """Build tier ``name`` from ``ctx``; ``None`` if the configuration does not ask for it.

    Raises:
        ConfigError: unknown name, or the tier's module cannot be imported (a missing optional
            dependency, named in the message).
    """
    target = TIER_FACTORIES.get(name)
    if target is None:
        raise ConfigError(f"unknown tier {name!r}; choose from {', '.join(TIER_FACTORIES)}")
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"tier {name!r} needs the Python package {exc.name!r}; "
                          f"install it (pip install {exc.name}) or remove the tier from the config") from None
    factory = cast(Callable[[TierContext], "Tier | None"], getattr(module, func_name))
    return factory(ctx)
