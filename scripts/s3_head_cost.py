"""What the HEAD before each s3 PUT costs, in one process, rounds interleaved (issue 21).

The s3 tier writes a chunk with one conditional PUT where the server honours ``If-None-Match: *``
and with a HEAD first where it does not (:mod:`kvtier.core.tiers.s3.tier`).  ``bench-store`` runs of
two code versions one after the other on a loaded machine differ by more than the HEAD costs, so
this script times both write paths of the same tier in the same process, alternating round by
round (``conditional_honoured`` False: HEAD then PUT, the requests main sent before; True: PUT
only), with raw obstore PUTs of the same bytes between them, and a batch of HEADs alone.  Every
key is new, so the requests are the same on a server that ignores the header (rclone serve s3).

Usage: ``python -m tests.s3_servers DIR &`` prints the ``--s3-*`` flags, then
``python scripts/s3_head_cost.py FLAGS [--sizes 0.25,4,32] [--in-flight 1,16] [--rounds 9]
[--total-mib 32]``.  Prints per configuration the median seconds of each path and the medians of
the per-round ratios: seconds with HEAD over seconds without (> 1: the HEAD costs), and each
path's throughput against raw's (raw seconds over tier seconds, the ``bench-store`` ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from typing import Any

import obstore
from prometheus_client import CollectorRegistry

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import PutResult, TierContext
from kvtier.core.tiers.s3 import factory as s3_factory
from kvtier.core.tiers.s3 import tier as s3_tier
from kvtier.core.tiers.s3.client import make_store
from kvtier.core.tiers.s3.settings import s3_settings
from kvtier.core.tiers.wrappers import unwrap

MiB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--s3-bucket", required=True)
    parser.add_argument("--s3-endpoint-url", required=True)
    parser.add_argument("--s3-allow-http", action="store_true")
    parser.add_argument("--s3-credentials-file", required=True)
    parser.add_argument("--sizes", default="0.25,4,32", help="chunk sizes, MiB")
    parser.add_argument("--in-flight", default="1,16", help="requests in flight")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--total-mib", type=float, default=32.0, help="MiB written per path per round")
    args = parser.parse_args()
    settings = {"s3_bucket": args.s3_bucket, "s3_endpoint_url": args.s3_endpoint_url,
                "s3_allow_http": args.s3_allow_http, "s3_credentials_file": args.s3_credentials_file}
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| chunk MiB | in flight | HEAD+PUT s | PUT s | raw s | HEAD+PUT s / PUT s | ratio PUT only | "
          "ratio HEAD+PUT | HEADs alone, ms per chunk |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mib in (float(s) for s in args.sizes.split(",")):
        for n in (int(s) for s in args.in_flight.split(",")):
            row(settings, mib, n, args.rounds, args.total_mib)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def row(settings: dict[str, Any], mib: float, in_flight: int, rounds: int, total_mib: float) -> None:
    chunk_bytes = int(mib * MiB)
    num = max(2, int(total_mib / mib))
    prefix = f"kvtier-headcost-{uuid.uuid4().hex[:8]}/"
    config = KVTierConfig.from_dict({**settings, "s3_key_prefix": prefix, "s3_concurrency": in_flight,
                                     "shared_deadline_s": 60.0, "shared_transfer_deadline_s": 600.0,
                                     "s3_timeout_s": 600.0, "io_threads": 1})
    tier = s3_factory.from_config(TierContext(config, os.urandom(16), chunk_bytes, 1, CollectorRegistry()))
    assert tier is not None
    inner = unwrap(tier)
    assert isinstance(inner, s3_tier.S3Tier)
    raw = make_store(s3_settings(config), 600.0)
    datas = [os.urandom(chunk_bytes) for _ in range(min(num, 8))]
    payloads = [datas[i % len(datas)] for i in range(num)]
    times: dict[str, list[float]] = {"head": [], "nohead": [], "raw": [], "heads": []}

    async def each(fn: Any, items: list[Any]) -> None:
        gate = asyncio.Semaphore(in_flight)

        async def one(item: Any) -> None:
            async with gate:
                await fn(item)
        await asyncio.gather(*(one(i) for i in items))

    def tier_put(honoured: bool) -> float:
        inner.conditional_honoured = honoured
        keys = [ChunkKey(os.urandom(16)) for _ in range(num)]
        t0 = time.perf_counter()
        if tier.put_many(keys, payloads) != [PutResult.STORED] * num:
            raise RuntimeError("the s3 tier did not store every chunk")
        seconds = time.perf_counter() - t0
        obstore.delete(raw, [inner.object_key(k) for k in keys])
        return seconds

    def raw_put() -> float:
        paths = [f"{prefix}raw/{uuid.uuid4().hex}" for _ in range(num)]

        async def put(i: int) -> None:
            await obstore.put_async(raw, paths[i], payloads[i], use_multipart=False)
        t0 = time.perf_counter()
        asyncio.run(each(put, list(range(num))))
        seconds = time.perf_counter() - t0
        obstore.delete(raw, paths)
        return seconds

    def heads() -> float:
        paths = [f"{prefix}absent/{uuid.uuid4().hex}" for _ in range(num)]

        async def head(path: str) -> None:
            try:
                await obstore.head_async(raw, path)
            except FileNotFoundError:
                pass
        t0 = time.perf_counter()
        asyncio.run(each(head, paths))
        return time.perf_counter() - t0

    try:
        steps = [("head", lambda: tier_put(False)), ("nohead", lambda: tier_put(True)), ("raw", raw_put),
                 ("heads", heads)]
        for r in range(rounds):
            for name, fn in (steps if r % 2 == 0 else steps[::-1]):
                times[name].append(fn())
    finally:
        tier.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = {name: statistics.median(a / b for a, b in zip(times[x], times[y], strict=True))
             for name, (x, y) in {"h/n": ("head", "nohead"), "r/n": ("raw", "nohead"), "r/h": ("raw", "head")}.items()}
    print(f"| {mib:g} | {in_flight} | {med['head']:.3f} | {med['nohead']:.3f} | {med['raw']:.3f} | "
          f"{ratio['h/n']:.3f} | {ratio['r/n']:.3f} | {ratio['r/h']:.3f} | {1000 * med['heads'] / num:.2f} |",
          flush=True)


if __name__ == "__main__":
    main()
