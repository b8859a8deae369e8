"""Store benchmark of the redis tier: put/get throughput against raw redis-py on the same server.

- tier ``put``: ``put_many`` of the tier as the store builds it (``GuardedTier`` around ``RedisTier``,
  through its ``SplitTier`` ``stream_put``) — one value per chunk (the value envelope's 128-byte header, with the tenant record, + XXH3-128 over
  header and payload, or a keyed BLAKE3 MAC with ``--shared-secret``), ``SET … EX … NX``
  pipelined on one connection, the payload sent from the caller's buffer;
- tier ``get``: ``get_many`` of the same (its ``SplitTier`` ``fetch_many``/``finish_get``) — one pipelined batch of ``GET`` (replies received straight
  into reused buffers), every value verified and copied into a caller buffer (what a load into the
  cpu tier does);
- reference: raw redis-py pipelined ``SET key bytes EX ttl`` / ``GET key`` of the same payload
  bytes to the same server through a client with the same settings, in the same round (the
  reference's ``GET`` only receives the bytes: it neither verifies nor copies them).

Each figure is the median of ``repeats`` rounds, tier and reference alternating who goes first.
Keys live under a random ``kvtier-bench-…:`` prefix and are deleted after each round.
"""

from __future__ import annotations

import os
import statistics
import uuid
from collections.abc import Mapping

import numpy as np
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from kvtier.bench.storebench import MiB, StoreBenchResult, _chunks, _rate, _timed
from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import GetResult, PutResult, TierContext
from kvtier.core.tiers.redis import factory as redis_factory
from kvtier.core.tiers.redis.client import make_client
from kvtier.core.tiers.redis.settings import redis_settings


def bench_redis(url: str, chunk_mib: float, total_mib: float, repeats: int, cluster: bool = False,
                shared_secret: str | None = None, auth: Mapping[str, object] | None = None) -> list[StoreBenchResult]:
    """redis-tier put/get vs raw pipelined SET/GET, ``total_mib`` MiB per round; ``auth``: more of the
    tier's keys for reaching the server (``redis_password_env``, ``redis_password_file``,
    ``redis_tls_ca_file``), used by the tier and the raw client alike.

    Raises:
        ConfigError: bad URL or unreachable Cluster seed.
        RuntimeError: the server did not answer (nothing listening, a wrong password: redis-py's
            ``RedisError``, named in the message), or refused or lost a chunk during the run
            (``maxmemory`` too small for ``total_mib``).
    """
    chunk_bytes = int(chunk_mib * MiB)
    num = max(2, int(total_mib / chunk_mib))
    nbytes = num * chunk_bytes
    prefix = f"kvtier-bench-{uuid.uuid4().hex[:8]}:"
    settings: dict[str, object] = {"redis_url": url, "redis_cluster": cluster, "redis_key_prefix": prefix,
                                   "shared_deadline_s": 60.0, "shared_transfer_deadline_s": 600.0, "redis_timeout_s": 60.0, "redis_ttl_s": 3600}
    if shared_secret:
        settings["shared_secret"] = shared_secret
    config = KVTierConfig.from_dict({**settings, **(auth or {})})
    tier = redis_factory.from_config(TierContext(config, os.urandom(16), chunk_bytes, 1, CollectorRegistry()))
    assert tier is not None
    raw = make_client(redis_settings(config))
    datas = _chunks(num, chunk_bytes, seed=2)
    dsts = [np.empty(chunk_bytes, dtype=np.uint8) for _ in range(num)]
    for d, s in zip(dsts, datas):  # fault the destination pages in before any timing
        np.copyto(d, s)
    times: dict[str, list[float]] = {"tier_put": [], "raw_put": [], "tier_get": [], "raw_get": []}
    try:
        raw.ping()  # an unreachable server is one sentence before any round, not a redis-py traceback
        for r in range(repeats):
            keys = [ChunkKey(os.urandom(16)) for _ in range(num)]
            raw_keys = [f"{prefix}raw:{r}:{i}".encode() for i in range(num)]

            def tier_put() -> None:
                if tier.put_many(keys, [d.data for d in datas]) != [PutResult.STORED] * num:
                    raise RuntimeError("the redis tier did not store every chunk (server unreachable or full?)")

            def raw_put() -> None:
                pipe = raw.pipeline(transaction=False)
                for k, d in zip(raw_keys, datas):
                    pipe.set(k, d.data, ex=3600)
                pipe.execute()

            def tier_get() -> None:
                if tier.get_many(keys, [d.data for d in dsts]) != [GetResult.HIT] * num:
                    raise RuntimeError("the redis tier lost a chunk during the benchmark (maxmemory too small?)")

            def raw_get() -> None:
                pipe = raw.pipeline(transaction=False)
                for k in raw_keys:
                    pipe.get(k)
                if any(v is None for v in pipe.execute()):
                    raise RuntimeError("the server lost a reference value during the benchmark")

            pairs = [("raw_put", raw_put), ("tier_put", tier_put), ("raw_get", raw_get), ("tier_get", tier_get)]
            if r % 2:
                pairs = [pairs[1], pairs[0], pairs[3], pairs[2]]
            for name, fn in pairs:
                times[name].append(_timed(fn))
            if not np.array_equal(dsts[-1], datas[-1]):
                raise RuntimeError("the redis tier returned wrong bytes")
            _delete(raw, [tier.rkey(k) for k in keys] + raw_keys)
    except RedisError as exc:
        raise RuntimeError(f"the server did not answer ({type(exc).__name__}: {exc})") from None
    finally:
        tier.close()
        raw.close()
    rows = []
    for op in ("put", "get"):
        rate = _rate(nbytes, statistics.median(times[f"tier_{op}"]))
        ref = _rate(nbytes, statistics.median(times[f"raw_{op}"]))
        rounds = [raw_s / tier_s for tier_s, raw_s in zip(times[f"tier_{op}"], times[f"raw_{op}"])]
        rows.append(StoreBenchResult("redis", op, chunk_mib, rate, ref, rate / ref, io="network", threads=1,
                                     ratio_min=min(rounds), ratio_max=max(rounds)))
    return rows


def _delete(client: object, rkeys: list[bytes]) -> None:
    pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]
    for rk in rkeys:  # one DEL per key: a multi-key DEL fails across Cluster slots
        pipe.delete(rk)
    pipe.execute()
