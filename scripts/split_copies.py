"""Copies a payload takes through GuardedTier: the shared tiers' own data path (``SplitTier``) vs
the wrapper's private copies, on real servers (a ``redis-server`` and ``rclone serve s3`` started
here, as the tests start them).

For each shared tier and each path, ``--chunks`` chunks of ``--chunk-mib`` MiB are written with
one ``put_many`` and read back with one ``get_many`` (after one untimed round, so reused buffers
exist), ``--repeats`` times, the two paths interleaved round by round.  Reported per op:

- ``alloc/payload``: the peak of Python-allocated bytes during the call (``tracemalloc``, every
  thread) over the payload bytes moved: a private copy of each payload shows as +1.0 (bytes
  obstore or the kernel hold are not counted: this counts kvtier's own copies).
- ``s``: median seconds of the call, and its ratio to one ``memcpy`` of the same bytes
  (``numpy.copyto``, same run): what the path costs beyond the wire, not a benchmark.

Paths: ``split`` is the tier as the store builds it (``from_config``: the bare tier directly
behind GuardedTier, which then uses its ``SplitTier`` halves); ``private`` puts a plain
``TierWrapper`` in between, so GuardedTier takes its generic path (a private buffer per read, a
private copy per write).

Usage::

    python scripts/split_copies.py [--chunk-mib 4] [--chunks 8] [--repeats 5] [--workdir /tmp/split-copies]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # kvtier, and the tests' server helpers

from tests.redis_servers import RedisServer
from tests.s3_servers import S3Server

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import TierContext
from kvtier.core.tiers.base import GetResult, PutResult, Tier
from kvtier.core.tiers.factory import make_tier
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.wrappers import TierWrapper


def measured(call: Callable[[list[ChunkKey], list[memoryview]], list[Any]], keys: list[ChunkKey],
             buffers: list[memoryview], want: object) -> tuple[float, int]:
    """Seconds ``call(keys, buffers)`` took and the peak of Python-allocated bytes meanwhile; exits
    unless every result is ``want``."""
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    results = call(keys, buffers)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] - base
    if any(r is not want for r in results):
        raise SystemExit(f"expected every result {want}, got {results}")
    return seconds, peak


def private_path(tier: GuardedTier) -> GuardedTier:
    """The same inner tier behind GuardedTier with a plain TierWrapper in between (generic path)."""
    return GuardedTier(TierWrapper(tier.inner), tier.deadline_s, tier.transfer_deadline_s, 4, 16, tier.breaker)


def run(name: str, config: KVTierConfig, chunk_bytes: int, chunks: int, repeats: int) -> list[str]:
    """Both paths over one inner tier, interleaved round by round (the order alternating), so a
    load change or a server warming up hits both alike."""
    built = make_tier(name, TierContext(config, os.urandom(16), chunk_bytes, 1, CollectorRegistry()))
    assert isinstance(built, GuardedTier)
    tiers: dict[str, Tier] = {"split": built, "private": private_path(built)}
    datas = [np.random.default_rng(i).integers(0, 256, chunk_bytes, dtype=np.uint8) for i in range(chunks)]
    dsts = [np.empty(chunk_bytes, dtype=np.uint8) for _ in range(chunks)]
    memcpy_src = np.random.default_rng(0).integers(0, 256, chunk_bytes * chunks, dtype=np.uint8)
    memcpy_dst = np.empty_like(memcpy_src)
    got: dict[tuple[str, str], list[tuple[float, int]]] = {(p, op): [] for p in tiers for op in ("put", "get")}
    copy_s = []
    try:
        for r in range(repeats + 1):
            for path in (("split", "private") if r % 2 else ("private", "split")):
                tier = tiers[path]
                keys = [ChunkKey(os.urandom(16)) for _ in range(chunks)]
                put = measured(tier.put_many, keys, [memoryview(d) for d in datas], PutResult.STORED)
                get = measured(tier.get_many, keys, [memoryview(d) for d in dsts], GetResult.HIT)
                assert all(np.array_equal(a, b) for a, b in zip(datas, dsts, strict=True))
                if r:  # the first round warms buffers and connections
                    got[path, "put"].append(put)
                    got[path, "get"].append(get)
            t0 = time.perf_counter()
            np.copyto(memcpy_dst, memcpy_src)
            copy_s.append(time.perf_counter() - t0)
    finally:
        tiers["private"].close()  # closes the inner tier too
    memcpy = statistics.median(copy_s)
    rows = []
    for (path, op), samples in got.items():
        seconds = statistics.median(s for s, _ in samples)
        alloc = statistics.median(a for _, a in samples) / (chunk_bytes * chunks)
        rows.append(f"| {name} | {path} | {op} | {alloc:.2f} | {seconds:.4f} | {seconds / memcpy:.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--codecs", default="", help="a codec chain for both tiers, comma-separated (issue 36), "
                        "e.g. aes-256-gcm; encrypting chains get a master key made for the run")
    args = parser.parse_args()
    chain = [c.strip() for c in args.codecs.split(",") if c.strip()]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="split-copies-"))
    workdir.mkdir(parents=True, exist_ok=True)
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    redis_server = RedisServer(workdir).start()
    s3_server = S3Server(workdir / "s3").start()
    tracemalloc.start()
    try:
        creds = workdir / "s3-credentials"
        creds.write_text(f"[default]\naws_access_key_id = {s3_server.access_key}\n"
                         f"aws_secret_access_key = {s3_server.secret_key}\n", encoding="utf-8")
        deadlines: dict[str, Any] = {"shared_deadline_s": 10.0, "shared_transfer_deadline_s": 60.0}
        if chain:
            (workdir / "master-key").write_text(os.urandom(32).hex(), encoding="utf-8")
            deadlines.update(codecs={"redis": chain, "s3": chain},
                             encryption={"master_key_file": str(workdir / "master-key")})
        configs = {
            "redis": KVTierConfig.from_dict({"redis_url": redis_server.url, **deadlines}),
            "s3": KVTierConfig.from_dict({"s3_endpoint_url": s3_server.url, "s3_bucket": s3_server.make_bucket(),
                                          "s3_allow_http": True, "s3_credentials_file": str(creds), **deadlines}),
        }
        print(f"{args.chunks} chunks of {args.chunk_mib:g} MiB per call, median of {args.repeats}, codecs "
              f"{','.join(chain) or 'identity'}")
        print("| tier | path | op | alloc/payload | s | s / memcpy |")
        print("|---|---|---|---|---|---|")
        for name, config in configs.items():
            for row in run(name, config, chunk_bytes, args.chunks, args.repeats):
                print(row, flush=True)
    finally:
        tracemalloc.stop()
        redis_server.stop()
        s3_server.stop()


if __name__ == "__main__":
    main()
