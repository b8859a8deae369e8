"""Read a server's ``/metrics``: the one place kvtier fetches and parses a Prometheus page.

Used by ``kvtier doctor``, ``kvtier bench`` and the vLLM test launcher.  :func:`fetch_metrics`
is one GET through :func:`kvtier.tools.httpget.get_within`, whose ``timeout_s`` bounds the whole
scrape (connect, headers and body together), not each socket read: a server that trickles a byte
a second would otherwise hold the caller forever; the body is refused beyond
:data:`MAX_BODY_BYTES` (a real vLLM /metrics page is tens of KiB).  :func:`metric_families`
parses the text with prometheus_client's parsers (never by hand): the Prometheus text format, with
or without HELP/TYPE lines, and OpenMetrics text (ending ``# EOF``), into the same families.

Errors: every failure is a :class:`kvtier.core.errors.MetricsError` (a ``UserError``) whose one
sentence names the URL and the cause.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from kvtier.core.errors import MetricsError
from kvtier.tools.httpget import MAX_BODY_BYTES, get_within

__all__ = ["MAX_BODY_BYTES", "fetch_metrics", "metric_families", "metrics_url"]


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


def fetch_metrics(url: str, timeout_s: float = 10.0) -> str:
    """GET the ``/metrics`` page of ``url`` (see :func:`metrics_url`) and return its text, all
    within ``timeout_s`` seconds.

    Raises:
        MetricsError: bad URL or timeout, connection failure, the deadline passed, a non-200
            answer, or a body over MAX_BODY_BYTES.
    """
    url = metrics_url(url)
    page = get_within(url, timeout_s, "its /metrics", error=MetricsError)
    if page.status == 404 and not urlsplit(url).path.endswith("/metrics"):
        root = urlunsplit(urlsplit(url)._replace(path="", query=""))
        raise MetricsError(f"{url} answered HTTP 404: a URL with a path is scraped as given, and vLLM serves its "
                           f"metrics at the server's root; give {root} (kvtier adds /metrics).")
    if page.status != 200:
        raise MetricsError(f"{url} answered HTTP {page.status}; is this the vLLM server's URL?")
    return page.text


def metric_families(text: str, where: str, from_file: bool = False) -> list[Metric]:
    """Parse Prometheus text exposition from ``where`` (a URL or, with ``from_file``, a file name; for
    messages: a file's hint says how to record one, a URL's asks whether it is /metrics).

    Raises:
        MetricsError: the text is not Prometheus exposition format.
    """
    if text.rstrip().endswith("# EOF"):  # OpenMetrics (its required last line); else Prometheus text
        try:
            return [_as_text_family(f) for f in openmetrics_families(text)]
        except (ValueError, TypeError, IndexError):
            pass  # "# EOF" is only a comment to the Prometheus text format: read it as that
    try:
        return _typed(list(text_string_to_metric_families(text)))
    except (ValueError, TypeError, IndexError) as exc:
        hint = ("record it from the server with curl -s http://HOST:PORT/metrics > FILE" if from_file
                else "is it a /metrics URL?")
        raise MetricsError(f"{where} is not Prometheus text ({exc.__class__.__name__}); {hint}") from None


HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def _as_text_family(family: Metric) -> Metric:
    """An OpenMetrics family named as the Prometheus text parser names it: an info family ``X``
    (samples ``X_info``) is ``X_info`` there; counters (``X``, samples ``X_total``) and histograms
    are named alike by both."""
    if family.type == "info":
        family.name += "_info"
    return family


def _typed(families: list[Metric]) -> list[Metric]:
    """``families`` with the samples of untyped ones (no TYPE line: the text parser makes each
    sample name a family of type ``unknown``) gathered under the name a TYPE line would give them:
    ``X_total`` into counter ``X``, ``X_bucket``/``X_count``/``X_sum`` into histogram ``X`` when an
    ``X_bucket`` is there (the Prometheus exposition format's suffixes,
    https://prometheus.io/docs/instrumenting/exposition_formats/).  A typed family ``X`` without
    samples (its TYPE line names ``X``, its samples ``X_total``) takes them.  Others are kept."""
    unknown = {f.name for f in families if f.type == "unknown"}
    typed = {f.name: f for f in families if f.type != "unknown"}
    made: dict[str, Metric] = {}
    out: list[Metric] = []
    for family in families:
        base, kind = _base_of(family.name, unknown) if family.type == "unknown" else (None, "")
        if base is None:
            out.append(family)
            continue
        into = made.get(base)
        if into is None:
            empty = typed.get(base)
            into = empty if empty is not None and not empty.samples else Metric(base, family.documentation, kind)
            made[base] = into
            if into is not empty:
                out.append(into)
        into.samples.extend(family.samples)
    return out


def _base_of(name: str, unknown: set[str]) -> tuple[str | None, str]:
    """The family name and type an untyped sample name ``name`` belongs to, else ``(None, "")``."""
    if name.endswith("_total"):
        return name[:-len("_total")], "counter"
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[:-len(suffix)] + "_bucket" in unknown:
            return name[:-len(suffix)], "histogram"
    return None, ""
