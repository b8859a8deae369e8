"""kvtier doctor on a server with the s3 tier: its hit rate, read latency and breaker.

As for the redis tier (test_doctor_shared_tier.py), the series are made by the real pieces: a
worker rank's store with an s3 tier and the scheduler's :class:`RemoteLookups` talk to a real
``rclone serve s3`` (tests/s3_servers.py); their numbers go through the connector's
:class:`KVTierPromMetrics` and are added to /metrics texts recorded from a real vLLM server.  The
doctor finds the tier by its ``kvtier_s3_breaker_state`` gauge (no tier name in the doctor).
Then the server is killed: the breaker opens and the doctor says so.
"""

from __future__ import annotations

import json

import pytest

from kvtier.doctor import allocation, diagnose, measure, parse_metrics
from tests.core.helpers import chain_of

from .test_doctor import AFTER, BEFORE, doctor
from .test_doctor_shared_tier import Server


@pytest.fixture
def engine(s3_factory, monkeypatch):
    server = s3_factory()
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    bucket = server.make_bucket()
    made = Server({"s3_bucket": bucket, "s3_endpoint_url": server.url, "s3_allow_http": True,
                   "tiers": ["cpu", "s3"], "s3_timeout_s": 2.0, "s3_max_retries": 0,
                   "s3_breaker_probe_s": 600.0}, series=("kvtier_shared_", "kvtier_s3_", "kvtier_loaded_tokens"))
    yield server, made
    made.close()


def test_doctor_reports_the_s3_tier_hit_rate_latency_and_an_open_breaker(engine, tmp_path):
    server, made = engine
    made.save(chain_of(60, 4))
    before = BEFORE + made.metrics()
    assert made.ask("hit", chain_of(60, 4)) == 4
    assert made.ask("miss", chain_of(61, 2)) == 0
    made.read_back(chain_of(60, 4))  # the cpu tier dropped, the chunks come back from the bucket
    healthy = AFTER + made.metrics()
    meters = measure(parse_metrics(before, "before"), parse_metrics(healthy, "after"), 10.0)
    (tier,) = meters.shared_tiers
    assert tier.tier == "s3" and meters.shared == tier
    assert (tier.lookup_chunks, tier.hit_chunks) == (6, 4)
    assert tier.breaker == "closed" and tier.skipped_writes == 0 and tier.errors == 0
    assert tier.reads >= 1 and tier.read_latency_s is not None and tier.read_latency_s > 0
    assert tier.read_bytes == made.store.stats().tier("s3").wire.bytes["read"] > 0
    diagnosis = diagnose(meters, allocation(parse_metrics(healthy, "a")), {}, None, 1)
    assert diagnosis.verdict == "healthy"
    (ok,) = [c for c in diagnosis.checks if "Shared tier (s3)" in c.message]
    assert ok.level == "ok" and "hit rate 66.7% (4 / 6 chunks asked)" in ok.message and "read latency" in ok.message

    server.kill9()  # the bucket's server dies while traffic flows: writes fail, the breaker opens
    for i in range(4):
        made.save(chain_of(70 + i, 2))
    broken = AFTER + made.metrics()
    files = []
    for name, text in (("before", healthy), ("after", broken)):
        files.append(tmp_path / f"{name}.txt")
        files[-1].write_text(text)
    proc = doctor("--from-files", *map(str, files), "--json")
    assert proc.returncode == 1, proc.stderr  # "problem"
    report = json.loads(proc.stdout)
    s3 = report["shared_tiers"]["s3"]
    assert s3["breaker"] == "open" and s3["breaker_state"] == 2
    assert s3["skipped_writes"] > 0 and s3["errors"] >= 3  # s3_breaker_failures failed calls opened it
    assert any(c["level"] == "problem" and "Shared tier (s3): circuit breaker open" in c["message"]
               for c in report["checks"])
    text = doctor("--from-files", *map(str, files))
    assert "shared tier (s3)" in text.stdout and "breaker open" in text.stdout
