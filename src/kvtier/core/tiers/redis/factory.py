"""The redis tier from a configuration: whether it is asked for, its preflight check and its
factory (the hooks of its plug-in object, :data:`kvtier.core.tiers.builtin.REDIS`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.core.codecsettings import envelope_args, load_keyring
from kvtier.core.config import redact_url
from kvtier.core.errors import ConfigError
from kvtier.core.tiers.breaker import CircuitBreaker
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.redis.clear import CLEAR_DEADLINE_S
from kvtier.core.tiers.redis.client import LazyClusterClient, make_client
from kvtier.core.tiers.redis.settings import redis_settings
from kvtier.core.tiers.redis.tier import RedisTier
from kvtier.core.tiers.sharedvalue import shared_secret

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.factory import TierContext


def check(config: KVTierConfig) -> list[tuple[str, str]]:
    """The password, shared secret and TLS CA file, read as start-up reads them (files, the
    environment variable): ``(config key, message)`` per one that start-up would refuse."""
    from kvtier.core.tiers.redis.client import redis_password, tls_ca_file

    problems = []
    settings = redis_settings(config)
    password_key = "redis_password_env" if settings.redis_password_env else "redis_password_file"
    for name, read in ((password_key, lambda: redis_password(settings)), ("shared_secret_file",
                                                                          lambda: shared_secret(config)),
                       ("redis_tls_ca_file", lambda: tls_ca_file(settings)),
                       ("encryption", lambda: load_keyring(config.encryption))):
        try:
            read()
        except ConfigError as exc:
            problems.append((name, str(exc)))
    return problems


def configured(config: KVTierConfig) -> bool:
    """Whether ``config`` asks for the redis tier (``redis_url`` set)."""
    return bool(redis_settings(config).redis_url)


def from_config(ctx: TierContext) -> GuardedTier | None:
    """The redis tier behind :class:`~kvtier.core.tiers.guarded.GuardedTier`, or ``None`` without
    ``redis_url``.  The server need not be up: an
    unreachable one is a run of misses until it answers.

    Raises:
        ConfigError: redis-py missing, or an unreadable password or secret file
            (:func:`make_client`, :func:`shared_secret`).
    """
    config = ctx.config
    settings = redis_settings(config)
    if not settings.redis_url:
        return None
    client = LazyClusterClient(settings) if settings.redis_cluster else make_client(settings)
    where = redact_url(settings.redis_url)
    inner = RedisTier(client, ctx.namespace, shared_secret(config), settings.redis_key_prefix, settings.redis_ttl_s,
                      config.shared_transfer_deadline_s, where, envelope_args(config, "redis"))
    return GuardedTier(inner, config.shared_deadline_s, config.shared_transfer_deadline_s, config.io_threads,
                       config.shared_queue_depth,
                       CircuitBreaker(settings.redis_breaker_failures, settings.redis_breaker_probe_s),
                       registry=ctx.registry, where=where, clear_deadline_s=CLEAR_DEADLINE_S)
