"""kvtier doctor on a server whose requests pin prefixes (docs/vllm.md "Pinning a prefix").

The pin series are made by the real pieces: a worker rank's store pins chunks
(:meth:`TieredStore.ttl_pin`), its snapshot goes through the connector's
:class:`KVTierPromMetrics` (vLLM's ``/metrics``, in a private registry) and is added to the texts
recorded from a real vLLM server (tests/doctor/data/kvtier-cpu)."""

from __future__ import annotations

import dataclasses
import functools
import types

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtier.core.config import KVTierConfig
from kvtier.core.store import TieredStore
from kvtier.doctor import allocation, diagnose, measure, parse_metrics
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats, store_counters, store_gauges
from tests.core.helpers import CHUNK_BYTES, CHUNK_TOKENS, NS, chain_of, payload

from .test_doctor import AFTER, BEFORE


def _scrape(store: TieredStore, prom: KVTierPromMetrics, registry: CollectorRegistry, seen: object) -> str:
    snapshot = store.stats()
    stats = KVTierStats(data={"counters": store_counters(snapshot, seen), "gauges": store_gauges(snapshot)})  # type: ignore[arg-type]
    prom.observe(stats.data, 0)
    text = generate_latest(registry).decode()
    return "".join(line + "\n" for line in text.splitlines() if "kvtier_ttl_pin" in line)


def test_doctor_reports_pins_and_refused_pins() -> None:
    config = KVTierConfig.from_dict({"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 8 * CHUNK_BYTES / 2**30,
                                     "pin_max_share": 0.25})  # 2 of 8 pages
    store = TieredStore(config, dataclasses.replace(NS, tp_size=1, tp_rank=0), CHUNK_BYTES, 1)
    registry = CollectorRegistry()
    kinds = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = KVTierPromMetrics(types.SimpleNamespace(kv_transfer_config=None), kinds,  # type: ignore[arg-type]
                             ["model_name", "engine"], {0: ["tiny", "0"]})
    try:
        system, other = chain_of(1, 2), chain_of(2, 2)
        for chain in (system, other):
            store.put(chain, [payload(k) for k in chain])
        assert store.ttl_pin(system, 600) == (2, 0)
        first = store.stats()
        before = BEFORE + _scrape(store, prom, registry, None)
        meters = measure(parse_metrics(before, "b"), parse_metrics(AFTER + _scrape(store, prom, registry, first), "a"),
                         10.0)
        assert meters.pins is not None and (meters.pins.chunks, meters.pins.refused) == (2, 0)
        assert meters.pins.bytes == 2 * CHUNK_BYTES
        checks = diagnose(meters, allocation(parse_metrics(AFTER, "a")), {}, None, 1).checks
        assert any(c.level == "ok" and c.message.startswith("Pins: 2 chunks") for c in checks)

        assert store.ttl_pin(other, 600) == (0, 2)  # past pin_max_share
        after = AFTER + _scrape(store, prom, registry, first)
        meters = measure(parse_metrics(before, "b"), parse_metrics(after, "a"), 10.0)
        assert meters.pins is not None and meters.pins.refused == 2
        checks = diagnose(meters, allocation(parse_metrics(after, "a")), {}, None, 1).checks
        assert any(c.level == "warning" and "2 chunk pins refused" in c.message for c in checks)
    finally:
        store.close()


def test_no_pin_series_no_pin_lines() -> None:
    meters = measure(parse_metrics(BEFORE, "b"), parse_metrics(AFTER, "a"), 10.0)
    assert meters.pins is None
    assert not any(c.message.startswith("Pins") for c in diagnose(meters, allocation(parse_metrics(AFTER, "a")),
                                                                   {}, None, 1).checks)
