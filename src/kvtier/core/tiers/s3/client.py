"""The s3 tier's client: an obstore ``S3Store`` built from :class:`~kvtier.core.tiers.s3.settings.S3Settings`,
and the credentials it signs with.

Credentials (never a configuration key, never logged: :class:`Credentials` hides them from
``repr``), first found wins:

1. the file named by ``s3_credentials_file``, AWS shared-credentials format (the
   ``s3_profile`` section's ``aws_access_key_id``, ``aws_secret_access_key`` and optional
   ``aws_session_token``; the format of ``~/.aws/credentials``, and of a Kubernetes Secret
   mounted as that file);
2. ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN`` in the environment;
3. nothing given: obstore follows the AWS default chain (web identity, container and instance
   credentials).

The client retries a request ``s3_max_retries`` times on a dropped connection or a 5xx reply,
within ``retry_timeout`` (the transfer deadline: the tier's caller never waits longer anyway);
every request has ``s3_timeout_s`` and every connect ``s3_connect_timeout_s``.
"""

from __future__ import annotations

import configparser
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from kvtier.core.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.core.tiers.s3.settings import S3Settings


@dataclass(frozen=True)
class Credentials:
    """An access key pair (and session token); ``repr`` shows none of it."""

    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)
    source: str = ""


def read_credentials(settings: S3Settings, environ: dict[str, str] | None = None) -> Credentials | None:
    """The credentials the s3 tier signs with (see the module docstring); ``None`` = the AWS chain.

    Raises:
        ConfigError: ``s3_credentials_file`` unreadable, not in the AWS format, without the
            ``s3_profile`` section or without both keys; or only one of the two environment
            variables set.
    """
    env = os.environ if environ is None else environ
    if settings.s3_credentials_file:
        path = settings.s3_credentials_file
        parser = configparser.ConfigParser(interpolation=None)
        try:
            with open(path, encoding="utf-8") as f:
                parser.read_file(f)
        except OSError as exc:
            raise ConfigError(f"s3_credentials_file {path!r} cannot be read ({exc.strerror}); "
                              "fix the path or its permissions") from None
        except (configparser.Error, UnicodeDecodeError):
            raise ConfigError(f"s3_credentials_file {path!r} is not in the AWS credentials format; write "
                              f"[{settings.s3_profile}] then aws_access_key_id = ... and "
                              "aws_secret_access_key = ... lines") from None
        if not parser.has_section(settings.s3_profile):
            raise ConfigError(f"s3_credentials_file {path!r} has no [{settings.s3_profile}] section; add it or "
                              "set s3_profile to the section that holds the keys")
        section = parser[settings.s3_profile]
        key_id, secret = section.get("aws_access_key_id", "").strip(), section.get("aws_secret_access_key", "").strip()
        if not key_id or not secret:
            raise ConfigError(f"s3_credentials_file {path!r} section [{settings.s3_profile}] needs both "
                              "aws_access_key_id and aws_secret_access_key")
        token = section.get("aws_session_token", "").strip() or None
        return Credentials(key_id, secret, token, f"s3_credentials_file [{settings.s3_profile}]")
    key_id, secret = env.get("AWS_ACCESS_KEY_ID", ""), env.get("AWS_SECRET_ACCESS_KEY", "")
    if bool(key_id) != bool(secret):
        missing = "AWS_SECRET_ACCESS_KEY" if key_id else "AWS_ACCESS_KEY_ID"
        raise ConfigError(f"the environment sets only one of AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; set "
                          f"{missing} too, or neither (the AWS default chain) or s3_credentials_file")
    if key_id:
        return Credentials(key_id, secret, env.get("AWS_SESSION_TOKEN") or None, "environment")
    return None


def http_refusal(settings: S3Settings) -> str | None:
    """Why start-up refuses the endpoint (plain HTTP without ``s3_allow_http``), or ``None``."""
    url = settings.s3_endpoint_url
    if url and url.startswith("http://") and not settings.s3_allow_http:
        return (f"s3_endpoint_url {url} is plain HTTP (no TLS); use https:// or set s3_allow_http: true "
                "for a server on a trusted network")
    return None


def where(settings: S3Settings) -> str:
    """``endpoint/bucket/prefix`` for log lines (no credential is part of it)."""
    endpoint = settings.s3_endpoint_url or f"s3.{settings.s3_region}.amazonaws.com"
    return f"{endpoint.rstrip('/')}/{settings.s3_bucket}/{settings.s3_key_prefix}"


