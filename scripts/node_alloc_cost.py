"""What the node pool's owner spends per allocated value, filling a pool and then on a full pool
(every value evicts one), and on a checked ``stats`` (issue 38: the owner's one event loop must
never be held long; every engine's pins and writes wait behind it).

The owner's index (:class:`kvtier.core.tiers.node.index.PoolIndex`) over in-memory arrays of the
pool's shape (no file, no socket: the loop's own work), ``--pages`` pages, values of
``--value-pages`` pages written in batches of 512 keys, committed.  Usage::

    python scripts/node_alloc_cost.py [--pages 262144] [--value-pages 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvtier.core.tiers.node.index import PoolIndex
from kvtier.core.tiers.node.presence import META_WORDS, PresenceTable, table_slots

PAGE_BYTES = 256 << 10
BATCH = 512


def fill(index: PoolIndex, keys: list[bytes], nbytes: int) -> float:
    """Write ``keys`` (values of ``nbytes``) in batches; seconds per value."""
    t0 = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        grants = index.alloc(1, b"n" * 16, keys[i:i + BATCH], [nbytes] * len(keys[i:i + BATCH]), 0.0)
        index.commit(1, [g[0] for g in grants if isinstance(g, tuple)])
    return (time.perf_counter() - t0) / len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=262144, help="pool pages (262,144: 64 GiB of 256 KiB pages)")
    parser.add_argument("--value-pages", type=int, default=8, help="pages per value (8: a 2 MiB chunk)")
    args = parser.parse_args()
    table = PresenceTable(np.zeros(table_slots(args.pages), np.uint64), np.zeros(META_WORDS, np.uint64))
    index = PoolIndex(np.zeros(args.pages, np.uint64), np.zeros(args.pages, np.uint64), table, PAGE_BYTES, 30.0)
    index.attach(1, "bench", 0.0)
    n = args.pages // args.value_pages
    keys = [os.urandom(16) for _ in range(2 * n)]
    nbytes = args.value_pages * PAGE_BYTES
    filling = fill(index, keys[:n], nbytes)
    full = fill(index, keys[n:], nbytes)
    t0 = time.perf_counter()
    problem = index.problem()
    checked = time.perf_counter() - t0
    print(f"{args.pages} pages, {n} values of {args.value_pages} pages: filling {filling * 1e6:.0f} us per value, "
          f"full (each evicts one) {full * 1e6:.0f} us per value ({index.evictions} evictions), checked stats "
          f"{checked * 1e3:.0f} ms{', ' + problem if problem else ''}")


if __name__ == "__main__":
    main()
