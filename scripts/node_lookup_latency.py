"""How long the scheduler waits for a node-pool presence lookup under CPU load (issue 38, the fleet day).

Starts its own ``kvtier node serve`` (a small pool in /dev/shm, so the writers evict), then:

- ``--busy N`` processes that only burn CPU (pure Python loops), as the fleet day's vLLM processes
  keep the host's cores busy;
- ``--writers N`` worker-like processes, each with its own node tier (``make_tier``, as an engine's
  store builds it) writing batches of ``--put-batch`` chunks of ``--chunk-mib`` MiB (new keys each
  time, so the owner allocates and evicts) and reading back the last batch;
- in this process, the scheduler's side: :class:`~kvtier.integrations.vllm.scheduler.remote.RemoteLookups`
  (the scheduler's own node tier, made as it makes it) asked for ``--keys`` keys (half of them in
  the pool) every ``--interval-ms``, polled as the scheduler polls each step (here in a loop that
  only yields the GIL, as a busy engine core does).

Per lookup, the time from the first poll to the answer, and how many lookups ``RemoteLookups``
counted past ``shared_deadline_s`` (``--deadline-s``, default 0.25 s as the config's): a timed-out
lookup is a miss (receipts: ``deadline/node``).  Prints p50/p90/p99/max, first quiet (no busy
processes, no writers) then under load.  Usage::

    python scripts/node_lookup_latency.py [--busy 5] [--writers 1] [--seconds 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvtier.bench.shared_node import LocalNode, NodePool
from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.factory import TierContext, make_tier
from kvtier.integrations.vllm.scheduler.remote import RemoteLookups

MiB = 1 << 20
NAMESPACE = b"lookup-latency-n"


def burn(stop: Any) -> None:
    """Pure Python work until ``stop`` is set (a busy process)."""
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i * i


def write_loop(socket_path: str, chunk: int, batch: int, stop: Any, counts: Any) -> None:
    """A worker: put ``batch`` new chunks, read the batch back, again, until ``stop``."""
    config = KVTierConfig.from_dict({"node_socket": socket_path, "shared_transfer_deadline_s": 5.0})
    tier = make_tier("node", TierContext(config, NAMESPACE, chunk, 1, CollectorRegistry()))
    assert tier is not None
    data = np.random.default_rng(os.getpid()).integers(0, 255, size=chunk, dtype=np.uint8)
    dsts = [np.empty(chunk, dtype=np.uint8) for _ in range(batch)]
    while not stop.is_set():
        keys = [ChunkKey(os.urandom(16)) for _ in range(batch)]
        stored = tier.put_many(keys, [data.data] * batch)
        got = tier.get_many(keys, [d.data for d in dsts])
        with counts.get_lock():
            counts[0] += sum(r.name == "STORED" for r in stored)
            counts[1] += sum(r.name == "HIT" for r in got)
    tier.close()


def measure(lookups: Any, keys: list[bytes], seconds: float, interval_s: float) -> tuple[list[float], dict[str, int]]:
    """One lookup every ``interval_s`` for ``seconds``, polled as the scheduler polls (every step;
    here, in a loop that only yields the GIL): the seconds from the first poll to the answer, and
    ``RemoteLookups``' counters over them."""
    before = lookups.counters()
    lat: list[float] = []
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
        t0 = time.monotonic()
        while lookups.poll_pages(f"r{n}", keys) is None:
            time.sleep(0)
        lat.append(time.monotonic() - t0)
        lookups.forget(f"r{n}")
        time.sleep(interval_s)
    after = lookups.counters()
    return lat, {k: after[k] - before[k] for k in ("shared_lookups", "shared_lookups_timed_out",
                                                  "shared_lookup_chunks", "shared_lookup_hit_chunks")}


def report(name: str, lat: list[float], counts: dict[str, int]) -> None:
    s = sorted(lat)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))] * 1e3
    print(f"{name:11s} n={len(s):5d}  p50 {q(0.5):7.2f} ms  p90 {q(0.9):7.2f}  p99 {q(0.99):7.2f}  max "
          f"{s[-1] * 1e3:7.2f}  mean {statistics.fmean(s) * 1e3:6.2f}  timed out (past shared_deadline_s): "
          f"{counts['shared_lookups_timed_out']} of {counts['shared_lookups']}; chunks found "
          f"{counts['shared_lookup_hit_chunks']} of {counts['shared_lookup_chunks']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=5)
    parser.add_argument("--writers", type=int, default=1)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--put-batch", type=int, default=16)
    parser.add_argument("--keys", type=int, default=32)
    parser.add_argument("--node-gib", type=float, default=0.25)
    parser.add_argument("--page-kib", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--deadline-s", type=float, default=0.25, help="shared_deadline_s")
    args = parser.parse_args()
    chunk = int(args.chunk_mib * MiB)
    pool = NodePool.make(args.node_gib, page_kib=args.page_kib)
    owner = LocalNode(pool, Path(tempfile.gettempdir()) / f"node-lookup-latency-{os.getpid()}.log").start()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    counts = ctx.Array("q", 2)
    procs: list[Any] = []
    try:
        config = KVTierConfig.from_dict({"node_socket": pool.socket, "shared_deadline_s": args.deadline_s,
                                         "tiers": ["cpu", "node"]})
        writer = make_tier("node", TierContext(config, NAMESPACE, chunk, 1, CollectorRegistry()))
        assert writer is not None
        keys = [os.urandom(16) for _ in range(args.keys)]
        half = [ChunkKey(k) for k in keys[: args.keys // 2]]
        writer.put_many(half, [np.zeros(4096, dtype=np.uint8).data] * len(half))
        writer.close()
        lookups = RemoteLookups(config)  # the scheduler's (its node tier made as the scheduler makes it)
        assert lookups.bind([NAMESPACE])
        measure(lookups, keys, 0.5, 0.01)  # connected, the pool mapped
        quiet = measure(lookups, keys, min(5.0, args.seconds), args.interval_ms / 1e3)
        procs = [ctx.Process(target=burn, args=(stop,)) for _ in range(args.busy)]
        procs += [ctx.Process(target=write_loop, args=(pool.socket, chunk, args.put_batch, stop,
                                                       counts)) for _ in range(args.writers)]
        for proc in procs:
            proc.start()
        time.sleep(3.0)  # the writers connected and writing
        loads = [os.getloadavg()[0]]
        loaded = measure(lookups, keys, args.seconds, args.interval_ms / 1e3)
        loads.append(os.getloadavg()[0])
        print(f"{os.cpu_count()} CPUs, busy {args.busy}, writers {args.writers} x {args.put_batch} x "
              f"{args.chunk_mib:g} MiB, lookups of {args.keys} keys every {args.interval_ms:g} ms, load "
              f"{min(loads):.1f}-{max(loads):.1f}; chunks written {counts[0]}, read {counts[1]}")
        report("quiet", *quiet)
        report("under load", *loaded)
        lookups.close()
    finally:
        stop.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        owner.stop()
        pool.remove()


if __name__ == "__main__":
    main()
