"""HTTP exchanges under a total deadline: the one place kvtier talks to a server with a bound.

httpx's ``timeout`` bounds each socket read, not the exchange: a server (or a wedged proxy) that
sends its headers and then a byte a second holds a plain ``httpx.get`` or ``httpx.stream`` forever.
:func:`stream_within` runs the request (httpx, streamed) in a daemon thread that hands the answer
over through a bounded queue, and the caller waits for each piece only until ``timeout_s`` after
the start (or until a ``stop`` event is set), so connect, headers and body together end by the
deadline; the worker stops at its next byte once the caller has gone.  :func:`request_within`
(and :func:`get_within`) collect a whole small answer that way, refusing a body beyond
``max_body_bytes``.

Used for ``/metrics`` (:mod:`kvtier.tools.scrape`: ``kvtier doctor``, ``kvtier bench``), the
``/v1/models`` probes of ``kvtier bench run``, ``kvtier trace record`` and the vLLM launcher, the
recording proxy's upstream calls (:mod:`kvtier.simulate.record`), the launcher's test completions
(``Server.complete``) and the hub's ``config.json`` (:mod:`kvtier.size.models`).

Errors: every failure is a :class:`kvtier.core.errors.ServerAnswerError` (or the subclass the
caller names) whose one sentence names the URL and the cause.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import httpx

from kvtier.core.errors import ServerAnswerError

MAX_BODY_BYTES = 64 << 20
"""Largest body read by default (bytes); the pages kvtier reads are tens of KiB."""

QUEUE_PIECES = 64
"""Body pieces held between the worker and a slow caller (a bound: the worker waits beyond it)."""

_POLL_S = 0.1  # how often a waiting caller looks at its stop event


@dataclass(frozen=True)
class Page:
    """A server's answer: HTTP ``status`` and the ``text`` of its body (decoded, errors replaced)."""

    status: int
    text: str


@dataclass(frozen=True)
class Head:
    """The start of a streamed answer: HTTP ``status`` and its ``headers`` (name, value) in order."""

    status: int
    headers: tuple[tuple[str, str], ...]


_END = object()


def _stream(method: str, url: str, timeout_s: float, request: dict[str, Any], client: httpx.Client | None,
            error: type[ServerAnswerError], pieces: queue.Queue[object], gone: threading.Event) -> None:
    """Worker: put the Head, each body piece, then ``_END`` (or an error) on ``pieces``; stop
    as soon as the caller is ``gone``."""

    def put(item: object) -> bool:
        while not gone.is_set():
            try:
                pieces.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    try:
        opener = client.stream if client is not None else httpx.stream
        kwargs = request if client is not None else {**request, "timeout": timeout_s}
        with opener(method, url, **kwargs) as response:
            if not put(Head(response.status_code, tuple(response.headers.multi_items()))):
                return
            for chunk in response.iter_bytes():
                if not put(chunk):
                    return
        put(_END)
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError, RuntimeError) as exc:  # RuntimeError: a closed client
        put(error(f"cannot reach {url} ({exc.__class__.__name__}); is the server up?"))