def make_store(settings: S3Settings, retry_timeout_s: float) -> Any:
    """An obstore ``S3Store`` on the configured bucket.

    Raises:
        ConfigError: obstore is not installed, the bucket is unset, plain HTTP without
            ``s3_allow_http``, or unreadable credentials (:func:`read_credentials`).
    """
    try:
        from obstore.store import S3Store
    except ImportError:
        raise ConfigError("the s3 tier needs the Python package 'obstore'; install it (pip install "
                          "'kvtier[s3]') or remove s3_bucket from the config") from None
    if not settings.s3_bucket:
        raise ConfigError("the s3 tier has s3_endpoint_url but no s3_bucket; name the bucket (created beforehand)")
    if (refusal := http_refusal(settings)) is not None:
        raise ConfigError(refusal)
    credentials = read_credentials(settings)
    config: dict[str, Any] = {"region": settings.s3_region,
                              "virtual_hosted_style_request": settings.s3_virtual_hosted_style}
    if settings.s3_endpoint_url:
        config["endpoint"] = settings.s3_endpoint_url
    if credentials is not None:
        config["access_key_id"] = credentials.access_key_id
        config["secret_access_key"] = credentials.secret_access_key
        if credentials.session_token:
            config["session_token"] = credentials.session_token
    client_options = {"allow_http": settings.s3_allow_http,
                      "connect_timeout": timedelta(seconds=settings.s3_connect_timeout_s),
                      "timeout": timedelta(seconds=settings.s3_timeout_s)}
    retry = {"max_retries": settings.s3_max_retries, "retry_timeout": timedelta(seconds=retry_timeout_s),
             "backoff": {"init_backoff": timedelta(milliseconds=20), "max_backoff": timedelta(seconds=1), "base": 2}}
    return S3Store(settings.s3_bucket, config=config, client_options=client_options, retry_config=retry)  # type: ignore[arg-type]


AUTH_MARKS = ("403 Forbidden", "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId")
"""Texts of an S3 error that mean the server refused the credentials."""
UNREACHABLE_MARKS = ("error sending request", "kind: connect", "connection refused", "dns error",
                     "failed to lookup address", "timed out", "connection reset", "broken pipe")
"""Texts (lower case) of an obstore error that mean the request never got an answer from a server."""
METADATA_HOSTS = ("169.254.169.254", "169.254.170.2")
"""The AWS chain's instance and container credential endpoints: an error naming one means no
credentials were configured and none came from the host."""
_CAUSES = (("connection refused", "connection refused"), ("dns error", "host name not resolved"),
           ("failed to lookup address", "host name not resolved"), ("timed out", "timed out"),
           ("connection reset", "connection reset"))
_TIMING = re.compile(r" in [0-9.]+\s*(?:ns|µs|us|ms|s)\b")
_URL = re.compile(r"\b(https?://[^/\s,)]+)[^\s,)]*")
_STATUS = re.compile(r"status code: (\d{3})(?: ([A-Za-z][A-Za-z ]*[A-Za-z]))?")
_S3_CODE = re.compile(r"<Code>(\w+)</Code>")
_OS_MESSAGE = re.compile(r'message: "([^"]+)"')
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")


def not_implemented(exc: BaseException) -> bool:
    """Whether an obstore error is the server's ``501 Not Implemented`` (AWS error code
    ``NotImplemented``: "A header you provided implies functionality that is not implemented",
    Amazon S3 API reference, "Error responses"): what a gateway without conditional writes answers
    to ``If-None-Match: *``.  obstore gives only its text: ``... non-2xx status code: 501 ...``."""
    text = str(exc)
    return "status code: 501" in text or "<Code>NotImplemented</Code>" in text


def brief(text: str, limit: int = 160) -> str:
    """An obstore error's text in one short phrase: its first line without the ``Generic S3 error:``
    label and timings, cut at a word boundary (never mid-word) to at most ``limit`` characters,
    plus the root cause found deeper in its debug text (connection refused, name not resolved)."""
    lines = text.strip().splitlines()
    first = _TIMING.sub("", lines[0] if lines else "").removeprefix("Generic S3 error: ").strip()
    lowered = text.lower()
    cause = next((phrase for mark, phrase in _CAUSES if mark in lowered and phrase not in first.lower()), None)
    if len(first) > limit:
        first = first[:limit].rsplit(" ", 1)[0].rstrip(" ,;:-") + " ..."
    return f"{first} ({cause})" if cause else first or "no detail"


