"""How long a live store keeps a chunk that ``kvtier purge`` removed in its index (docs/purge.md).

A store with a real disk tier rescans its directory every ``disk_rescan_s`` seconds (the vLLM
engine's default, 2 s); the scheduler's mirror learns what its change feed says one engine step
later.  Each trial saves 8 chunks of salt B, drops them from the cpu tier (so only the disk holds
them), purges salt B with the library at a different point of the rescan cycle, and polls the
change feed every 10 ms until it has reported all 8 gone.

    python scripts/purge_bound.py --rescan-s 2 --trials 8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.keys import Namespace, chunk_keys, request_root
from kvtier.core.purge import PurgeSelector, purge
from kvtier.core.store import TieredStore
from kvtier.core.tenant import TenantId
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.core.tiers.registry import top_tier

CHUNK_TOKENS, CHUNK_BYTES, CHUNKS = 4, 1 << 16, 8
NS = Namespace(model="purge-bound", kv_dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64,
               layout="bench", chunk_tokens=CHUNK_TOKENS)


def trial(directory: Path, rescan_s: float, phase_s: float) -> float:
    config = KVTierConfig.from_dict({"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 64 * CHUNK_BYTES / GiB,
                                     "disk_path": str(directory), "disk_gib": 64 * (CHUNK_BYTES + HEADER_BYTES) / GiB,
                                     "write_mode": "write-through", "disk_rescan_s": rescan_s})
    store = TieredStore(config, NS, CHUNK_BYTES)
    try:
        chain = chunk_keys(request_root(NS, cache_salt="B"), np.arange(CHUNKS * CHUNK_TOKENS), CHUNK_TOKENS)
        store.put(chain, [bytes(CHUNK_BYTES)] * CHUNKS, tenant=TenantId.of("B", None))
        store.flush()
        store.clear([top_tier()])
        store.drain_changes()
        time.sleep(phase_s)
        t0 = time.monotonic()
        purge(KVTierConfig.from_dict({"disk_path": str(directory)}), PurgeSelector(cache_salt="B"), dry_run=False)
        gone: set[bytes] = set()
        while len(gone) < CHUNKS and time.monotonic() - t0 < 60:
            gone |= {k for k, tier in store.drain_changes().changes if tier is None}
            time.sleep(0.01)
        return time.monotonic() - t0
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rescan-s", type=float, default=2.0)
    parser.add_argument("--trials", type=int, default=8)
    args = parser.parse_args()
    times = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as d:
            times.append(trial(Path(d), args.rescan_s, (i / args.trials) * args.rescan_s))
    print(f"disk_rescan_s {args.rescan_s:g}: purge -> change feed reports the chunks gone after "
          + ", ".join(f"{t:.2f}" for t in sorted(times)) + f" s (max {max(times):.2f} s, {args.trials} trials)")


if __name__ == "__main__":
    main()