def stream_within(method: str, url: str, timeout_s: float, what: str, *, json: Any = None,
                  content: bytes | None = None, headers: dict[str, str] | None = None,
                  client: httpx.Client | None = None, follow_redirects: bool = False,
                  stop: threading.Event | None = None,
                  error: type[ServerAnswerError] = ServerAnswerError) -> Generator[Head | bytes, None, None]:
    """Send one request and yield its :class:`Head`, then its body in pieces (bytes), all within
    ``timeout_s`` seconds of the call.

    Args:
        method, url: the request (``url`` absolute, or relative to ``client``'s base URL).
        timeout_s: total deadline in seconds (connect, headers and the whole body together).
        what: what is asked for, for messages (e.g. ``"its model list"``).
        json, content, headers: the request body (a JSON value, or raw bytes) and headers.
        client: an ``httpx.Client`` to send through (its own timeout bounds each read); default a
            fresh connection with ``timeout_s`` per read.
        follow_redirects: follow 3xx answers (without ``client`` only).
        stop: when set, the exchange ends at once with ``error`` (e.g. a recording that ends).
        error: the exception class raised (a :class:`ServerAnswerError` subclass).

    Raises:
        ServerAnswerError (or ``error``): ``timeout_s`` not a positive finite number, connection
            failure, the deadline passed, or ``stop`` set.  Closing the generator early is fine:
            the worker stops at its next piece.
    """
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise error(f"the timeout for {what} must be a positive number of seconds, got {timeout_s}.")
    request: dict[str, Any] = {"json": json, "content": content, "headers": headers}
    if client is None:
        request["follow_redirects"] = follow_redirects
    pieces: queue.Queue[object] = queue.Queue(QUEUE_PIECES)
    gone = threading.Event()
    deadline = time.monotonic() + timeout_s
    threading.Thread(target=_stream, daemon=True, name="kvtier-bounded-http",
                     args=(method, url, timeout_s, request, client, error, pieces, gone)).start()
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise error(f"{url} did not send {what} within {timeout_s:g} s; "
                            "is the server overloaded, or is this the right URL?")
            if stop is not None and stop.is_set():
                raise error(f"stopped waiting for {what} from {url}")
            try:
                item = pieces.get(timeout=min(remaining, _POLL_S) if stop is not None else remaining)
            except queue.Empty:
                continue
            if item is _END:
                return
            if isinstance(item, ServerAnswerError):
                raise item
            assert isinstance(item, (Head, bytes))
            yield item
    finally:
        gone.set()


def request_within(method: str, url: str, timeout_s: float, what: str, *, json: Any = None,
                   max_body_bytes: int = MAX_BODY_BYTES, follow_redirects: bool = False,
                   client: httpx.Client | None = None, stop: threading.Event | None = None,
                   error: type[ServerAnswerError] = ServerAnswerError) -> Page:
    """Send one request and return its whole answer (any status), all within ``timeout_s`` seconds.

    Args: as :func:`stream_within`; ``max_body_bytes``: longest body accepted.

    Raises:
        ServerAnswerError (or ``error``): as :func:`stream_within`, or a body over ``max_body_bytes``.
    """
    status, encoding, body = 0, "utf-8", bytearray()
    answer = stream_within(method, url, timeout_s, what, json=json, client=client, stop=stop,
                           follow_redirects=follow_redirects, error=error)
    try:
        for item in answer:
            if isinstance(item, Head):
                status = item.status
                encoding = httpx.Response(status, headers=list(item.headers)).encoding or "utf-8"
                continue
            body += item
            if len(body) > max_body_bytes:
                raise error(f"{url} sent more than {max_body_bytes >> 20} MiB for {what}; is this the "
                            "right URL?")
    finally:
        answer.close()
    return Page(status, bytes(body).decode(encoding, errors="replace"))


def get_within(url: str, timeout_s: float, what: str, *, max_body_bytes: int = MAX_BODY_BYTES,
               follow_redirects: bool = False, error: type[ServerAnswerError] = ServerAnswerError) -> Page:
    """GET ``url`` and return its answer (any status), all within ``timeout_s`` seconds.

    Args:
        url: the full URL (``http://host:port/path``).
        timeout_s: total deadline in seconds (connect, headers and body together).
        what: what the page is, for messages (e.g. ``"its /metrics"``).
        max_body_bytes: longest body accepted.
        follow_redirects: follow 3xx answers.
        error: the exception class raised (a :class:`ServerAnswerError` subclass).

    Raises:
        ServerAnswerError (or ``error``): ``timeout_s`` not a positive finite number, connection
            failure, the deadline passed, or a body over ``max_body_bytes``.
    """
    return request_within("GET", url, timeout_s, what, max_body_bytes=max_body_bytes,
                          follow_redirects=follow_redirects, error=error)
