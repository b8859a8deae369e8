"""Server meters: scrape ``/metrics`` before and after a run and take the deltas.

Counters read (vLLM v1, vllm/v1/metrics/loggers.py, all in tokens):

* ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``: every prompt token is queried
  against the engine's own prefix cache; hits are the tokens found there.
* ``vllm:external_prefix_cache_queries`` / ``_hits``: the tokens the engine did not find itself
  and asked the KV connector for; hits are the tokens the connector supplied
  (vllm/v1/core/sched/scheduler.py: queries = prompt tokens - local hits).
* ``kvtier_*bytes*`` counters with a ``direction`` label (kvtier's store metrics, optionally
  ``vllm:``-prefixed when re-exported by the engine): bytes moved per direction.

Samples are summed over all other labels (engines, models).  Gauges are never differenced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.core.errors import MetricsError
from kvtier.tools.scrape import fetch_metrics, metric_families

PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
_KVTIER_BYTES = re.compile(r"^(vllm:)?kvtier_\w*bytes\w*$")

LabelSet = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class MetricsSnapshot:
    """Counter values of one scrape: ``counters[family][labels] = value`` (family without ``_total``).

    Attributes:
        counters: counter families only (the only ones that may be differenced).
    """

    counters: dict[str, dict[LabelSet, float]]

    def total(self, family: str) -> float:
        """Sum of a counter family over all label sets; 0.0 if the server does not export it."""
        return sum(self.counters.get(family, {}).values())

    def by_label(self, family: str, label: str) -> dict[str, float]:
        """Sum of a counter family grouped by one label's value (samples without it are skipped)."""
        out: dict[str, float] = {}
        for labels, value in self.counters.get(family, {}).items():
            value_of = dict(labels).get(label)
            if value_of is not None:
                out[value_of] = out.get(value_of, 0.0) + value
        return out


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse Prometheus text exposition (prometheus_client's parser) into a snapshot of counters.

    Raises:
        MetricsError: the text is not Prometheus exposition format.
    """
    counters: dict[str, dict[LabelSet, float]] = {}
    try:
        for family in metric_families(text, "the /metrics text"):
            name = family.name
            if family.type == "unknown" and name.endswith("_total"):
                name = name[: -len("_total")]  # an untyped ``*_total`` sample is a counter by convention
            elif family.type != "counter":
                continue
            values = counters.setdefault(name, {})
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue  # creation timestamps, not counts
                labels = tuple(sorted(sample.labels.items()))
                values[labels] = values.get(labels, 0.0) + float(sample.value)
    except ValueError as exc:
        raise MetricsError(f"the /metrics text is not Prometheus exposition format ({exc})") from None
    return MetricsSnapshot(counters=counters)


def scrape(base_url: str, timeout_s: float = 10.0, save_to: Path | None = None) -> MetricsSnapshot:
    """Fetch and parse ``{base_url}/metrics``; the raw text is also written to ``save_to`` if given.

    Raises:
        MetricsError: the server did not answer 200, or the text is not Prometheus format.
    """
    text = fetch_metrics(base_url, timeout_s)
    if save_to is not None:
        save_to.parent.mkdir(parents=True, exist_ok=True)
        save_to.write_text(text)
    return parse_metrics(text)


@dataclass(frozen=True)
class MeterDeltas:
    """What the server counted during a run (after - before), tokens unless named bytes.

    Attributes:
        prefix_queries, prefix_hits: engine prefix cache, tokens.
        external_queries, external_hits: KV connector lookups, tokens.
        kvtier_bytes: bytes moved per direction (e.g. ``engine_to_cpu``, ``cpu_to_engine``); empty
            when the server exports no kvtier metrics.
    """

    prefix_queries: float
    prefix_hits: float
    external_queries: float
    external_hits: float
    kvtier_bytes: dict[str, float] = field(default_factory=dict)

    @property
    def engine_hit_rate(self) -> float | None:
        """Share of queried prompt tokens found in the engine's own cache; ``None`` if none queried."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries > 0 else None

    @property
    def external_hit_rate(self) -> float | None:
        """Share of the connector's queried tokens it supplied; ``None`` if it was never asked."""
        return self.external_hits / self.external_queries if self.external_queries > 0 else None

    @property
    def prefix_hit_rate(self) -> float | None:
        """Share of queried prompt tokens not recomputed: (engine hits + connector hits) / queries.

        This is meter 1 of the verdict, comparable across arms with and without a connector.
        """
        if self.prefix_queries <= 0:
            return None
        return min(1.0, (self.prefix_hits + self.external_hits) / self.prefix_queries)


def deltas(before: MetricsSnapshot, after: MetricsSnapshot) -> MeterDeltas:
    """The counters' increase between two scrapes of the same server (a counter that went down
    means the server restarted: its ``after`` value is taken as the increase)."""

    def inc(family: str) -> float:
        a, b = after.total(family), before.total(family)
        return a - b if a >= b else a

    directions: dict[str, float] = {}
    for family in after.counters:
        if not _KVTIER_BYTES.match(family):
            continue
        b_by = before.by_label(family, "direction")
        for direction, value in after.by_label(family, "direction").items():
            prior = b_by.get(direction, 0.0)
            directions[direction] = directions.get(direction, 0.0) + (value - prior if value >= prior else value)
    return MeterDeltas(prefix_queries=inc(PREFIX_QUERIES), prefix_hits=inc(PREFIX_HITS),
                       external_queries=inc(EXTERNAL_QUERIES), external_hits=inc(EXTERNAL_HITS),
                       kvtier_bytes=directions)
