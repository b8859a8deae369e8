"""The store's one snapshot (kvtier.core.stats) and the Prometheus view over it (kvtier.core.metrics)."""

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.core.mover import StoreCounters, directions
from kvtier.core.tiers.registry import available_tiers

from .helpers import CHUNK_BYTES, break_disk_shards, chain_of, make_store, payload

TIER_LABELLED = ("kvtier_corrupt_chunks_total", "kvtier_evictions_total", "kvtier_load_hit_chunks_total",
                 "kvtier_load_hit_tokens_total", "kvtier_lookup_hit_chunks_total", "kvtier_lookup_hit_tokens_total",
                 "kvtier_write_errors_total", "kvtier_quota_evictions_total")
PRESENT_TIER = ("kvtier_capacity_bytes", "kvtier_usage_bytes", "kvtier_pinned_bytes", "kvtier_pinned_chunks")
PLAIN = ("kvtier_dirty_bytes", "kvtier_dropped_saves_total", "kvtier_failed_loads_total", "kvtier_lookup_chunks_total",
         "kvtier_lookup_tokens_total", "kvtier_ttl_pin_refused_chunks_total")


def exported(store):
    """{(sample name, labels): value} of the store's registry, without ``_created``, histogram and info."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(store.metrics.registry).decode()):
        if family.name in ("kvtier_lookup_seconds", "kvtier_config", "kvtier_config_info"):
            continue
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_exported_series_keep_their_names_and_labels_and_read_the_snapshot(tmp_path):
    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=16)
    a = chain_of(1, 6)
    assert store.put(a, [bytes([i]) * CHUNK_BYTES for i in range(6)]) == 4
    store.flush()
    assert store.get(a) is not None
    store.lookup(a)
    series = exported(store)
    # the names and labels docs/store.md and the dashboards use (a rename must be deliberate)
    want = {(n, (("tier", t),)) for n in TIER_LABELLED for t in available_tiers()}  # every registered tier
    want |= {(n, (("tier", t),)) for n in PRESENT_TIER for t in ("cpu", "disk")}
    want |= {(n, ()) for n in PLAIN}
    want.add(("kvtier_ttl_pinned_chunks", (("tier", "cpu"),)))  # requests' TTL pins: the top tier only
    want |= {(n, (("direction", d),)) for n in ("kvtier_transfer_bytes_total", "kvtier_transfer_seconds_total")
             for d in directions()}
    # a lower tier's codec chain (kvtier.core.codecstats): the disk tier, identity here
    want |= {("kvtier_codec_bytes_total", (("stage", st), ("tier", "disk"))) for st in ("before", "after", "stored",
                                                                                      "decoded")}
    want |= {("kvtier_codec_seconds_total", (("direction", d), ("tier", "disk"))) for d in ("encode", "decode")}
    want |= {("kvtier_codec_failures_total", (("kind", k), ("tier", "disk"))) for k in ("decrypt", "decode")}
    assert set(series) == want
    s = store.stats()
    assert s.lookup_chunks == 6 and s.dropped_saves == 2  # 4 cpu pages: two of six saves had no room
    assert series[("kvtier_lookup_tokens_total", ())] == 6 * s.chunk_tokens
    assert series[("kvtier_dropped_saves_total", ())] == s.dropped_saves
    assert series[("kvtier_dirty_bytes", ())] == s.dirty_bytes
    for tier in ("cpu", "disk"):
        t = s.tier(tier)
        assert series[("kvtier_usage_bytes", (("tier", tier),))] == t.used_bytes
        assert series[("kvtier_capacity_bytes", (("tier", tier),))] == t.capacity_bytes > 0
        assert series[("kvtier_load_hit_tokens_total", (("tier", tier),))] == t.load_hit_chunks * s.chunk_tokens
        assert series[("kvtier_lookup_hit_chunks_total", (("tier", tier),))] == t.lookup_hit_chunks
        assert series[("kvtier_evictions_total", (("tier", tier),))] == t.evictions
    assert s.tier("cpu").lookup_hit_chunks + s.tier("disk").lookup_hit_chunks == 4
    assert series[("kvtier_transfer_bytes_total", (("direction", "engine_to_cpu"),))] == 4 * CHUNK_BYTES
    assert s.transfer_bytes["engine_to_cpu"] == 4 * CHUNK_BYTES
    assert s.tier("redis").load_hit_chunks == 0 and "redis" not in s.tiers
    store.close()


def test_failed_disk_writes_are_counted_in_the_snapshot_and_exported(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=16, write_mode="write-through")
    a = chain_of(7, 4)
    break_disk_shards(store.index.lower[0].tier, a)
    assert store.put(a, [payload(k) for k in a]) == 4
    store.flush()
    s = store.stats()
    assert s.tier("disk").write_errors == 4 == s.write_errors and s.tier("cpu").write_errors == 0
    assert s.tier("disk").num_chunks == 0
    series = exported(store)
    assert series[("kvtier_write_errors_total", (("tier", "disk"),))] == 4
    assert series[("kvtier_write_errors_total", (("tier", "cpu"),))] == 0
    store.close()


def test_a_transfer_in_an_unknown_direction_is_refused():
    counters = StoreCounters()
    with pytest.raises(ValueError, match="unknown transfer direction 'cpu_to_gpu'"):
        counters.moved("cpu_to_gpu", 1, 0.1)
    counters.moved("cpu_to_disk", 10, -1.0)  # a clock step back never makes time negative
    snap = counters.snapshot(1, 1, {}, 0, 0)
    assert snap.transfer_bytes["cpu_to_disk"] == 10 and snap.transfer_seconds["cpu_to_disk"] == 0.0


def test_two_remote_tiers_share_one_latency_histogram_in_a_registry():
    """redis and s3 in one store: one ``kvtier_tier_call_seconds`` family, a ``tier`` label each
    (registering it twice raised "Duplicated timeseries" and stopped the worker at start-up)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvtier.core.tiers.tiermetrics import TierMetrics

    registry = CollectorRegistry()
    first, second = TierMetrics("redis", registry), TierMetrics("s3", registry)
    first.observe("get", 0.002)
    second.observe("get", 0.2)
    text = generate_latest(registry).decode()
    assert text.count("# TYPE kvtier_tier_call_seconds histogram") == 1
    assert 'kvtier_tier_call_seconds_count{op="get",tier="redis"} 1.0' in text
    assert 'kvtier_tier_call_seconds_count{op="get",tier="s3"} 1.0' in text
