"""kvtier doctor on a server with the shared tier (redis): hit rate, breaker, skipped writes.

The shared-tier series are made by the real pieces, not written by hand: a worker rank's store
with a redis tier and the scheduler's :class:`RemoteLookups` talk to a real ``redis-server``;
their numbers go through the connector's :class:`KVTierPromMetrics` (what vLLM's ``/metrics``
serves, in a private registry) and are added to the /metrics texts recorded from a real vLLM
server (tests/doctor/data/kvtier-cpu).  Then Redis is killed (``kill -9``): the breaker opens and
writes are skipped, and the doctor must say so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import types

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtier.core.config import KVTierConfig
from kvtier.core.store import TieredStore
from kvtier.doctor import allocation, diagnose, measure, parse_metrics
from kvtier.doctor.faults import LocalFaults, fault_checks
from kvtier.doctor.meters import SharedTier
from kvtier.integrations.vllm.scheduler.remote import RemoteLookups
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats, store_counters, store_gauges
from tests.core.helpers import CHUNK_BYTES, CHUNK_TOKENS, NS, chain_of, payload

from .test_doctor import AFTER, BEFORE, doctor


class Server:
    """One engine as /metrics shows it: a worker rank's store and the scheduler's lookups on a shared
    tier (``settings``: its keys), exported through the connector's KVTierPromMetrics; ``series``:
    the prefixes of the lines :meth:`metrics` keeps."""

    def __init__(self, settings: dict[str, object], series: tuple[str, ...] = ("kvtier_shared_", "kvtier_redis_")) -> None:
        config = KVTierConfig.from_dict({"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 64 * CHUNK_BYTES / 2**30,
                                         "shared_deadline_s": 2.0, **settings})
        self.series = series
        namespace = dataclasses.replace(NS, tp_size=1, tp_rank=0)
        self.store = TieredStore(config, namespace, CHUNK_BYTES, 1)
        self.lookups = RemoteLookups(config)
        assert self.lookups.bind([namespace.digest()])
        self.registry = CollectorRegistry()
        types_ = {cls: functools.partial(cls, registry=self.registry) for cls in (Counter, Gauge, Histogram)}
        self.prom = KVTierPromMetrics(types.SimpleNamespace(kv_transfer_config=None), types_,  # type: ignore[arg-type]
                                      ["model_name", "engine"], {0: ["tiny", "0"]})
        self._seen = None
        self._asked: dict[str, int] = {}

    def save(self, chain) -> None:
        self.store.put(chain, [payload(k) for k in chain])
        self.store.flush(10)

    def ask(self, req_id: str, chain) -> int:
        """Chunks of ``chain`` the shared tier holds, asked as the scheduler asks (``poll_pages``, once a step)."""
        end = time.monotonic() + 10
        while (found := self.lookups.poll_pages(req_id, chain)) is None:
            assert time.monotonic() < end
            time.sleep(0.01)
        return len(found)

    def metrics(self) -> str:
        """A step's stats, as the worker and the scheduler report them, then the scrape's shared-tier lines."""
        snapshot = self.store.stats()
        totals = self.lookups.counters()
        counters = {**store_counters(snapshot, self._seen),
                    **{k: v - self._asked.get(k, 0) for k, v in totals.items()}}
        self._seen, self._asked = snapshot, totals
        stats = KVTierStats(data={"counters": counters, "gauges": {**store_gauges(snapshot),
                                                                    "shared_lookups_pending": self.lookups.pending}})
        self.prom.observe(stats.data, 0)
        text = generate_latest(self.registry).decode()
        return "".join(line + "\n" for line in text.splitlines()
                       if any(name in line for name in self.series))

    def read_back(self, chain) -> None:
        """Drop the top tier and read ``chain`` again: it comes back from the shared tier."""
        self.store.clear([self.store.cpu.name])
        assert len(self.store.get(chain)) == len(chain)

    def close(self) -> None:
        self.lookups.close()
        self.store.close()


def test_doctor_reports_the_shared_tier_and_an_open_breaker(redis_factory, key_prefix, tmp_path):
    server = redis_factory()
    engine = Server({"redis_url": server.url, "redis_key_prefix": key_prefix, "redis_timeout_s": 2.0,
                     "redis_breaker_probe_s": 600.0})
    try:
        engine.save(chain_of(40, 4))
        before = BEFORE + engine.metrics()
        assert engine.ask("hit", chain_of(40, 4)) == 4
        assert engine.ask("miss", chain_of(41, 2)) == 0
        healthy = AFTER + engine.metrics()
        meters = measure(parse_metrics(before, "before"), parse_metrics(healthy, "after"), 10.0)
        assert meters.shared is not None
        assert (meters.shared.lookup_chunks, meters.shared.hit_chunks) == (6, 4)
        assert meters.shared.breaker == "closed" and meters.shared.skipped_writes == 0
        diagnosis = diagnose(meters, allocation(parse_metrics(healthy, "a")), {}, None, 1)
        assert diagnosis.verdict == "healthy"
        assert any(c.level == "ok" and "hit rate 66.7% (4 / 6 chunks asked)" in c.message for c in diagnosis.checks)

        server.kill9()  # the shared tier dies while traffic flows: writes fail, the breaker opens
        for i in range(4):
            engine.save(chain_of(50 + i, 2))
        assert engine.ask("after-kill", chain_of(40, 4)) == 0
        broken = AFTER + engine.metrics()
        files = []
        for name, text in (("before", healthy), ("after", broken)):
            files.append(tmp_path / f"{name}.txt")
            files[-1].write_text(text)
        proc = doctor("--from-files", *map(str, files), "--json")
        assert proc.returncode == 1, proc.stderr  # "problem"
        report = json.loads(proc.stdout)
        assert report["verdict"] == "problem"
        shared = report["shared_tier"]
        assert shared["breaker"] == "open" and shared["breaker_state"] == 2
        assert shared["skipped_writes"] == engine.store.stats().tier("redis").wire.skipped_writes > 0
        assert shared["errors"] >= 3  # redis_breaker_failures failed calls opened it
        assert (shared["lookup_chunks"], shared["hit_chunks"]) == (4, 0)
        assert any(c["level"] == "problem" and "circuit breaker open" in c["message"] for c in report["checks"])
        text = doctor("--from-files", *map(str, files))
        assert "shared tier (redis)" in text.stdout and "breaker open" in text.stdout
        assert "verdict: problem" in text.stdout
    finally:
        engine.close()


def test_no_shared_tier_no_shared_lines():
    meters = measure(parse_metrics(BEFORE, "b"), parse_metrics(AFTER, "a"), 10.0)
    assert meters.shared is None
    assert not any("Shared tier" in c.message for c in diagnose(meters, allocation(parse_metrics(AFTER, "a")),
                                                                 {}, None, 1).checks)


def _unset_breaker_families() -> str:
    """The exposition of a server whose engines configure no shared tier: every registered shared
    tier's breaker gauge is declared (HELP, TYPE) but, labelled and never set, has no sample
    (prometheus_client's own text, as KVTierPromMetrics builds those gauges)."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    for tier in ("redis", "s3"):
        Gauge(f"kvtier_{tier}_breaker_state", "Shared-tier circuit breaker.", ["engine", "model_name"],
              registry=registry)
    text = generate_latest(registry).decode()
    assert "kvtier_redis_breaker_state" in text and "kvtier_redis_breaker_state{" not in text
    return text


def test_a_shared_tier_not_configured_is_not_reported_ok():
    """Fixes "doctor prints 'ok Shared tier (redis)' and '(s3)' when neither is configured"."""
    declared = _unset_breaker_families()
    before, after = parse_metrics(BEFORE + declared, "b"), parse_metrics(AFTER + declared, "a")
    meters = measure(before, after, 10.0)
    assert meters.shared is None and meters.shared_tiers == ()
    assert not any("Shared tier" in c.message for c in diagnose(meters, allocation(after), {}, None, 1).checks)
    # a configured one (its gauge set, closed) is still reported
    configured = declared.replace("# TYPE kvtier_redis_breaker_state gauge\n",
                                  '# TYPE kvtier_redis_breaker_state gauge\n'
                                  'kvtier_redis_breaker_state{engine="0",model_name="m"} 0.0\n')
    meters = measure(parse_metrics(BEFORE + configured, "b"), parse_metrics(AFTER + configured, "a"), 10.0)
    assert [t.tier for t in meters.shared_tiers] == ["redis"]
    assert any(c.message.startswith("Shared tier (redis): breaker closed")
               for c in diagnose(meters, allocation(parse_metrics(AFTER, "a")), {}, None, 1).checks)


def test_saves_dropped_while_redis_refuses_the_password_blame_redis_not_cpu_gib(redis_factory, key_prefix,
                                                                                 monkeypatch):
    """Fault-injection finding: Redis restarted with another password (the breaker opens on
    AuthenticationError); the saves dropped with it were put down to the cpu tier ("raise cpu_gib")
    and the breaker line did not name the password as a cause."""
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "pw1")
    server = redis_factory(extra=("--requirepass", "pw1"))
    engine = Server({"redis_url": server.url, "redis_password_env": "KVTIER_REDIS_PASSWORD",
                     "redis_key_prefix": key_prefix, "redis_timeout_s": 2.0, "redis_breaker_probe_s": 600.0,
                     "write_mode": "write-through"},
                    series=("kvtier_shared_", "kvtier_redis_", "kvtier_dropped_saves"))
    try:
        engine.save(chain_of(60, 4))
        healthy = AFTER + engine.metrics()
        assert engine.store.stats().dropped_saves == 0
        server.kill9()
        redis_factory(port=server.port, extra=("--requirepass", "pw2"))  # same server, another password
        for i in range(5):
            engine.save(chain_of(70 + i, 2))
        stats = engine.store.stats()
        skipped = stats.tier("redis").wire.skipped_writes
        assert skipped == stats.dropped_saves == 10  # every chunk saved after the restart, none written
        broken = AFTER + engine.metrics()
        meters = measure(parse_metrics(healthy, "before"), parse_metrics(broken, "after"), 10.0)
        assert meters.faults is not None and meters.faults.dropped_saves == 10 and meters.faults.write_errors == {}
        assert meters.shared is not None and meters.shared.breaker == "open"
        checks = diagnose(meters, allocation(parse_metrics(broken, "a")), {}, None, 1).checks
        saves = [c for c in checks if c.message.startswith("Saves:")]
        assert len(saves) == 1 and saves[0].level == "warning"
        assert saves[0].message.startswith("Saves: 10 chunk saves dropped between the scrapes with no failed local "
                                           "write, while the shared tier could not take them (redis: 10 writes "
                                           "skipped")
        assert "breaker open" in saves[0].message and "raise cpu_gib" not in saves[0].message
        breaker = next(c for c in checks if c.level == "problem" and "circuit breaker open" in c.message)
        assert "a changed Redis password" in breaker.message and "AuthenticationError" in breaker.message
        assert "kvtier check" in breaker.message and "engine log" in breaker.message
    finally:
        engine.close()


def test_dropped_saves_beyond_the_shared_tiers_skipped_writes_still_name_the_top_tier():
    """The shared tier accounts for its skipped writes only; the rest of the drops are room or queues."""
    down = SharedTier(0, 0, 0, 0, errors=2, skipped_calls=30, skipped_writes=30, breaker_state=2, tier="redis")
    line = fault_checks(LocalFaults({}, 45.0, 0.0), (down,))
    assert len(line) == 1 and "redis: 30 writes skipped, 2 failed calls, breaker open" in line[0][1]
    assert line[0][1].endswith("; the other 15 found no room in the top tier or a full write queue: raise cpu_gib, "
                               "or save_queue_depth and io_threads (the miss reasons name the tier).")
    # a shared tier that skipped nothing explains nothing: the drops are the top tier's
    idle = dataclasses.replace(down, skipped_writes=0, errors=0, breaker_state=0)
    assert fault_checks(LocalFaults({}, 45.0, 0.0), (idle,))[0][1].startswith("Saves: 45 chunk saves dropped between "
                                                                             "the scrapes with no failed write: no room")
    # failed local writes are named first, whatever the shared tier did
    assert fault_checks(LocalFaults({"disk": 45.0}, 45.0, 0.0), (down,))[0][0] == "problem"