def s3_cause(exc: BaseException) -> str:
    """An obstore error reduced to its innermost meaningful cause, in one short line with no object
    path, timing or Rust debug dump (equal for every request that failed the same way, so a log
    line per cause can be rate-limited): ``"connection refused to http://127.0.0.1:9000"``,
    ``"HTTP 404 NoSuchBucket from http://minio:9000"``, ``"timed out to https://s3.example"``,
    else :func:`brief` of its first line.  Another exception: its class and first line."""
    text = str(exc)
    if not type(exc).__module__.startswith("obstore") and "Debug source:" not in text:
        lines = text.strip().splitlines()
        return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    origin = match.group(1) if (match := _URL.search(text)) else ""
    if (status := _STATUS.search(text)) is not None:
        code = _S3_CODE.search(text)
        what = code.group(1) if code else status.group(2) or ""
        return f"HTTP {status.group(1)} {what}".rstrip() + (f" from {origin}" if origin else "")
    to = f" to {origin}" if origin else ""
    if (message := _OS_MESSAGE.search(text)) is not None:
        return f"{message.group(1).lower()}{to}"
    if (kind := _HTTP_KIND.search(text)) is not None and kind.group(1) == "Timeout":
        return f"timed out{to}"
    lowered = text.lower()
    if (cause := next((phrase for mark, phrase in _CAUSES if mark in lowered), None)) is not None:
        return f"{cause}{to}"
    return brief(_URL.sub(r"\1", text))


def unreachable(text: str) -> bool:
    """Whether an obstore error's text says the request got no answer from a server."""
    lowered = text.lower()
    return any(mark in lowered for mark in UNREACHABLE_MARKS)


def endpoint_answers(settings: S3Settings, timeout_s: float) -> str | None:
    """Why the endpoint (``s3_endpoint_url``, else the region's AWS endpoint on 443) cannot be
    reached, or None when it answers an HTTP ``HEAD /`` (any status, a certificate it fails to
    verify included) within ``timeout_s`` seconds: told apart from missing credentials."""
    import http.client
    import socket
    import ssl
    from urllib.parse import urlsplit

    url = settings.s3_endpoint_url or f"https://s3.{settings.s3_region}.amazonaws.com"
    parts = urlsplit(url)
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    timeout_s = max(timeout_s, 0.05)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=timeout_s).close()
    except OSError:
        return "nothing accepts connections at the endpoint"
    conn = (http.client.HTTPSConnection(parts.hostname or "", port, timeout=timeout_s) if https
            else http.client.HTTPConnection(parts.hostname or "", port, timeout=timeout_s))
    try:
        conn.request("HEAD", "/")
        conn.getresponse()
    except ssl.SSLCertVerificationError:
        return None  # it answered the TLS handshake
    except (OSError, http.client.HTTPException):
        return (f"the endpoint accepted the connection but did not answer an HTTP request within {timeout_s:g} s "
                "(a stalled server, or not an S3 endpoint)")
    finally:
        conn.close()
    return None


def describe_failure(exc: BaseException, settings: S3Settings, timeout_s: float) -> tuple[str, str]:
    """``(state, detail)`` of a failed request: ``unreachable`` (said first: a server that does not
    answer cannot have refused anything; checked with :func:`endpoint_answers` when the error is
    about missing credentials), ``no bucket``, ``auth failed`` or ``failed``."""
    from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

    text = str(exc)
    if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)):
        return "auth failed", "the server refused the credentials (403)"
    if any(host in text for host in METADATA_HOSTS):
        if (why := endpoint_answers(settings, timeout_s)) is not None:
            return "unreachable", f"{why}; no credentials are set either"
        return "auth failed", ("no credentials: none in the environment or s3_credentials_file, and no instance or "
                               "container credentials answered")
    if unreachable(text):
        return "unreachable", s3_cause(exc)
    if "NoSuchBucket" in text:
        return "no bucket", "no such bucket"
    if any(mark in text for mark in AUTH_MARKS):  # a LIST's 403 arrives as obstore's generic error
        return "auth failed", "the server refused the credentials (403)"
    return "failed", s3_cause(exc) if text else type(exc).__name__
