"""The redis tier's client and secrets: a redis-py client built from its settings (timeouts set,
redis-py's retries off; the Cluster client made lazily), the Redis password from an environment
variable or a file (the shared secret: :func:`kvtier.core.tiers.sharedvalue.shared_secret`).  None of
them is ever logged.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.core.config import redact_url
from kvtier.core.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.core.tiers.redis.settings import RedisSettings


def redis_password(config: RedisSettings) -> str | None:
    """The Redis password from ``redis_password_env`` or ``redis_password_file`` (``None`` if neither).

    Raises:
        ConfigError: the named environment variable is unset, or the file cannot be read.
    """
    if config.redis_password_env:
        value = os.environ.get(config.redis_password_env)
        if value is None:
            raise ConfigError(f"redis_password_env names {config.redis_password_env!r} but that environment "
                              "variable is not set; set it or remove redis_password_env")
        return value
    if config.redis_password_file:
        try:
            return Path(config.redis_password_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"cannot read redis_password_file {config.redis_password_file!r}: "
                              f"{exc.strerror}; fix the path or its permissions") from None
    return None


def tls_ca_file(config: RedisSettings) -> str | None:
    """``redis_tls_ca_file`` when it is used (a ``rediss://`` URL), checked: an existing, readable
    file (redis-py would only fail at its first connection, which read as a network error).

    Raises:
        ConfigError: the file is missing, not a file, or unreadable.
    """
    path = config.redis_tls_ca_file
    if not path or not (config.redis_url or "").startswith("rediss://"):
        return None
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise ConfigError(f"cannot read redis_tls_ca_file {path!r} ({exc.strerror}); point it at the PEM file of "
                          "the CA that signed the Redis server's certificate") from None
    return path


def make_client(config: RedisSettings) -> Any:
    """A redis-py client for ``config.redis_url`` (Cluster client if ``redis_cluster``), timeouts set,
    redis-py's retries off.  Connects lazily (standalone) or to the seed node (Cluster).

    Raises:
        ConfigError: redis-py is not installed, ``redis_tls_ca_file`` cannot be read
            (:func:`tls_ca_file`), or the Cluster seed node cannot be reached.
    """
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise ConfigError("the redis tier needs redis-py; install it (pip install redis) or unset redis_url") from None
    assert config.redis_url is not None
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": config.redis_connect_timeout_s,
        "socket_timeout": config.redis_timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    password = redis_password(config)
    if password is not None:
        kwargs["password"] = password
    ca_file = tls_ca_file(config)
    if ca_file is not None:
        kwargs["ssl_ca_certs"] = ca_file
    if not config.redis_cluster:
        kwargs["health_check_interval"] = 0
        return redis.Redis.from_url(config.redis_url, **kwargs)
    from redis.cluster import RedisCluster

    try:
        return RedisCluster.from_url(config.redis_url, require_full_coverage=False, **kwargs)
    except (redis.RedisError, OSError) as exc:
        raise ConfigError(f"cannot reach the Redis Cluster seed node {redact_url(config.redis_url)} ({exc}); "
                          "start the cluster or fix redis_url") from None


class LazyClusterClient:
    """A Cluster client made on first use, on the tier's threads: a Cluster that is down when the
    engine starts is then a run of misses (under the deadline and the breaker), not a failed start."""

    def __init__(self, config: RedisSettings) -> None:
        self._config = config
        self._client: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        """The client, connecting to the seed node now if needed.  Raises ConfigError if unreachable."""
        with self._lock:
            if self._client is None:
                self._client = make_client(self._config)
            return self._client

    def pipeline(self, transaction: bool = False) -> Any:
        return self.get().pipeline(transaction=transaction)

    def delete(self, *names: bytes) -> Any:
        return self.get().delete(*names)

    def unlink(self, *names: bytes) -> Any:
        return self.get().unlink(*names)

    def scan_iter(self, match: bytes, count: int) -> Any:
        return self.get().scan_iter(match=match, count=count)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
