"""kvtier's shared tiers on the serve line (redis, the object store): protection beyond this host, secrets in
the line."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule
from kvtier.core.config import KVTierConfig
from kvtier.core.hosts import is_loopback_host
from kvtier.integrations.vllm.preflight import advice_problems, looks_like_credential

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
    if is_loopback_host(host):
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


def _extra(c: ServeConfig) -> dict[str, Any] | None:
    """The ``kv_connector_extra_config`` of a KVTierConnector serve line, or None."""
    transfer = c.kv_transfer_config
    if not transfer or not c.uses("KVTierConnector"):
        return None
    extra = transfer.get("kv_connector_extra_config")
    return extra if isinstance(extra, dict) else {}


@rule("kvtier-tier-exposed", "warning",
      "kvtier tier configured so that its traffic or its values are exposed beyond this host",
      "Follow the message: for an object-store endpoint beyond this host use https:// and set shared_secret_file "
      "to a secret of 16+ characters that every engine of the cache shares (values then carry a keyed BLAKE3 MAC "
      "that a writer without it cannot forge).",
      "kvtier docs/s3.md § Servers", locate="KVTierConnector")
def kvtier_tier_exposed(c: ServeConfig) -> str | None:
    """Each configured tier's advice (the registry's ``advice`` hooks, run by the pre-flight)."""
    transfer = c.kv_transfer_config
    if not transfer or not c.uses("KVTierConnector"):
        return None
    warnings = [p.message for p in advice_problems(transfer, environ=c.env)]
    return "; ".join(warnings) + "." if warnings else None


_AWS_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _credential_keys(value: Any, path: str = "") -> list[str]:
    """Dotted paths of credential-like keys (not known kvtier keys) anywhere in ``value``."""
    if not isinstance(value, dict):
        return []
    known = set(KVTierConfig.known_keys())
    out = []
    for key, inner in value.items():
        where = f"{path}.{key}" if path else str(key)
        if str(key) not in known and looks_like_credential(str(key)) and inner not in (None, ""):
            out.append(where)
        out.extend(_credential_keys(inner, where))
    return out


@rule("kvtier-credentials-in-serve-line", "error", "object-store credentials written into the serve line",
      "Take the keys out of the line: give AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY to the server's environment "
      "from a secret store (a Kubernetes Secret through valueFrom.secretKeyRef) or mount an AWS credentials file "
      "and name it in s3_credentials_file; never in kv_connector_extra_config or s3_endpoint_url. Then rotate "
      "the keys: ps, shell history and manifests have shown them.",
      "kvtier docs/s3.md § Turning it on", locate="KVTierConnector")
def kvtier_credentials_in_serve_line(c: ServeConfig) -> str | None:
    extra = _extra(c)
    if extra is None:
        return None
    leaks = [f"kv_connector_extra_config.{where}" for where in _credential_keys(extra)]
    nested = extra.get("tier_settings")
    urls = [("s3_endpoint_url", extra.get("s3_endpoint_url"))]
    urls += [(f"tier_settings.{tier}.s3_endpoint_url", values.get("s3_endpoint_url"))
             for tier, values in (nested.items() if isinstance(nested, dict) else ()) if isinstance(values, dict)]
    urls.append(("KVTIER_S3_ENDPOINT_URL", c.env.get("KVTIER_S3_ENDPOINT_URL")))
    for where, url in urls:
        try:
            parts = urlsplit(url) if isinstance(url, str) else None
        except ValueError:
            continue
        if parts is not None and (parts.username or parts.password):
            leaks.append(f"{where} carries a user or key")
    # a literal secret in the line's or manifest's env (a $VAR or a valueFrom is not one)
    leaks += [name for name in _AWS_SECRETS if c.env.get(name) and not c.env[name].startswith("$")]
    if not leaks:
        return None
    return ("Credentials are written out in " + ", ".join(leaks) + " (values not shown here); anyone who can "
            "read the line or the manifest can use them.")


@rule("kvtier-shared-tier-tenants-unprotected", "warning",
      "kvtier shared tier that tenants share, without a MAC key or encryption",
      "Set shared_secret_file (values then carry a keyed BLAKE3 MAC: no tenant or client can plant KV the engines "
      "accept) and encrypt the tier at rest: codecs {redis: [aes-256-gcm]} (or s3) with encryption "
      "{master_key_file: ...} (each tenant's values sealed under its own data key).",
      "kvtier docs/security.md", locate="KVTierConnector")
def kvtier_shared_tier_tenants_unprotected(c: ServeConfig) -> str | None:
    """Tenants share the tiers when the configuration gives them quotas (``tenant_quotas``)."""
    extra = _extra(c)
    if extra is None:
        return None
    settings = {name[len("KVTIER_"):].lower(): value for name, value in c.env.items()
                if name.upper().startswith("KVTIER_")} | extra
    if not settings.get("tenant_quotas") or settings.get("shared_secret") or settings.get("shared_secret_file"):
        return None
    given = settings.get("codecs")
    chains: dict[str, Any] = given if isinstance(given, dict) else {}
    from kvtier.core.tiers.registry import specs

    bare = [s.name for s in specs() if s.shared and any(settings.get(k) for k in s.keys)
            and "aes-256-gcm" not in (chains.get(s.name) or ())]
    if not bare:
        return None
    return (f"tenant_quotas says tenants share this cache, and the {' and '.join(bare)} tier stores their KV with "
            "neither a shared_secret (MAC) nor aes-256-gcm: whoever can reach the server reads every tenant's KV "
            "and can plant KV the engines accept.")
