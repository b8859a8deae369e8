"""One HTTP GET under a total deadline: the one place kvtier reads a small page from a server.

httpx's ``timeout`` bounds each socket read, not the exchange: a server (or a wedged proxy) that
sends its headers and then a byte a second holds a plain ``httpx.get`` forever.
:func:`get_within` runs the GET (httpx, streamed) in a daemon thread and waits for it at most
``timeout_s`` seconds, so connect, headers and body together end by the deadline; the worker stops
at its next byte after the deadline, and the body is refused beyond ``max_body_bytes``.

Used for ``/metrics`` (:mod:`kvtier.core.scrape`: ``kvtier doctor``, ``kvtier bench``) and the
``/v1/models`` probes of ``kvtier bench run``, ``kvtier trace record`` and the vLLM launcher.

Errors: every failure is a :class:`kvtier.core.errors.ServerAnswerError` (or the subclass the
caller names) whose one sentence names the URL and the cause.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import httpx

from kvtier.core.errors import ServerAnswerError

MAX_BODY_BYTES = 64 << 20
"""Largest body read by default (bytes); the pages kvtier reads are tens of KiB."""


@dataclass(frozen=True)
class Page:
    """A server's answer: HTTP ``status`` and the ``text`` of its body (decoded, errors replaced)."""

    status: int
    text: str


def _get(url: str, timeout_s: float, deadline: float, max_body_bytes: int, what: str,
         error: type[ServerAnswerError], result: list[object]) -> None:
    """Worker: append the Page or an error to ``result`` (nothing once the deadline passed)."""
    try:
        with httpx.stream("GET", url, timeout=timeout_s) as response:
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > max_body_bytes:
                    raise error(f"{url} sent more than {max_body_bytes >> 20} MiB for {what}; is this the "
                                "right URL?")
                if time.monotonic() > deadline:
                    return  # the caller has already reported the timeout
            text = bytes(body).decode(response.encoding or "utf-8", errors="replace")
            result.append(Page(response.status_code, text))
    except ServerAnswerError as exc:
        result.append(exc)
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as exc:
        result.append(error(f"cannot reach {url} ({exc.__class__.__name__}); is the server up?"))


def get_within(url: str, timeout_s: float, what: str, *, max_body_bytes: int = MAX_BODY_BYTES,
               error: type[ServerAnswerError] = ServerAnswerError) -> Page:
    """GET ``url`` and return its answer (any status), all within ``timeout_s`` seconds.

    Args:
        url: the full URL (``http://host:port/path``).
        timeout_s: total deadline in seconds (connect, headers and body together).
        what: what the page is, for messages (e.g. ``"its /metrics"``).
        max_body_bytes: longest body accepted.
        error: the exception class raised (a :class:`ServerAnswerError` subclass).

    Raises:
        ServerAnswerError (or ``error``): ``timeout_s`` not a positive finite number, connection
            failure, the deadline passed, or a body over ``max_body_bytes``.
    """
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise error(f"the timeout for {what} must be a positive number of seconds, got {timeout_s}.")
    result: list[object] = []
    worker = threading.Thread(target=_get, daemon=True, name="kvtier-bounded-get",
                              args=(url, timeout_s, time.monotonic() + timeout_s, max_body_bytes, what, error,
                                    result))
    worker.start()
    worker.join(timeout_s)
    if not result:
        raise error(f"{url} did not send {what} within {timeout_s:g} s; "
                    "is the server overloaded, or is this the right URL?")
    outcome = result[0]
    if isinstance(outcome, ServerAnswerError):
        raise outcome
    assert isinstance(outcome, Page)
    return outcome
