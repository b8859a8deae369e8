"""Fetch ``/metrics`` over HTTP with httpx."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import httpx

from kvtier.cli.errors import UserError


def metrics_url(url: str) -> str:
    """``http://host:port`` → ``http://host:port/metrics``; a URL with a path is kept as given."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"--url {url!r} is not an http(s) URL like http://HOST:PORT.")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def fetch(url: str, timeout_s: float = 10.0) -> str:
    """GET ``url`` and return its body.

    Raises:
        UserError: connection failure, timeout, or a non-200 answer.
    """
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach {url} ({exc.__class__.__name__}); is the vLLM server up?") from None
    if response.status_code != 200:
        raise UserError(f"{url} answered HTTP {response.status_code}; point --url at the vLLM server.")
    return response.text
