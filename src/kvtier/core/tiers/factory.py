"""Tiers built from a configuration, by their plug-in objects
(:class:`~kvtier.core.tiers.plugin.TierPlugin`, :func:`plugin`): what
a tier's ``build`` gets (:class:`TierContext`), whether a configuration asks for a tier, its
preflight check and advice, and the tier itself.  The reset from outside the stores and the probe
are :mod:`kvtier.core.purge`'s (:func:`~kvtier.core.purge.reset_outside`, :func:`~kvtier.core.purge.probe_tier`).

The registry below this module reads no configuration; the configuration reads the registry
(tier names, settings models); this module reads both, so the arrows never turn back.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.tiers.plugin import TierContext, TierPlugin
from kvtier.core.tiers.registry import load_plugin, spec, specs

__all__ = ["TierContext", "advice", "check", "configured", "make_tier", "plugin", "shared_configured", "state_dir"]

if TYPE_CHECKING:
    from kvtier.core.tiers.base import Tier


def plugin(name: str) -> TierPlugin:
    """Tier ``name``'s plug-in object, checked against :class:`~kvtier.core.tiers.plugin.TierPlugin`.

    Raises:
        ConfigError: unknown name, its module cannot be imported (a missing optional dependency,
            named in the message), or the object is not a tier plug-in.
    """
    found = load_plugin(name)
    if not isinstance(found, TierPlugin):
        missing = [m for m in ("settings", "build", "configured", "check", "advice", "state_dir", "blobs")
                   if not hasattr(found, m)]
        raise ConfigError(f"tier {name!r}: {spec(name).plugin} is not a tier plug-in (it lacks {', '.join(missing)}); "
                          "derive it from kvtier.core.tiers.plugin.PluginDefaults")
    return found


def configured(name: str, config: KVTierConfig) -> bool:
    """Whether ``config`` asks for tier ``name`` (in ``tiers`` and its settings set).

    Raises:
        ConfigError: unknown name, or the tier's module cannot be imported.
    """
    return name in config.tiers and plugin(name).configured(config)


def shared_configured(config: KVTierConfig) -> list[str]:
    """The shared tiers ``config`` asks for, in order."""
    return [s.name for s in specs() if s.shared and configured(s.name, config)]


def check(name: str, config: KVTierConfig) -> list[tuple[str, str]]:
    """Tier ``name``'s preflight over ``config``: ``(key, message)`` per problem its start-up
    would refuse; empty if the tier has no check or is not configured."""
    return plugin(name).check(config) if configured(name, config) else []


def advice(name: str, config: KVTierConfig) -> list[tuple[str, str]]:
    """Tier ``name``'s advice over ``config`` (:meth:`~kvtier.core.tiers.plugin.TierPlugin.advice`):
    ``(key, message)`` per warning; empty if the tier has none or is not configured.

    Raises:
        ConfigError: unknown name, or the tier's module cannot be imported.
    """
    return plugin(name).advice(config) if configured(name, config) else []


def make_tier(name: str, ctx: TierContext) -> Tier | None:
    """Build tier ``name`` from ``ctx``; ``None`` if the configuration does not ask for it.

    Raises:
        ConfigError: unknown name, or the tier's module cannot be imported (a missing optional
            dependency, named in the message).
    """
    return plugin(name).build(ctx)


def state_dir(config: KVTierConfig) -> Path | None:
    """The first configured tier's :meth:`~kvtier.core.tiers.plugin.TierPlugin.state_dir` (a
    directory that outlives the process as that tier's chunks do), in tier order; ``None`` when no
    configured tier has one.

    Raises:
        ConfigError: a tier's module cannot be imported.
    """
    for record in specs():
        if configured(record.name, config):
            found = plugin(record.name).state_dir(config)
            if found is not None:
                return found
    return None
