"""Probe of a configured shared tier (Redis/Valkey): connect and ``PING`` within a short deadline,
never a write: the redis tier's ``probe`` hook (:mod:`kvtier.core.tiers.probe`), run by ``kvtier check``
and the serve-line pre-flight, which warn (the tier may come up after the engine; until then every
shared-tier lookup is a miss under the breaker).

The answer is one of three states, each with one sentence for the operator:

* ``reachable``: the server answered ``PING`` (``+PONG``) within the deadline;
* ``auth failed``: it answered, but refused the password (``WRONGPASS``, ``NOAUTH``: Redis
  ``AUTH`` command reference, https://redis.io/docs/latest/commands/auth/);
* ``unreachable``: no answer (the host does not resolve, the port is closed, a TLS handshake or
  the deadline failed).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from typing import TYPE_CHECKING

from kvtier.core.config import redact_url
from kvtier.core.errors import ConfigError
from kvtier.core.tiers.probe import PROBE_DEADLINE_S, ProbeResult, ProbeState, within_deadline

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.redissettings import RedisSettings

TIER = "redis"
"""The registry name of the tier this probe checks (kvtier.core.tiers.registry)."""

_AUTH_FIX = "fix redis_password_env or redis_password_file (or the server's requirepass/ACL)"


def _result(state: ProbeState, url: str, detail: str, elapsed_s: float) -> ProbeResult:
    return ProbeResult(state, url, detail, elapsed_s, auth_fix=_AUTH_FIX, address_key="redis_url")


def probe_redis(config: KVTierConfig, deadline_s: float = PROBE_DEADLINE_S) -> ProbeResult:
    """Connect to ``config.redis_url`` and send ``PING``, within ``deadline_s`` seconds.

    Uses the tier's own client (:func:`kvtier.core.tiers.redisclient.make_client`: password, TLS CA,
    Cluster seed), its connect and call timeouts capped at ``deadline_s``.  Sends nothing but
    ``AUTH`` (when a password is configured, as the tier does) and ``PING``.

    Raises:
        ConfigError: ``config`` has no ``redis_url``, redis-py is not installed, or the password
            or the TLS CA file cannot be read (the pre-flight reports those itself, as errors).
    """
    from kvtier.core.tiers.redisclient import make_client, redis_password, tls_ca_file
    from kvtier.core.tiers.redissettings import redis_settings

    settings = redis_settings(config)
    if not settings.redis_url:
        raise ConfigError("probe_redis needs a config with redis_url set")
    try:
        import redis  # noqa: F401 - make_client needs it; without it the tier itself cannot start
    except ImportError:
        raise ConfigError("the redis tier needs redis-py; install it (pip install redis) or unset redis_url") from None
    redis_password(settings)  # an unreadable password file is the config's error, raised here, not a probe state
    tls_ca_file(settings)  # so is an unreadable TLS CA file (it read as "unreachable")
    url = redact_url(settings.redis_url)
    capped = settings.model_copy(update={
        "redis_connect_timeout_s": min(settings.redis_connect_timeout_s, deadline_s),
        "redis_timeout_s": min(settings.redis_timeout_s, deadline_s)})
    return within_deadline(lambda start: _ping(capped, url, start, make_client), deadline_s, "kvtier-redis-probe",
                           lambda detail, elapsed_s: _result("unreachable", url, detail, elapsed_s))


def _ping(config: RedisSettings, url: str, start: float, make_client: object) -> ProbeResult:
    import redis

    client = None
    try:
        client = make_client(config)  # type: ignore[operator]
        client.ping()
        elapsed = time.monotonic() - start
        return _result("reachable", url, f"PING answered in {elapsed * 1000:.1f} ms", elapsed)
    except redis.AuthenticationError as exc:
        return _result("auth failed", url, _auth_detail(config, exc), time.monotonic() - start)
    except redis.ResponseError as exc:  # NOPERM, or an AUTH error redis-py does not map to AuthenticationError
        text = _first_line(exc)
        if text.upper().startswith(("NOAUTH", "WRONGPASS", "NOPERM")) or "authenticated" in text.lower():
            return _result("auth failed", url, _auth_detail(config, exc), time.monotonic() - start)
        return _result("unreachable", url, f"the server refused PING: {text}", time.monotonic() - start)
    except ConfigError as exc:  # the Cluster seed node did not answer
        return _result("unreachable", url, str(exc).split(" (", 1)[-1].split("); ")[0],
                           time.monotonic() - start)
    except (redis.RedisError, OSError) as exc:
        reason = _reason(exc)
        if reason == "connect timed out" and url.startswith("rediss://"):
            reason += " (a rediss:// URL to a port that speaks plain text looks the same)"
        return _result("unreachable", url, reason, time.monotonic() - start)
    finally:
        if client is not None:
            with contextlib.suppress(Exception):  # closing a half-open client must not hide the probe's answer
                client.close()


def _auth_detail(config: RedisSettings, exc: BaseException) -> str:
    """Why authentication failed: no password configured for a server that wants one, or a refused one."""
    if not (config.redis_password_env or config.redis_password_file):
        return "the server requires a password and none is configured"
    return f"the server refused the password: {_first_line(exc)}"


def _reason(exc: BaseException) -> str:
    """A few words for why a connection failed: the OS error under redis-py's ConnectionError."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, socket.gaierror):
            return "the host name does not resolve"
        if isinstance(seen, ssl.SSLCertVerificationError):
            return _verify_failed(seen.verify_message or str(seen.reason or seen))
        if isinstance(seen, ssl.SSLError):
            return f"TLS handshake failed: {seen.reason or seen}"
        if isinstance(seen, ConnectionRefusedError):
            return "connection refused: nothing listens on that port"
        if isinstance(seen, (TimeoutError, socket.timeout)):
            return "connect timed out"
        seen = seen.__cause__ or seen.__context__
    text = _first_line(exc)
    lowered = text.lower()
    if "name or service not known" in lowered or "nodename nor servname" in lowered or "temporary failure in name" \
            in lowered:
        return "the host name does not resolve"
    if "connection refused" in lowered:
        return "connection refused: nothing listens on that port"
    if "timeout" in lowered or "timed out" in lowered:
        return "connect timed out"
    if "protocol error" in lowered:
        return f"something answered on that port, but not Redis ({text})"
    if "certificate verify failed" in lowered or "certificate_verify_failed" in lowered:
        return _verify_failed(text)
    if "ssl" in lowered or "certificate" in lowered:
        return f"TLS handshake failed: {text}"
    return text


def _verify_failed(detail: str) -> str:
    """A certificate the client refused: the two usual causes, named."""
    if "mismatch" in detail.lower():
        return (f"TLS handshake failed: {detail}: the server's certificate must name the host of redis_url "
                "(in its subjectAltName), or use a host name the certificate names in redis_url")
    return (f"TLS handshake failed: certificate verify failed ({detail}): check that the certificate is signed by "
            "the CA in redis_tls_ca_file and names the host of redis_url (a host name mismatch reads the same)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else exc.__class__.__name__
