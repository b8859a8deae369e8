"""What ``kvtier purge --salt`` costs on the shared tiers against a namespace-only purge, in one run
(docs/purge.md "Tenant records", docs/benchmarks.md; issue 22 item 3).

Starts a private redis-server and ``rclone serve s3`` (the test suite's servers,
tests/redis_servers.py and tests/s3_servers.py), writes ``--values`` chunks through the real
tiers (built from a config as the store builds them, behind GuardedTier), half for salt A and
half for salt B (each write given its tenant, as the store's writer thread gives it), then
times, alternating, ``--repeats`` dry runs of each purge of the namespace:

- ``namespace``: ``PurgeSelector(namespaces={ns})`` (Redis: SCAN + STRLEN/PTTL; S3: LIST + the
  ranged GET of each header it already made before the tenant record);
- ``salt``: ``PurgeSelector(namespaces={ns}, cache_salt="B")`` (Redis: + GETRANGE of the 112-byte
  header per key; S3: the same ranged GET, 112 bytes instead of 64);
- for Redis, a reference: one pipeline of whole-value ``GET`` s of every key (what reading the
  record from the payload's end, or from a value without a ranged read, would cost at least).

Then one real purge of each kind on fresh data.  Prints chunks looked at per second (median of
the repeats) and the ratio salt / namespace.

    PYTHONPATH=src:. .venv/bin/python scripts/purge_tenant_cost.py --values 1000 --chunk-kib 64 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.purge import PurgeSelector, purge
from kvtier.core.tenant import TenantId
from kvtier.core.tiers.factory import TierContext

BATCH = 50


def fill(tier: Any, num_values: int, chunk_bytes: int) -> None:
    """``num_values`` random chunks through ``tier``, alternately for salt A and salt B."""
    payload = os.urandom(chunk_bytes)
    for start in range(0, num_values, BATCH):
        for salt in ("A", "B"):
            keys = [ChunkKey(os.urandom(16)) for _ in range(start, min(start + BATCH, num_values), 2)]
            tenant = TenantId.of(salt, None)
            results = tier.put_many(keys, [payload] * len(keys), tenants=[tenant] * len(keys))
            assert all(r.stored for r in results), results


def timed(config: KVTierConfig, selector: PurgeSelector, dry_run: bool) -> tuple[float, int, int]:
    """Seconds, chunks matched and chunks of an unknown tenant of one purge."""
    t0 = time.perf_counter()
    results = purge(config, selector, dry_run)
    seconds = time.perf_counter() - t0
    assert not any(r.problems for r in results), [r.problems for r in results]
    return seconds, sum(r.chunks for r in results), sum(r.unknown_tenant for r in results)


def measure(name: str, config: KVTierConfig, make_tier: Any, args: argparse.Namespace,
            whole_get: Any = None) -> None:
    chunk_bytes = args.chunk_kib << 10
    namespace = os.urandom(16)
    tier = make_tier(config, namespace)
    try:
        fill(tier, args.values, chunk_bytes)
    finally:
        tier.close()
    by_ns = PurgeSelector(namespaces=frozenset({namespace}))
    by_salt = PurgeSelector(namespaces=frozenset({namespace}), cache_salt="B")
    times: dict[str, list[float]] = {"namespace": [], "salt": [], "whole GET": []}
    for _ in range(args.repeats):
        seconds, matched, _ = timed(config, by_ns, True)
        assert matched == args.values, matched
        times["namespace"].append(seconds)
        seconds, matched, unknown = timed(config, by_salt, True)
        assert (matched, unknown) == (args.values // 2, 0), (matched, unknown)
        times["salt"].append(seconds)
        if whole_get is not None:
            times["whole GET"].append(whole_get(namespace))
    rate = {k: args.values / statistics.median(v) for k, v in times.items() if v}
    print(f"{name}: {args.values} values of {args.chunk_kib} KiB, dry runs, median of {args.repeats}")
    for kind, value in rate.items():
        print(f"  {kind:10s} {value:10,.0f} chunks/s  ({statistics.median(times[kind]) * 1e3:7.1f} ms; "
              f"{value / rate['namespace']:.2f} x namespace)")
    for kind, selector, expect in (("namespace", by_ns, args.values), ("salt", by_salt, args.values // 2)):
        ns = os.urandom(16)
        tier = make_tier(config, ns)
        try:
            fill(tier, args.values, chunk_bytes)
        finally:
            tier.close()
        selector = PurgeSelector(namespaces=frozenset({ns}), cache_salt=selector.cache_salt)
        seconds, matched, _ = timed(config, selector, False)
        assert matched == expect, matched
        print(f"  real {kind:9s} purge: removed {matched} of {args.values} in {seconds * 1e3:7.1f} ms "
              f"({args.values / seconds:,.0f} chunks/s looked at)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=1000)
    parser.add_argument("--chunk-kib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from tests.redis_servers import RedisServer
    from tests.s3_servers import S3Server

    from kvtier.core.tiers.redis import factory as redis_factory
    from kvtier.core.tiers.s3 import factory as s3_factory

    deadlines = {"shared_deadline_s": 30.0, "shared_transfer_deadline_s": 30.0}
    with tempfile.TemporaryDirectory(prefix="kvtier-purge-cost-") as tmp:
        server = RedisServer(Path(tmp)).start()
        s3 = S3Server(Path(tmp) / "s3")
        try:
            config = KVTierConfig.from_dict({"redis_url": server.url, "redis_timeout_s": 30.0, **deadlines})
            client = server.client()

            def whole_get(namespace: bytes) -> float:
                keys = list(client.scan_iter(match=f"kvtier:{namespace.hex()}:*", count=1000))
                t0 = time.perf_counter()
                pipe = client.pipeline(transaction=False)
                for rkey in keys:
                    pipe.get(rkey)
                got = pipe.execute()
                assert len(got) == args.values
                return time.perf_counter() - t0

            measure("redis (standalone)", config,
                    lambda c, ns: redis_factory.from_config(TierContext(c, ns, args.chunk_kib << 10, 1,
                                                                     CollectorRegistry())), args, whole_get)
            s3.start()
            bucket = s3.make_bucket()
            creds = Path(tmp) / "s3-credentials"
            creds.write_text(f"[default]\naws_access_key_id = {s3.access_key}\naws_secret_access_key = "
                             f"{s3.secret_key}\n", encoding="utf-8")
            config = KVTierConfig.from_dict({"s3_endpoint_url": s3.url, "s3_bucket": bucket, "s3_allow_http": True,
                                             "s3_credentials_file": str(creds), **deadlines})
            measure("s3 (rclone serve s3)", config,
                    lambda c, ns: s3_factory.from_config(TierContext(c, ns, args.chunk_kib << 10, 1,
                                                                  CollectorRegistry())), args)
        finally:
            server.stop()
            s3.stop()


if __name__ == "__main__":
    main()
