"""kvtier doctor on a server whose requests pin prefixes (docs/vllm.md "Pinning a prefix").

The pin series are made by the real pieces: a worker rank's store pins chunks
(:meth:`TieredStore.ttl_pin`), its snapshot goes through the connector's
:class:`KVTierPromMetrics` (vLLM's ``/metrics``, in a private registry) and is added to the texts
recorded from a real vLLM server (tests/doctor/data/kvtier-cpu)."""

from __future__ import annotations

import dataclasses
import functools
import math
import types

import pytest
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


def test_doctor_shows_kv_events_and_tenant_quotas_with_salts_only_as_digests() -> None:
    """Issue 22 item 6: the scheduler's once-sent gauges (events on, quota settings) and the
    workers' per-tenant bytes go through the connector's collectors; doctor names what is on and
    the largest tenants by digest."""
    from kvtier.core.quota import tenant_label
    from kvtier.core.tenant import TenantId

    config = KVTierConfig.from_dict({"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 8 * CHUNK_BYTES / 2**30,
                                     "tenant_quotas": {"default_share": 0.25, "salts": {"acme-secret": 0.5}}})
    store = TieredStore(config, dataclasses.replace(NS, tp_size=1, tp_rank=0), CHUNK_BYTES, 1)
    registry = CollectorRegistry()
    kinds = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = KVTierPromMetrics(types.SimpleNamespace(kv_transfer_config=None), kinds,  # type: ignore[arg-type]
                             ["model_name", "engine"], {0: ["tiny", "0"]})
    try:
        for prompt in range(3):
            chain = chain_of(prompt, 2, salt="acme-secret")
            store.put(chain, [payload(k) for k in chain], tenant=TenantId.of("acme-secret", None))
        snapshot = store.stats()
        prom.observe({"counters": store_counters(snapshot, None), "gauges": store_gauges(snapshot)}, 0)
        prom.observe({"counters": {}, "gauges": {"kv_events_enabled": 1.0, "tenant_quota_default_share": 0.25,
                                                 "tenant_quota_salts": 1.0}}, 0)  # the scheduler's, once
        text = generate_latest(registry).decode()
        assert "acme-secret" not in text
        extra = "".join(line + "\n" for line in text.splitlines()
                        if "kvtier_tenant" in line or "kvtier_kv_events_enabled" in line or "quota_evictions" in line)
        meters = measure(parse_metrics(BEFORE, "b"), parse_metrics(AFTER + extra, "a"), 10.0)
        label = tenant_label(TenantId.of("acme-secret", None).salt)
        assert meters.controls is not None and meters.controls.events_enabled
        assert meters.controls.tenants == {label: 6 * CHUNK_BYTES}
        messages = [c.message for c in diagnose(meters, allocation(parse_metrics(AFTER, "a")), {}, None, 1).checks]
        assert any(m.startswith("KV events: on") for m in messages)
        assert any(m.startswith("Tenant quotas: default share 0.25, 1 salt(s)") and label in m for m in messages)
    finally:
        store.close()
    meters = measure(parse_metrics(BEFORE, "b"), parse_metrics(AFTER, "a"), 10.0)
    assert meters.controls is None  # an older kvtier, or another connector: no lines


def _two_engine_settings(settings: dict[int, dict[str, float]]) -> str:
    """The settings gauges of two data-parallel engines (engine "0" and "1"), through the
    connector's real collectors, as /metrics lines."""
    registry = CollectorRegistry()
    kinds = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = KVTierPromMetrics(types.SimpleNamespace(kv_transfer_config=None), kinds,  # type: ignore[arg-type]
                             ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]})
    for engine, gauges in settings.items():
        prom.observe({"counters": {}, "gauges": gauges}, engine)
    text = generate_latest(registry).decode()
    return "".join(line + "\n" for line in text.splitlines()
                   if "kvtier_tenant_quota" in line or "kvtier_kv_events_enabled" in line)


def _control_messages(settings: dict[int, dict[str, float]]) -> list[tuple[str, str]]:
    meters = measure(parse_metrics(BEFORE, "b"), parse_metrics(AFTER + _two_engine_settings(settings), "a"), 10.0)
    return [(c.level, c.message) for c in diagnose(meters, allocation(parse_metrics(AFTER, "a")), {}, None, 1).checks]


SAME = {"kv_events_enabled": 1.0, "tenant_quota_default_share": 0.25, "tenant_quota_salts": 1.0}


def test_doctor_shows_settings_of_two_engines_once_never_summed() -> None:
    """Fixes item 1: settings of data-parallel engines are one value (0.25, not 0.5; 1 salt, not 2)."""
    messages = _control_messages({0: SAME, 1: SAME})
    # the recording's server has a cpu tier only (kvtier_capacity_bytes{tier="disk"} 0.0)
    assert ("ok", "KV events: on (routers learn kvtier's cpu chunks).") in messages
    quota = [m for level, m in messages if m.startswith("Tenant quotas")]
    assert len(quota) == 1 and quota[0].startswith("Tenant quotas: default share 0.25, 1 salt(s)")
    assert not any(level == "warning" and "kvtier_" in m for level, m in messages)


