"""What a failed request to a Redis/Valkey server means, for the reachability probe
(:func:`kvtier.core.purge.probe_tier` over :class:`~kvtier.core.tiers.redis.blobs.RedisBlobs`: connect
and ``PING`` within a short deadline, never a write), run by ``kvtier check`` and the serve-line
pre-flight, which warn (the tier may come up after the engine; until then every shared-tier lookup
is a miss under the breaker).

The answer is one of three states, each with one sentence for the operator:

* ``reachable``: the server answered ``PING`` (``+PONG``) within the deadline;
* ``auth failed``: it answered, but refused the password (``WRONGPASS``, ``NOAUTH``: Redis
  ``AUTH`` command reference, https://redis.io/docs/latest/commands/auth/);
* ``unreachable``: no answer (the host does not resolve, the port is closed, a TLS handshake or
  the deadline failed).
"""

from __future__ import annotations

import socket
import ssl
from typing import TYPE_CHECKING

from kvtier.core.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.core.tiers.probe import ProbeState
    from kvtier.core.tiers.redis.settings import RedisSettings

AUTH_FIX = "fix redis_password_env, redis_password_file or the password in redis_url (or the server's requirepass/ACL)"
"""What the probe tells the operator to change when the server refuses the credentials."""


def classify(exc: BaseException, config: RedisSettings, left_s: float = 0.0) -> tuple[ProbeState, str]:
    """What a failed ``PING`` (or the client's connect before it) means: ``("auth failed" |
    "unreachable", a few words)``; ``left_s``: seconds left to tell a timeout of the connect from one
    of the answer (a TCP connect of its own: redis-py's timeout says neither)."""
    import redis

    if isinstance(exc, ClusterNode):
        return "wrong mode", CLUSTER_NODE_DETAIL
    if isinstance(exc, redis.AuthenticationError):
        return "auth failed", _auth_detail(config, exc)
    if isinstance(exc, redis.ResponseError):  # NOPERM, or an AUTH error redis-py does not map to AuthenticationError
        text = _first_line(exc)
        if text.upper().startswith(("NOAUTH", "WRONGPASS", "NOPERM")) or "authenticated" in text.lower():
            return "auth failed", _auth_detail(config, exc)
        return "unreachable", f"the server refused PING: {text}"
    if isinstance(exc, ConfigError):  # the Cluster seed node did not answer
        return "unreachable", str(exc).split(" (", 1)[-1].split("); ")[0]
    reason = _reason(exc)
    tls = (config.redis_url or "").startswith("rediss://")
    if reason == "connect timed out" and left_s > 0 and _accepts(config, min(left_s, config.redis_connect_timeout_s)):
        what = "the TLS handshake or PING" if tls else "PING"
        reason = (f"it accepted the connection but did not answer {what} within {config.redis_timeout_s:g} s: "
                  "something listens on that port that is not a Redis server, or the server is stalled")
    if tls and reason.startswith(("connect timed out", "it accepted")):
        reason += " (a rediss:// URL to a port that speaks plain text looks the same)"
    return "unreachable", reason


def _accepts(config: RedisSettings, timeout_s: float) -> bool:
    """Whether a TCP (or UNIX socket) connect to ``redis_url``'s address succeeds within ``timeout_s``."""
    from urllib.parse import urlsplit

    parts = urlsplit(config.redis_url or "")
    try:
        if parts.scheme == "unix":
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
                unix.settimeout(timeout_s)
                unix.connect(parts.path)
        else:
            socket.create_connection((parts.hostname or "localhost", parts.port or 6379), timeout=timeout_s).close()
    except (OSError, ValueError):
        return False
    return True


def _auth_detail(config: RedisSettings, exc: BaseException) -> str:
    """Why authentication failed: a password refused (``WRONGPASS``, "invalid password"), or none
    configured for a server that wants one (``NOAUTH``); a password counts as configured from
    ``redis_password_env``, ``redis_password_file`` or the URL itself (``redis://:PASSWORD@host``)."""
    from urllib.parse import urlsplit

    text = _first_line(exc)
    in_url = bool(urlsplit(config.redis_url or "").password)
    configured = in_url or bool(config.redis_password_env or config.redis_password_file)
    refused = text.upper().startswith("WRONGPASS") or "invalid password" in text.lower() \
        or "invalid username-password" in text.lower()
    if not configured and not refused:
        return "the server requires a password and none is configured"
    if in_url and not (config.redis_password_env or config.redis_password_file):
        return f"the server refused the password in redis_url: {text}"
    return f"the server refused the password: {text}"


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


class ClusterNode(Exception):
    """The probe's ``PING`` was answered by a Redis Cluster node while ``redis_cluster`` is not set."""


CLUSTER_NODE_DETAIL = ("it is a Redis Cluster node and redis_cluster is not set, so the keys of every other node's "
                       "slots are refused; set redis_cluster: true")
"""What the probe says of such a node (state ``wrong mode``, :func:`classify`)."""
CLUSTER_NODE = f"MOVED: {CLUSTER_NODE_DETAIL}"
"""The one cause of every ``MOVED``/``ASK`` reply, whatever its slot (:func:`describe_error`)."""


def describe_error(exc: BaseException) -> str:
    """A fault's short cause for the tier's log line (:class:`~kvtier.core.tiers.guarded.GuardedTier`
    logs each cause at most once per 10 s): a ``MOVED``/``ASK`` reply, which only a Cluster node
    named without ``redis_cluster`` sends, is :data:`CLUSTER_NODE` whatever its slot and node (one
    cause, instead of a line per slot); anything else as :func:`~kvtier.core.tiers.guarded.describe_error`."""
    import redis

    from kvtier.core.tiers.guarded import describe_error as plain

    text = _first_line(exc)
    if isinstance(exc, redis.exceptions.AskError) or text.startswith(("MOVED ", "ASK ")):
        return CLUSTER_NODE
    return plain(exc)
