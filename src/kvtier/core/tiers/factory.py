"""Tiers built from a configuration, by their :class:`~kvtier.core.tiers.registry.TierSpec`
records: what a tier factory gets (:class:`TierContext`), whether a configuration asks for a tier,
its preflight check, and the tier itself.

The registry below this module reads no configuration; the configuration reads the registry
(tier names, settings models); this module reads both, so the arrows never turn back.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, cast

from prometheus_client import CollectorRegistry

from kvtier.core.config import KVTierConfig
from kvtier.core.tiers.registry import load, spec, specs

if TYPE_CHECKING:
    from kvtier.core.tiers.base import ClearResult, Tier
    from kvtier.core.tiers.probe import ProbeResult


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


def configured(name: str, config: KVTierConfig) -> bool:
    """Whether ``config`` asks for tier ``name`` (in ``tiers`` and its settings set).

    Raises:
        ConfigError: unknown name, or the tier's module cannot be imported.
    """
    if name not in config.tiers:
        return False
    record = spec(name)
    if record.configured is None:
        return True
    return bool(cast(Callable[[KVTierConfig], bool], load(record.configured, name))(config))


def shared_configured(config: KVTierConfig) -> list[str]:
    """The shared tiers ``config`` asks for, in order."""
    return [s.name for s in specs() if s.shared and configured(s.name, config)]


def check(name: str, config: KVTierConfig) -> list[tuple[str, str]]:
    """Tier ``name``'s preflight over ``config``: ``(key, message)`` per problem its start-up
    would refuse; empty if the tier has no check or is not configured.  First, each of the tier's
    client :attr:`~kvtier.core.tiers.registry.TierSpec.packages` must import here (start-up would
    fail without it); when one does not, that is the only problem reported."""
    record = spec(name)
    if not configured(name, config):
        return []
    for package in record.packages:
        try:
            importlib.import_module(package)
        except ImportError:
            return [(record.keys[0] if record.keys else name,
                     (f"the {name} tier needs the Python package '{package}', which is not installed here; install "
                     f"it (pip install 'kvtier[{name}]'; deploy/Dockerfile's image has every tier's client) or "
                     f"remove the {name} tier from the config"))]
    if record.check is None:
        return []
    return list(cast(Callable[[KVTierConfig], list[tuple[str, str]]], load(record.check, name))(config))


def advice(name: str, config: KVTierConfig) -> list[tuple[str, str]]:
    """Tier ``name``'s advice over ``config`` (:attr:`~kvtier.core.tiers.registry.TierSpec.advice`):
    ``(key, message)`` per warning; empty if the tier has none or is not configured.

    Raises:
        ConfigError: unknown name, or the tier's module cannot be imported.
    """
    record = spec(name)
    if record.advice is None or not configured(name, config):
        return []
    return list(cast(Callable[[KVTierConfig], list[tuple[str, str]]], load(record.advice, name))(config))


def make_tier(name: str, ctx: TierContext) -> Tier | None:
    """Build tier ``name`` from ``ctx``; ``None`` if the configuration does not ask for it.

    Raises:
        ConfigError: unknown name, or the tier's module cannot be imported (a missing optional
            dependency, named in the message).
    """
    factory = cast(Callable[[TierContext], "Tier | None"], load(spec(name).factory, name))
    return factory(ctx)


def reset_outside(name: str, config: KVTierConfig, namespace: bytes) -> ClearResult | None:
    """Tier ``name``'s reset hook (:attr:`~kvtier.core.tiers.registry.TierSpec.reset`) over
    ``namespace``; ``None`` when the tier has none or ``config`` does not ask for it.

    Raises:
        ConfigError: unknown name, or the tier's module cannot be imported.
    """
    record = spec(name)
    if record.reset is None or not configured(name, config):
        return None
    hook = cast(Callable[[KVTierConfig, bytes], "ClearResult"], load(record.reset, name))
    return hook(config, namespace)


def state_dir(config: KVTierConfig) -> Path | None:
    """The first configured tier's :attr:`~kvtier.core.tiers.registry.TierSpec.state_dir` (a
    directory that outlives the process as that tier's chunks do), in tier order; ``None`` when no
    configured tier has one.

    Raises:
        ConfigError: a tier's module cannot be imported.
    """
    for record in specs():
        if record.state_dir is not None and configured(record.name, config):
            found = cast(Callable[[KVTierConfig], "Path | None"], load(record.state_dir, record.name))(config)
            if found is not None:
                return found
    return None


def probe(name: str, config: KVTierConfig, deadline_s: float) -> ProbeResult | None:
    """Tier ``name``'s reachability probe (:attr:`~kvtier.core.tiers.registry.TierSpec.probe`)
    within ``deadline_s`` seconds; ``None`` when the tier has none or ``config`` does not ask for it.

    Raises:
        ConfigError: unknown name, the tier's module cannot be imported, or the probe cannot run
            (e.g. an unreadable password file: the tier's preflight check reports it).
    """
    record = spec(name)
    if record.probe is None or not configured(name, config):
        return None
    hook = cast(Callable[[KVTierConfig, float], "ProbeResult"], load(record.probe, name))
    return hook(config, deadline_s)
