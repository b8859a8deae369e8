"""Store benchmark of the s3 tier: put/get throughput against the raw obstore client on the same server.

- tier ``put``: ``put_many`` of the tier as the store builds it (GuardedTier around the s3 tier):
  one whole-object ``PUT`` of header + payload per chunk with ``If-None-Match: *`` where the server
  honours that header, else a ``HEAD`` first (the tier asks the server once, before the first
  round, untimed, as a process does once), at most ``in_flight`` requests at once
  (``s3_concurrency``).  ``assume_conditional_put`` times the path of a server that honours it on
  one that does not (rclone serve s3): every key the bench writes is new, so the requests are the
  same ones such a server would get;
- tier ``get``: ``get_many``: one ``GET`` per chunk, ``in_flight`` at once, every value verified
  (XXH3-128, or the keyed BLAKE3 MAC with a shared secret) and copied into a caller buffer;
- reference: the raw obstore ``S3Store`` built with the same settings, ``put_async`` /
  ``get_async`` of the same payload bytes to the same bucket with the same number in flight, in
  the same round (the reference neither checks presence, encodes, verifies nor copies).

Each figure is the median of ``repeats`` rounds, tier and reference alternating who goes first.
Objects live under a random ``kvtier-bench-…/`` prefix and are deleted after each round.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import uuid
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from kvtier.bench.storebench import MiB, StoreBenchResult, _chunks, _rate, _timed
from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import GetResult, PutResult, TierContext
from kvtier.core.tiers.s3 import factory as s3_factory
from kvtier.core.tiers.s3 import tier as s3_tier
from kvtier.core.tiers.s3.client import make_store
from kvtier.core.tiers.s3.settings import s3_settings
from kvtier.core.tiers.wrappers import unwrap


def bench_s3(settings: dict[str, Any], chunk_mib: float, total_mib: float, repeats: int, in_flight: int,
             shared_secret: str | None = None, assume_conditional_put: bool = False
             ) -> tuple[list[StoreBenchResult], str]:
    """s3-tier put/get vs raw obstore put/get, ``total_mib`` MiB per round, ``in_flight`` requests at once.

    Args:
        settings: the s3 tier's keys (``s3_bucket``, ``s3_endpoint_url``, ...).
        assume_conditional_put: time puts without a ``HEAD`` whatever the server answered (module
            docstring).

    Returns:
        the rows (put, get) and how the tier's puts went, in words: one ``PUT`` per chunk (the
        server honours ``If-None-Match: *``, or ``assume_conditional_put``) or a ``HEAD`` then a
        ``PUT``.

    Raises:
        ConfigError: bad settings or unreadable credentials.
        RuntimeError: the server refused or lost an object during the run.
    """
    import obstore

    chunk_bytes = int(chunk_mib * MiB)
    num = max(2, int(total_mib / chunk_mib))
    nbytes = num * chunk_bytes
    prefix = f"kvtier-bench-{uuid.uuid4().hex[:8]}/"
    values: dict[str, Any] = {**settings, "s3_key_prefix": prefix, "s3_concurrency": in_flight,
                              "shared_deadline_s": 60.0, "shared_transfer_deadline_s": 600.0,
                              "s3_timeout_s": 600.0, "io_threads": 1}
    if shared_secret:
        values["shared_secret"] = shared_secret
    config = KVTierConfig.from_dict(values)
    tier = s3_factory.from_config(TierContext(config, os.urandom(16), chunk_bytes, 1, CollectorRegistry()))
    assert tier is not None
    raw = make_store(s3_settings(config), 600.0)
    inner = unwrap(tier)
    assert isinstance(inner, s3_tier.S3Tier)
    if assume_conditional_put:
        inner.conditional_honoured = True
        write_path = "one PUT per chunk, no HEAD (--s3-assume-conditional-put)"
    else:  # the one question a process asks the server, before any timing
        write_path = ("one PUT per chunk, no HEAD (the server honours If-None-Match: *)" if inner.ask_conditional()
                      else "a HEAD then a PUT per chunk (the server ignores If-None-Match: *)")
    datas = _chunks(num, chunk_bytes, seed=3)
    dsts = [np.empty(chunk_bytes, dtype=np.uint8) for _ in range(num)]
    for d, s in zip(dsts, datas):  # fault the destination pages in before any timing
        np.copyto(d, s)
    times: dict[str, list[float]] = {"tier_put": [], "raw_put": [], "tier_get": [], "raw_get": []}

    async def raw_each(fn: Any, items: list[Any]) -> None:
        gate = asyncio.Semaphore(in_flight)

        async def one(item: Any) -> None:
            async with gate:
                await fn(item)
        await asyncio.gather(*(one(i) for i in items))

    try:
        for r in range(repeats):
            keys = [ChunkKey(os.urandom(16)) for _ in range(num)]
            raw_paths = [f"{prefix}raw/{r}/{i}" for i in range(num)]

            def tier_put() -> None:
                if tier.put_many(keys, [d.data for d in datas]) != [PutResult.STORED] * num:
                    raise RuntimeError("the s3 tier did not store every chunk (server unreachable or refusing?)")

            def raw_put() -> None:
                async def put(i: int) -> None:
                    await obstore.put_async(raw, raw_paths[i], datas[i], use_multipart=False)
                asyncio.run(raw_each(put, list(range(num))))

            def tier_get() -> None:
                if tier.get_many(keys, [d.data for d in dsts]) != [GetResult.HIT] * num:
                    raise RuntimeError("the s3 tier lost a chunk during the benchmark")

            def raw_get() -> None:
                async def get(path: str) -> None:
                    got = await obstore.get_async(raw, path)
                    await got.bytes_async()
                asyncio.run(raw_each(get, raw_paths))

            pairs = [("raw_put", raw_put), ("tier_put", tier_put), ("raw_get", raw_get), ("tier_get", tier_get)]
            if r % 2:
                pairs = [pairs[1], pairs[0], pairs[3], pairs[2]]
            for name, fn in pairs:
                times[name].append(_timed(fn))
            if not np.array_equal(dsts[-1], datas[-1]):
                raise RuntimeError("the s3 tier returned wrong bytes")
            obstore.delete(raw, [inner.object_key(k) for k in keys] + raw_paths)
    finally:
        tier.close()
    rows = []
    for op in ("put", "get"):
        rate = _rate(nbytes, statistics.median(times[f"tier_{op}"]))
        ref = _rate(nbytes, statistics.median(times[f"raw_{op}"]))
        rounds = [raw_s / tier_s for tier_s, raw_s in zip(times[f"tier_{op}"], times[f"raw_{op}"])]
        rows.append(StoreBenchResult("s3", op, chunk_mib, rate, ref, rate / ref, io="network", threads=in_flight,
                                     ratio_min=min(rounds), ratio_max=max(rounds)))
    return rows, write_path
