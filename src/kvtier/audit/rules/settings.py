"""How audit rules read kvtier's own settings off a serve line or a manifest.

kvtier reads ``kv_connector_extra_config`` over its ``KVTIER_*`` environment variables
(src/kvtier/core/config.py); the rules read the raw values the same way, without building a
configuration, so one bad value cannot hide the findings of the others.
"""

from __future__ import annotations

import math
import posixpath
from typing import Any

from kvtier.audit.model import ServeConfig
from kvtier.core.tiers.registry import asked_by


def kvtier_settings(c: ServeConfig) -> dict[str, Any] | None:
    """The KVTierConnector's settings: ``kv_connector_extra_config`` over the ``KVTIER_*`` variables
    of the line or manifest (lower-case keys without the prefix); None when the line does not use kvtier."""
    if not c.uses("KVTierConnector"):
        return None
    settings: dict[str, Any] = {name[len("KVTIER_"):].lower(): value for name, value in c.env.items()
                                if name.upper().startswith("KVTIER_")}
    settings.update(c.connector_extra)
    return settings


def kvtier_setting(c: ServeConfig, key: str) -> Any:
    """One KVTierConnector setting from ``kv_connector_extra_config``, else its ``KVTIER_<KEY>`` variable;
    None when neither gives it (whether or not the line uses kvtier)."""
    if key in c.connector_extra:
        return c.connector_extra[key]
    return c.env.get(f"KVTIER_{key.upper()}")


def number(value: Any, default: float) -> float:
    """``value`` as a finite float, else ``default`` (a missing, non-numeric, NaN or infinite setting)."""
    try:
        got = float(value)
    except (TypeError, ValueError):
        return default
    return got if math.isfinite(got) else default


def left_out(settings: dict[str, Any], key: str) -> bool:
    """Whether the settings' ``tiers`` list, if given, leaves out the tier that ``key`` asks for
    (the registry's record listing ``key``; the raw list is read: no configuration is built)."""
    tiers = settings.get("tiers")
    return isinstance(tiers, list) and asked_by(key) not in tiers


def refused(settings: dict[str, Any], *keys: str) -> bool:
    """Whether kvtier's config refuses the values ``settings`` gives for ``keys`` (checked together, as
    the connector's validator checks them, with no ``KVTIER_*`` variable of this process): rule
    ``kvtier-config-invalid`` reports them, so a rule that would judge them, or a default standing in
    for them, says nothing.  False when ``settings`` gives none of ``keys``."""
    from kvtier.integrations.vllm.preflight_env import fine_alone

    given = {k: settings[k] for k in keys if k in settings}
    return bool(given) and not fine_alone(given)


def disk_tier(settings: dict[str, Any]) -> str | None:
    """``disk_path`` when the disk tier is on (a path, disk_gib > 0, its tier in tiers if given), else None."""
    path = settings.get("disk_path")
    if not isinstance(path, str) or not path or number(settings.get("disk_gib"), 0.0) <= 0:
        return None
    return None if left_out(settings, "disk_path") else path


def under(path: str, mount: str) -> bool:
    """Whether ``path`` is ``mount`` or inside it (POSIX paths, normalised; no file system access)."""
    path, mount = posixpath.normpath(path), posixpath.normpath(mount)
    return path == mount or path.startswith(mount.rstrip("/") + "/")