def test_doctor_says_when_engines_disagree_on_a_setting() -> None:
    messages = _control_messages({0: SAME, 1: SAME | {"tenant_quota_default_share": 0.5}})
    warnings = [m for level, m in messages if level == "warning" and "differs between engines" in m]
    assert warnings == [("kvtier_tenant_quota_default_share differs between engines (0.25, 0.5): start every "
                        "data-parallel engine with the same kvtier configuration.")]
    assert any(m.startswith("Tenant quotas: default share 0.25,") for _, m in messages)  # not 0.75


@pytest.mark.parametrize("share", [7.0, math.nan, math.inf])
def test_doctor_never_calls_an_impossible_default_share_ok(share: float) -> None:
    messages = _control_messages({0: SAME | {"tenant_quota_default_share": share}, 1: SAME})
    assert any(level == "warning" and m.startswith(f"kvtier_tenant_quota_default_share = {share:g} is impossible")
               for level, m in messages)
    assert not any(level == "ok" and f"default share {share:g}" in m for level, m in messages)


def test_doctor_shows_quotas_on_when_only_the_no_salt_share_is_set() -> None:
    """Issue 22: ``tenant_quotas`` with only ``no_salt_share`` guarantees the requests without a
    salt their share; doctor said "off" because it read only the default share and the salts.  The
    gauge's value is the one the scheduler sends (``QuotaSettings.no_salt_guarantee``)."""
    quotas = KVTierConfig.from_dict({"tenant_quotas": {"no_salt_share": 0.3}}).tenant_quotas
    assert quotas is not None and quotas.default_share is None and not quotas.salts
    settings = {"kv_events_enabled": 0.0, "tenant_quota_default_share": 0.0, "tenant_quota_salts": 0.0,
                "tenant_quota_no_salt_share": quotas.no_salt_guarantee}
    messages = _control_messages({0: settings, 1: settings})
    quota = [m for level, m in messages if level == "ok" and m.startswith("Tenant quotas")]
    assert quota == [("Tenant quotas: no default share, 0 salt(s) with their own share, no-salt share 0.3; "
                      "0 evictions chosen by the quotas between the scrapes.")]
    assert not any(level == "warning" for level, _ in messages)


def test_doctor_shows_quotas_off_without_any_share_and_from_an_older_kvtier() -> None:
    off = {"kv_events_enabled": 0.0, "tenant_quota_default_share": 0.0, "tenant_quota_salts": 0.0,
           "tenant_quota_no_salt_share": 0.0}
    older = {k: v for k, v in off.items() if k != "tenant_quota_no_salt_share"}  # before the no-salt gauge
    for settings in (off, older):
        messages = _control_messages({0: settings})
        assert any(m.startswith("Tenant quotas: off") for _, m in messages)


@pytest.mark.parametrize("share", [1.5, math.nan])
def test_doctor_never_calls_an_impossible_no_salt_share_ok(share: float) -> None:
    messages = _control_messages({0: SAME | {"tenant_quota_no_salt_share": share}})
    assert any(level == "warning" and m.startswith(f"kvtier_tenant_quota_no_salt_share = {share:g} is impossible")
               for level, m in messages)
    assert not any(f"no-salt share {share:g}" in m for _, m in messages)


def test_doctor_names_the_tiers_kv_events_announce_and_the_shared_ones_they_do_not() -> None:
    """The KV-events line says what a router learns on this server: the local tiers with a capacity
    (the recording is of a cpu-only server: it said "cpu and disk" there) and, with a shared tier
    (its breaker gauge in the scrape), that it is never announced (docs/vllm.md "KV events")."""
    disk = 'kvtier_capacity_bytes{engine="0",model_name="/tmp/tmp0gactnk3/tiny",tier="disk"}'
    assert f"{disk} 0.0" in AFTER
    after = AFTER.replace(f"{disk} 0.0", f"{disk} 1.073741824e+09") + _two_engine_settings({0: SAME})
    redis = 'kvtier_redis_breaker_state{engine="0",model_name="/tmp/tmp0gactnk3/tiny"} 0.0\n'
    for text, scope in ((after, "routers learn kvtier's cpu and disk chunks"),
                        (after + redis, ("routers learn kvtier's cpu and disk chunks; shared tier redis never "
                                         "announced: reachable from every engine"))):
        meters = measure(parse_metrics(BEFORE, "b"), parse_metrics(text, "a"), 10.0)
        checks = diagnose(meters, allocation(parse_metrics(text, "a")), {}, None, 1).checks
        assert [c.message for c in checks if c.message.startswith("KV events")] == [f"KV events: on ({scope})."]
