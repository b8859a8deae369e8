"""The s3 tier from a configuration: whether it is asked for, its preflight check and advice, and
its factory (the hooks of its plug-in object, :data:`kvtier.core.tiers.builtin.S3`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.core.codecsettings import envelope_args, load_keyring
from kvtier.core.errors import ConfigError
from kvtier.core.hosts import is_loopback_host
from kvtier.core.tiers.breaker import CircuitBreaker
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.s3.client import http_refusal, make_store, read_credentials, where
from kvtier.core.tiers.s3.settings import S3Settings, s3_settings
from kvtier.core.tiers.s3.tier import S3Tier
from kvtier.core.tiers.sharedvalue import shared_secret

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.factory import TierContext

GiB = 1 << 30


def check(config: KVTierConfig) -> list[tuple[str, str]]:
    """What start-up would refuse, read as it reads it: no bucket, plain HTTP without
    ``s3_allow_http``, unreadable credentials (the file, or half of the environment pair), the
    shared secret file; ``(config key, message)`` each."""
    settings = s3_settings(config)
    problems: list[tuple[str, str]] = []
    if not settings.s3_bucket:
        message = "the s3 tier has s3_endpoint_url but no s3_bucket; name the bucket (created beforehand)"
        problems.append(("s3_bucket", message))
    if (refusal := http_refusal(settings)) is not None:
        problems.append(("s3_allow_http", refusal))
    for name, read in (("s3_credentials_file", lambda: read_credentials(settings)),
                       ("shared_secret_file", lambda: shared_secret(config)),
                       ("encryption", lambda: load_keyring(config.encryption))):
        try:
            read()
        except ConfigError as exc:
            problems.append((name, str(exc)))
    return problems


def advice(config: KVTierConfig) -> list[tuple[str, str]]:
    """Warnings about a configuration the tier starts with (registry ``advice``): a plain
    ``http://`` endpoint beyond this host without ``shared_secret``/``shared_secret_file`` sends
    the chunks in clear and lets any client that can write to the bucket plant KV the engines
    accept (the checksum catches corruption, not forgery; docs/s3.md "Servers").  Reads the
    configuration alone: ``(config key, message)`` each."""
    from urllib.parse import urlsplit

    from kvtier.core.config import redact_url

    url = s3_settings(config).s3_endpoint_url
    if not url or not url.startswith("http://") or config.shared_secret or config.shared_secret_file:
        return []
    host = urlsplit(url).hostname or ""
    if is_loopback_host(host):
        return []
    return [("s3_endpoint_url", (f"s3_endpoint_url {redact_url(url)} is plain HTTP to {host}, beyond this host, "
             "without a shared_secret: chunks cross the network in clear and any client that can write to the "
             "bucket can plant KV the engines accept; use https:// and set shared_secret_file to a secret of "
             "16+ characters that every engine of the cache shares"))]


def configured(config: KVTierConfig) -> bool:
    """Whether ``config`` asks for the s3 tier (``s3_bucket`` or ``s3_endpoint_url`` set)."""
    settings = s3_settings(config)
    return bool(settings.s3_bucket or settings.s3_endpoint_url)


def _tier(config: KVTierConfig, settings: S3Settings, namespace: bytes, sweep: bool = True, tp_size: int = 1) -> S3Tier:
    """The bare tier of one tensor-parallel rank's namespace (its cap ``s3_capacity_gib`` / ``tp_size``: the
    key is the engine's total, as ``disk_gib`` is); ``sweep=False``: no expiry, no cap, no sweep thread (a
    reset's short-lived tier)."""
    store = make_store(settings, config.shared_transfer_deadline_s)
    capacity = (None if settings.s3_capacity_gib is None or not sweep
                else int(settings.s3_capacity_gib * GiB / max(tp_size, 1)))
    return S3Tier(store, namespace, shared_secret(config), settings.s3_key_prefix, settings.s3_concurrency,
                  capacity, settings.s3_ttl_s if sweep else None, settings.s3_sweep_interval_s,
                  settings.s3_conditional_put, where(settings), config.shared_transfer_deadline_s,
                  envelope_args(config, "s3"))


def from_config(ctx: TierContext) -> GuardedTier | None:
    """The s3 tier behind :class:`~kvtier.core.tiers.guarded.GuardedTier`, or ``None`` without
    ``s3_bucket``/``s3_endpoint_url``.  The server need not be up: an unreachable one is a run of
    misses until it answers.

    Raises:
        ConfigError: obstore missing, no bucket, plain HTTP without ``s3_allow_http``, or
            unreadable credentials or secret file.
    """
    config = ctx.config
    settings = s3_settings(config)
    if not configured(config):
        return None
    inner = _tier(config, settings, ctx.namespace, tp_size=ctx.tp_size)
    return GuardedTier(inner, config.shared_deadline_s, config.shared_transfer_deadline_s, config.io_threads,
                       config.shared_queue_depth,
                       CircuitBreaker(settings.s3_breaker_failures, settings.s3_breaker_probe_s),
                       registry=ctx.registry, where=inner.where)
