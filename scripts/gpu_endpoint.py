"""The device endpoint in ``scripts/gpu_check.py --mode runner`` (issue 37 item 2): chunks read from
the disk tier with no cpu page free land in the store's landing buffers
(:mod:`kvtier.core.landing`, registered as pinned memory on CUDA) and go from there straight into
the engine's blocks.

Over the runner's caches and copiers (:mod:`gpu_runner`) it builds a second store, cpu over disk,
writes the loaded chunks to its disk tier, fills its cpu tier with other chunks and closes the
eviction gate (so no read gets a page, as under pressure), then:

- **endpoint GiB/s**: the loader's copy (``loader.load_pages``, what ``AsyncLoader``'s loads call) from
  landing buffers holding the chunks into the target blocks, best of the repeats, on a
  synchronized device; compared with a plain pinned ``copy_`` of the same bytes (gpu_runner);
- **disk+copy GiB/s**: a whole asynchronous load through :class:`AsyncLoader` (disk read into the
  landing buffers, verify, copy) from submit to ``finished_recving``;
- **bounced runs**: host runs the batched CUDA path staged through its bounce buffer during those
  loads (0: every copy went straight from the buffer the read landed in);
- **equal**: every loaded block equals its saved block, after every load; every chunk was read
  from disk, none promoted, and each one's bytes are in a landing buffer afterwards.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.landing import LandingPool
from kvtier.core.pinned import is_pinned
from kvtier.core.store import TieredStore
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.integrations.vllm.protocol import LoadJob, PageMove
from kvtier.integrations.vllm.worker.loader import LoadPath, load_pages
from kvtier.integrations.vllm.worker.side import AsyncLoader

GiB = float(1 << 30)
LOAD_WAIT_S = 60.0  # longest one load may take before the check calls it failed


@dataclass(frozen=True)
class EndpointResult:
    copy_s: float  # best seconds of the copy from landing buffers into the blocks
    load_s: float  # best seconds of a whole asynchronous disk load (read + verify + copy)
    disk_chunks: int  # chunks the loads read from disk (all of them, every repeat)
    promoted: int  # loaded chunks found in the cpu tier afterwards (0: none took a page)
    pinned: bool  # the landing buffers are registered pinned memory (CUDA)
    bounced_runs: int  # host runs staged through the batched path's bounce buffer (CUDA)
    equal: bool


def measure_endpoint(runner: object, loads: tuple[PageMove, ...], zero: Callable[[], None],
                     equal: Callable[[], bool], repeats: int, sync: Callable[[], None]) -> EndpointResult:
    """Measure the device endpoint over ``runner``'s copiers (see the module docstring);
    ``loads``: the pages to load, whose chunks are in ``runner.store``'s cpu tier."""
    store: TieredStore = runner.store  # type: ignore[attr-defined]
    copiers = runner.copiers  # type: ignore[attr-defined]
    chunk_tokens: int = runner.chunk_tokens  # type: ignore[attr-defined]
    n, page_bytes = len(loads), copiers.page_bytes
    datas = [store.cpu.view(ChunkKey(p.key)).copy() for p in loads]
    keys = [ChunkKey(p.key) for p in loads]
    cuda = next(iter(copiers.copiers.values())).device.type == "cuda"
    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-endpoint-") as tmp:
        config = KVTierConfig(chunk_tokens=chunk_tokens, tiers=("cpu", "disk"), io_threads=2, disk_io="buffered",
                              save_queue_depth=max(64, 2 * n),  # every chunk written, none dropped
                              cpu_gib=n * page_bytes / GiB, disk_path=tmp, write_mode="write-through",
                              disk_gib=3 * n * (page_bytes + 2 * HEADER_BYTES) / GiB)
        lower = TieredStore(config, store.namespace, page_bytes)
        lower.mover.landing = pool = LandingPool(page_bytes, n)
        try:
            pinned = False
            if cuda:
                pinned = lower.cpu.pin_host_memory() and pool.pin(lower.cpu) is None  # type: ignore[attr-defined]
            lower.put(keys, datas)
            other = [ChunkKey(bytes([0xA5]) + k[1:]) for k in keys]  # other chunks: the cpu tier full of them
            lower.flush(60.0)
            lower.clear(["cpu"])
            lower.put(other, datas)
            lower.flush(60.0)
            lower.gate_evictions(True)  # no page may be freed: every read lands in a landing buffer
            batched = [c.batched for c in copiers.copiers.values() if c.batched is not None]
            staged0 = sum(b.staged_runs for b in batched)
            ok, copy_s, load_s = True, float("inf"), float("inf")
            taken = [pool.take() for _ in range(n)]
            buffers = [b for b in taken if b is not None]
            assert len(buffers) == n, "the landing pool holds one buffer per loaded chunk"
            pinned = pinned and all(is_pinned(b) for b in buffers)
            for buffer, data in zip(buffers, datas):
                np.copyto(buffer, data)
            for _ in range(repeats):
                zero()
                sync()
                t0 = time.perf_counter()
                load_pages(copiers, list(zip(loads, buffers)))
                sync()
                copy_s = min(copy_s, time.perf_counter() - t0)
                ok = ok and equal()
            pool.give(buffers)
            pool.region[:] = 0  # the loads below must fill them again: from disk, not from this copy
            loader = AsyncLoader(LoadPath(lower, copiers, chunk_tokens, partial=True, wait_s=LOAD_WAIT_S), 2)
            hits0 = lower.stats().tier("disk").load_hit_chunks
            try:
                for r in range(repeats):
                    zero()
                    sync()
                    t0 = time.perf_counter()
                    loader.submit(LoadJob(f"endpoint-{r}", loads, 0, n * chunk_tokens, ("disk",) * n))
                    ok = _finished(loader, f"endpoint-{r}") and ok
                    sync()
                    load_s = min(load_s, time.perf_counter() - t0)
                    ok = ok and equal()
            finally:
                loader.shutdown()
            disk_chunks = lower.stats().tier("disk").load_hit_chunks - hits0
            promoted = sum(lower.cpu.contains(k) for k in keys)
            bounced = sum(b.staged_runs for b in batched) - staged0
            held = {pool.region[i * pool.stride:i * pool.stride + page_bytes].tobytes() for i in range(n)}
            landed = sum(d.tobytes() in held for d in datas)  # the reads landed in the pool's buffers
            ok = ok and disk_chunks == n * repeats and promoted == 0 and pool.free() == n and landed == n
            lower.gate_evictions(False)
        finally:
            lower.close()
    return EndpointResult(copy_s, load_s, disk_chunks, promoted, pinned, bounced, ok)


def _finished(loader: AsyncLoader, req_id: str) -> bool:
    """Wait (bounded) for ``req_id``'s load to be reported; True when it ended with every block filled."""
    deadline = time.monotonic() + LOAD_WAIT_S
    while time.monotonic() < deadline:
        loader.wait_ended(0.05)
        finished, errors, failed = loader.take()
        if req_id in finished:
            return not errors and not failed
    return False
