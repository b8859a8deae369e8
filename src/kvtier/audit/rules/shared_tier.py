"""kvtier's shared (redis) tier on the serve line: protection beyond this host, secrets in the line."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule

LOOPBACK = ("127.0.0.1", "localhost", "::1")
_DOCS = "kvtier docs/shared-tier.md"


def _redis(c: ServeConfig) -> tuple[str, dict[str, Any]] | None:
    """(redis_url, kv_connector_extra_config) of a KVTierConnector config with a shared tier."""
    transfer = c.kv_transfer_config
    if not transfer or not c.uses("KVTierConnector"):
        return None
    extra = transfer.get("kv_connector_extra_config")
    if not isinstance(extra, dict) or not isinstance(extra.get("redis_url"), str):
        return None
    return extra["redis_url"], extra


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
    if host in LOOPBACK:
        return None
    missing = []
    if parts.scheme != "rediss":
        missing.append("TLS (redis:// sends KV and the password in clear)")
    if not (extra.get("shared_secret") or extra.get("shared_secret_file")):
        missing.append("a shared_secret (any client that can write to the server can plant KV the engines accept)")
    if not missing:
        return None
    return f"redis_url points at {host}, beyond this host, without " + " and without ".join(missing) + "."


@rule("kvtier-redis-password-in-url", "warning", "Redis password written into the serve line",
      "Move the password out of redis_url into redis_password_env or redis_password_file (e.g. a mounted "
      "Kubernetes Secret); kvtier never logs it, but ps, shell history and manifests show the serve line.",
      _DOCS, locate="KVTierConnector")
def kvtier_redis_password_in_url(c: ServeConfig) -> str | None:
    found = _redis(c)
    if found is None:
        return None
    try:
        password = urlsplit(found[0]).password
    except ValueError:
        return None
    if not password:
        return None
    return "redis_url carries a password in the serve line (not shown here); anyone who can read the line can use it."
