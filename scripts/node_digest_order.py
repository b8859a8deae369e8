"""Which order of copy and digest a node-tier hit should take (issue 38), out of the engine.

A node-tier hit copies each chunk's payload out of the shared pool into an engine's KV blocks (one
64 KiB run per layer for vLLM's CPU backend) and checks its XXH3-128 digest.  Three ways are timed
over the same bytes, per round in a shuffled order, caches flushed (a 64 MiB write) before each:

- ``copy only``: one slice assignment per run, no digest: the cpu tier's copy of a hit (never a
  node-tier path; the reference the ratios are taken against);
- ``copy, then hash each run where it landed``: the tier's way
  (:func:`~kvtier.core.tiers.node.scatter.scatter_hashed` over a :meth:`~kvtier.core.tiers.node.scatter.Scatter.tiled`
  scatter): what is verified is what is served, 744 digest updates for a 31-chunk hit;
- ``hash the page first, then copy``: one XXH3 call over each chunk's payload in the pool, then the
  same copies (31 digest calls instead of 744).  Not the tier's way: the digest covers the pool's
  bytes, not the copy, so a write into the pages between the two (a writer whose lease expired
  while it stalled: its pages are granted again without it knowing) would be served unverified.

The pool is a file in ``/dev/shm`` (as ``kvtier node serve``'s), each payload 128 bytes into its
page (the envelope's header); the layers are 64-byte aligned, as vLLM's KV tensors are.  Prints
each way's median and its per-round ratio to ``copy only`` (median, quartiles).  Usage::

    python scripts/node_digest_order.py [--chunks 31] [--layers 24] [--run-kib 64] [--rounds 41]
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvtier.core.tiers.node.scatter import Scatter, scatter_hashed

HEADER_BYTES = 128
"""Where a payload starts in its page (the envelope's fixed header)."""


def aligned(nbytes: int, align: int = 64) -> np.ndarray:
    """A zeroed uint8 array of ``nbytes`` whose data starts on an ``align``-byte boundary."""
    raw = np.zeros(nbytes + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip:skip + nbytes]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=31)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--run-kib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=41)
    args = parser.parse_args()
    run, layers, chunks = args.run_kib << 10, args.layers, args.chunks
    page = -(-(HEADER_BYTES + layers * run) // (2 << 20)) * (2 << 20)
    pages, blocks = 2 * chunks, 4 * chunks
    caches = [aligned(blocks * run) for _ in range(layers)]
    lanes = [(memoryview(c), 0) for c in caches]  # type: ignore[arg-type]
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.truncate(pages * page)
        pool = memoryview(mmap.mmap(f.fileno(), pages * page))
        rng = np.random.default_rng(0)
        for i in range(pages):
            pool[i * page:(i + 1) * page] = rng.integers(0, 256, page, np.uint8).tobytes()
        flush = np.zeros(64 << 20, np.uint8)

        def copy_only(src: memoryview, at: int) -> None:
            scatter_hashed(None, src, Scatter.tiled(lanes, at, run))

        def where_landed(src: memoryview, at: int) -> None:
            scatter_hashed(xxhash.xxh3_128(), src, Scatter.tiled(lanes, at, run))

        def page_first(src: memoryview, at: int) -> None:
            xxhash.xxh3_128(src).digest()
            scatter_hashed(None, src, Scatter.tiled(lanes, at, run))

        ways: dict[str, Callable[[memoryview, int], None]] = {
            "copy only": copy_only, "copy, then hash each run where it landed": where_landed,
            "hash the page first, then copy": page_first}
        times: dict[str, list[float]] = {name: [] for name in ways}
        load0 = os.getloadavg()[0]
        for r in range(args.rounds):
            order = list(ways)
            random.shuffle(order)
            for name in order:
                hit = [(pool[p * page + HEADER_BYTES:p * page + HEADER_BYTES + layers * run], b * run)
                       for p, b in zip(random.sample(range(pages), chunks), random.sample(range(blocks), chunks))]
                flush[:] = r
                t0 = time.perf_counter()
                for src, at in hit:
                    ways[name](src, at)
                times[name].append(time.perf_counter() - t0)
        del pool
    print(f"{chunks} chunks of {layers} runs of {args.run_kib} KiB, {args.rounds} rounds, load "
          f"{load0:.1f}-{os.getloadavg()[0]:.1f}")
    base = times["copy only"]
    for name, ts in times.items():
        ratios = sorted(t / b for t, b in zip(ts, base))
        q = len(ratios) // 4
        print(f"{name:42s} median {statistics.median(ts) * 1e3:6.2f} ms  / copy only per round: median "
              f"{statistics.median(ratios):.2f}, quartiles {ratios[q]:.2f}-{ratios[-1 - q]:.2f}")


if __name__ == "__main__":
    main()
