"""Read a server's ``/metrics``: the one place kvtier fetches and parses a Prometheus page.

Used by ``kvtier doctor``, ``kvtier bench`` and the vLLM test launcher.  :func:`fetch_metrics`
is one HTTP GET (httpx) whose ``timeout_s`` bounds the whole scrape (connect, headers and body
together), not each socket read: a server that trickles a byte a second would otherwise hold the
caller forever.  The GET runs in a daemon thread that the caller waits on for at most the
deadline; the body is streamed and refused beyond :data:`MAX_BODY_BYTES` (a real vLLM /metrics
page is tens of KiB).  :func:`metric_families` parses the text with prometheus_client's parser
(never by hand).

Errors: every failure is a :class:`kvtier.core.errors.MetricsError` (a ``UserError``) whose one
sentence names the URL and the cause.
"""

from __future__ import annotations

import math
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvtier.core.errors import MetricsError

MAX_BODY_BYTES = 64 << 20
"""Largest /metrics body read (bytes); more than this is not a vLLM metrics page."""


def metrics_url(url: str) -> str:
    """``http://host:port`` → ``http://host:port/metrics``; a URL with a path is kept as given.

    Raises:
        MetricsError: not an http(s) URL, or malformed (e.g. an unclosed ``[`` IPv6 host, a bad port).
    """
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError:
        raise MetricsError(f"the URL {url!r} is not a valid URL; write it like http://HOST:PORT.") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise MetricsError(f"the URL {url!r} is not an http(s) URL like http://HOST:PORT.")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def _get(url: str, timeout_s: float, deadline: float, result: list[object]) -> None:
    """Worker: append the body (str) or a MetricsError to ``result``."""
    try:
        with httpx.stream("GET", url, timeout=timeout_s) as response:
            if response.status_code != 200:
                raise MetricsError(f"{url} answered HTTP {response.status_code}; is this the vLLM server's URL?")
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise MetricsError(f"{url} sent more than {MAX_BODY_BYTES >> 20} MiB; that is not a vLLM "
                                       "/metrics page.")
                if time.monotonic() > deadline:
                    return  # the caller has already reported the timeout
            result.append(bytes(body).decode(response.encoding or "utf-8", errors="replace"))
    except MetricsError as exc:
        result.append(exc)
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as exc:
        result.append(MetricsError(f"cannot reach {url} ({exc.__class__.__name__}); is the vLLM server up?"))


def fetch_metrics(url: str, timeout_s: float = 10.0) -> str:
    """GET the ``/metrics`` page of ``url`` (see :func:`metrics_url`) and return its text, all
    within ``timeout_s`` seconds.

    Raises:
        MetricsError: bad URL or timeout, connection failure, the deadline passed, a non-200
            answer, or a body over MAX_BODY_BYTES.
    """
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise MetricsError(f"the /metrics timeout must be a positive number of seconds, got {timeout_s}.")
    url = metrics_url(url)
    result: list[object] = []
    worker = threading.Thread(target=_get, args=(url, timeout_s, time.monotonic() + timeout_s, result),
                              daemon=True, name="kvtier-metrics-scrape")
    worker.start()
    worker.join(timeout_s)
    if not result:
        raise MetricsError(f"{url} did not send its /metrics within {timeout_s:g} s; "
                           "is the server overloaded, or is this the right URL?")
    outcome = result[0]
    if isinstance(outcome, MetricsError):
        raise outcome
    assert isinstance(outcome, str)
    return outcome


def metric_families(text: str, where: str) -> list[Metric]:
    """Parse Prometheus text exposition from ``where`` (a URL or file name, for messages).

    Raises:
        MetricsError: the text is not Prometheus exposition format.
    """
    try:
        return list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsError(f"{where} is not Prometheus text ({exc.__class__.__name__}); "
                           "is it a /metrics URL?") from None
