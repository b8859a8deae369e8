"""A disk-hit load on the CPU backend's copy path, with and without landing buffers (issue 37 item 2).

The worker's loader (:class:`kvtier.integrations.vllm.worker.side.AsyncLoader`) loads a
``--chunks``-chunk prefix that lives only on the disk tier into a host KV cache of the 24-layer
``mid`` geometry (bf16, 2 KV heads of 64, 128-token blocks = chunks: 1.5 MiB per chunk, 12 KiB of KV
per token), from ``submit`` to the load reported finished.  Arms, interleaved in one process,
order rotated each round:

- ``page``: the cpu tier has free pages: each chunk is read into a reserved cpu page (promoted)
  and copied from it into the blocks (the path with room, unchanged);
- ``private``: no page can be freed (the tier full, the eviction gate closed): each chunk is read
  into a fresh ``np.empty`` (the path before landing buffers: a landing pool of 0 buffers);
- ``landing``: the same pressure, each chunk read into a reused landing buffer
  (:mod:`kvtier.core.landing`, the default pool);
- ``copy only`` (after the arms): the copy into the blocks alone, from buffers already holding the
  chunks: what of a load is the one host copy after the read.

The chunk files sit in the page cache (written just before), so a read is a kernel copy plus the
digest: what the buffer costs shows, not the device.  Prints the median and spread per arm, the
ratio to ``private`` and ``uptime`` before and after (run it under ``flock /work/wt/engine.lock``
on a shared host).

Usage: ``python scripts/landing_bench.py [--chunks 32] [--rounds 15] [--workdir DIR]``
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.keys import Namespace, chunk_keys, request_root
from kvtier.core.landing import LandingPool
from kvtier.core.store import TieredStore
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.integrations.vllm.cache_groups import GroupKind, GroupSpec
from kvtier.integrations.vllm.protocol import LoadJob, PageMove
from kvtier.integrations.vllm.worker.copy import GroupCopiers
from kvtier.integrations.vllm.worker.layout import detect_layout
from kvtier.integrations.vllm.worker.loader import LoadPath, load_pages
from kvtier.integrations.vllm.worker.side import AsyncLoader

LAYERS, KV_HEADS, HEAD, BLOCK = 24, 2, 64, 128
ARMS = ("page", "private", "landing")


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=32, help="chunks per load (128 tokens each; default 32)")
    parser.add_argument("--rounds", type=int, default=15, help="timed loads per arm (default 15)")
    parser.add_argument("--workdir", type=Path, default=None, help="directory of the disk tier (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.chunks < 1 or args.rounds < 1:
        print("--chunks and --rounds must be positive.", file=sys.stderr)
        return 2
    n = args.chunks
    caches = {f"layers.{i}.attn": torch.zeros(2, 2 * n + 4, BLOCK, KV_HEADS, HEAD, dtype=torch.bfloat16)
              for i in range(LAYERS)}
    layout = detect_layout(caches, 2 * n + 4, "bench")
    group = GroupSpec(0, GroupKind.FULL, BLOCK, tuple(caches), page_bytes=layout.block_bytes)
    copiers = GroupCopiers((group,), BLOCK, {0: layout}, caches)
    page = copiers.page_bytes
    ns = Namespace("landing-bench", "bfloat16", LAYERS, KV_HEADS, HEAD, "bench", chunk_tokens=BLOCK)
    chain = chunk_keys(request_root(ns), list(range(n * BLOCK)), BLOCK)
    pages = tuple(PageMove(bytes(k), 0, c, 0, (n + 2 + c,)) for c, k in enumerate(chain))
    rng = np.random.default_rng(0)
    datas = [rng.integers(0, 256, page, dtype=np.uint8) for _ in range(n)]
    with tempfile.TemporaryDirectory(prefix="kvtier-landing-", dir=args.workdir) as tmp:
        def config(cpu_pages: int) -> KVTierConfig:
            return KVTierConfig(chunk_tokens=BLOCK, tiers=("cpu", "disk"), io_threads=2, disk_io="buffered",
                                cpu_gib=cpu_pages * page / GiB, disk_path=tmp, disk_gib=3 * n * (page + HEADER_BYTES) / GiB,
                                write_mode="write-through", save_queue_depth=2 * n, disk_rescan_s=0)
        first = TieredStore(config(n), ns, page)
        first.put(chain, datas)
        first.flush(120.0)
        first.close()
        room = TieredStore(config(2 * n), ns, page)  # free pages: reads promote
        tight = TieredStore(config(2), ns, page)  # two pages, filled, gate closed: no page for any read
        other = chunk_keys(request_root(ns, cache_salt="other"), list(range(2 * BLOCK)), BLOCK)
        tight.put(other, datas[:2])
        tight.gate_evictions(True)
        private, landing = LandingPool(page, 0), LandingPool.sized(page)
        stores = {"page": room, "private": tight, "landing": tight}
        loaders = {name: AsyncLoader(LoadPath(s, copiers, BLOCK, partial=True, wait_s=60.0), 2) for name, s in
                   (("room", room), ("tight", tight))}
        times: dict[str, list[float]] = {a: [] for a in ARMS}
        print(f"before: {_uptime()}")
        print(f"{n} chunks of {page / (1 << 20):.2f} MiB per load ({n * page / (1 << 20):.1f} MiB), "
              f"{args.rounds} rounds, arms interleaved")
        for r in range(args.rounds + 1):  # round 0 warms every path up, untimed
            order = ARMS[r % 3:] + ARMS[:r % 3]
            for arm in order:
                store = stores[arm]
                if arm != "page":
                    store.mover.landing = private if arm == "private" else landing
                else:
                    store.clear(["cpu"])  # read from disk again, into pages
                loader = loaders["room" if arm == "page" else "tight"]
                t0 = time.perf_counter()
                loader.submit(LoadJob(f"{arm}-{r}", pages, 0, n * BLOCK, ("disk",) * n))
                deadline = time.monotonic() + 120.0
                finished: set[str] = set()
                while f"{arm}-{r}" not in finished and time.monotonic() < deadline:
                    loader.wait_ended(0.05)
                    done, errors, _ = loader.take()
                    assert not errors, f"{arm}: blocks not filled: {sorted(errors)[:4]}"
                    finished |= done
                seconds = time.perf_counter() - t0
                assert f"{arm}-{r}" in finished, f"{arm}: the load did not end within 120 s"
                for c in (0, n - 1):  # the blocks hold the chunk's bytes
                    got = np.concatenate([caches[name][:, n + 2 + c].contiguous().view(torch.uint8).numpy().ravel()
                                          for name in caches])
                    assert got.tobytes() == datas[c].tobytes(), f"{arm}: chunk {c} differs"
                if r:
                    times[arm].append(seconds)
        copy_s = []  # the copy into the blocks alone, from buffers already holding the chunks
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            load_pages(copiers, list(zip(pages, datas)))
            copy_s.append(time.perf_counter() - t0)
        times["copy only"] = copy_s
        print(f"after:  {_uptime()}")
        base = statistics.median(times["private"])
        print(f"{'arm':<9}{'median ms':>10}{'min ms':>8}{'max ms':>8}{'GiB/s':>7}{'vs private':>11}")
        for arm, t in times.items():
            med = statistics.median(t)
            print(f"{arm:<9}{1e3 * med:>10.1f}{1e3 * min(t):>8.1f}{1e3 * max(t):>8.1f}"
                  f"{n * page / med / (1 << 30):>7.2f}{med / base:>11.2f}")
        for loader in loaders.values():
            loader.shutdown()
        room.close()
        tight.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
