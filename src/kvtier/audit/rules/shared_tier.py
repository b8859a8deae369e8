"""kvtier's shared (redis) tier on the serve line: protection beyond this host, secrets in the line."""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule

_DOCS = "kvtier docs/shared-tier.md"


def _redis(c: ServeConfig) -> tuple[str, dict[str, Any]] | None:
    """(redis_url, settings) of a KVTierConnector config with a shared tier.  Settings are
    ``kv_connector_extra_config`` over the ``KVTIER_*`` environment variables of the line or
    manifest (kvtier reads both; src/kvtier/core/config.py), so a URL or secret set in ``env`` counts."""
    transfer = c.kv_transfer_config
    if not transfer or not c.uses("KVTierConnector"):
        return None
    extra = transfer.get("kv_connector_extra_config")
    settings: dict[str, Any] = {name[len("KVTIER_"):].lower(): value for name, value in c.env.items()
                                if name.upper().startswith("KVTIER_")}
    if isinstance(extra, dict):
        settings.update(extra)
    if not isinstance(settings.get("redis_url"), str):
        return None
    return settings["redis_url"], settings


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback  # all of 127.0.0.0/8, and ::1
    except ValueError:
        return False


@rule("kvtier-shared-tier-unprotected", "warning",
      "kvtier shared tier beyond this host without TLS or without a shared secret",
      "Use rediss:// (TLS) and set shared_secret_file to a secret of 16+ characters that every engine of the "
      "cache shares (values then carry a keyed BLAKE3 MAC that a writer without it cannot forge).",
      _DOCS, locate="KVTierConnector")
def kvtier_shared_tier_unprotected(c: ServeConfig) -> str | None:
    found = _redis(c)
    if found is None:
        return None
    url, extra = found
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return None  # kvtier-config-invalid reports a malformed URL
    if _is_loopback(host):
        return None
    missing = []
    if parts.scheme != "rediss":
        missing.append("TLS (redis:// sends KV and the password in clear)")
    if not (extra.get("shared_secret") or extra.get("shared_secret_file")):
        missing.append("a shared_secret (any client that can write to the server can plant KV the engines accept)")
    if not missing:
        return None
    return f"redis_url points at {host}, beyond this host, without " + " and without ".join(missing) + "."


@rule("kvtier-redis-password-in-url", "warning", "Redis password or shared secret written into the serve line",
      "Move the password out of redis_url into redis_password_env or redis_password_file (e.g. a mounted "
      "Kubernetes Secret), and a shared_secret into shared_secret_file; kvtier never logs them, but ps, shell "
      "history and manifests show the serve line.",
      _DOCS, locate="KVTierConnector")
def kvtier_redis_password_in_url(c: ServeConfig) -> str | None:
    found = _redis(c)
    if found is None:
        return None
    url, settings = found
    try:
        parts = urlsplit(url)
        password = parts.password or parse_qs(parts.query).get("password", [""])[0]
    except ValueError:
        return None
    leaks = []
    if password:
        leaks.append("redis_url carries a password")
    if isinstance(settings.get("shared_secret"), str) and settings["shared_secret"]:
        leaks.append("shared_secret is written out")
    if not leaks:
        return None
    return (" and ".join(leaks) + " in the serve line (not shown here); anyone who can read the line can use "
            + ("them." if len(leaks) > 1 else "it."))
