"""Store benchmark: put/get throughput of the cpu and disk tiers against the machine's own
reference, measured in the same run.

- cpu tier, ``put``: ``TieredStore.put`` (prepare_store, copy into the page pool, complete_store);
  ``get``: ``prepare_load`` + copy of every chunk into a caller buffer + ``complete_load``
  (what a load into the engine does).  Reference: ``numpy.copyto`` of the same bytes between
  two preallocated arrays.
- disk tier, ``put``: ``DiskTier.put`` (header + checksum, temp file, rename); ``get``:
  ``DiskTier.get_into`` (read + verify).  Reference: plain unbuffered ``write``/``readinto`` of
  the same bytes to/from fresh files in the same directory.

Each figure is the median of ``repeats`` rounds, tier and reference interleaved in each round so
both see the same machine state (the machine is shared and noisy; ratios are what compare).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.keys import Namespace, chunk_keys, request_root
from kvtier.core.store import TieredStore
from kvtier.core.tiers.disk import DiskTier

MiB = 1 << 20


@dataclass(frozen=True)
class StoreBenchResult:
    """One row: ``gib_per_s`` of the tier op, the reference's, and their ratio (tier / reference)."""

    tier: str
    op: str
    chunk_mib: float
    gib_per_s: float
    reference_gib_per_s: float
    ratio: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / GiB / max(seconds, 1e-9)


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _chunks(num: int, chunk_bytes: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, chunk_bytes, dtype=np.uint8)
    return [np.roll(block, i) for i in range(num)]  # distinct contents, cheap to make


def bench_cpu(chunk_mib: float, total_mib: float, repeats: int) -> list[StoreBenchResult]:
    """cpu-tier put/get vs numpy copy, ``total_mib`` MiB per round."""
    chunk_bytes = int(chunk_mib * MiB)
    num = max(2, int(total_mib / chunk_mib))
    nbytes = num * chunk_bytes
    datas = _chunks(num, chunk_bytes)
    dsts = [np.empty(chunk_bytes, dtype=np.uint8) for _ in range(num)]
    ns = Namespace("bench", "uint8", 1, 1, chunk_bytes, "flat", chunk_tokens=16)
    cfg = KVTierConfig.from_dict({"chunk_tokens": 16, "cpu_gib": (nbytes + chunk_bytes) / GiB})
    put_s, get_s, ref_s = [], [], []
    for d, s in zip(dsts, datas):  # warm-up: fault the destination pages in before any timing
        np.copyto(d, s)
    for r in range(repeats):
        store = TieredStore(cfg, ns, chunk_bytes)
        chain = chunk_keys(request_root(ns, cache_salt=str(r)), np.arange(num * 16), 16)
        def ref() -> None:
            for d, s in zip(dsts, datas):
                np.copyto(d, s)

        if r % 2:  # alternate who goes first, so neither always meets a cold cache
            put_s.append(_timed(lambda: store.put(chain, datas)))
            ref_s.append(_timed(ref))
        else:
            ref_s.append(_timed(ref))
            put_s.append(_timed(lambda: store.put(chain, datas)))

        def get() -> None:
            handle = store.prepare_load(chain)
            try:
                for d, b in zip(dsts, handle.buffers):
                    np.copyto(d, b)
            finally:
                store.complete_load(handle, True)

        get_s.append(_timed(get))
        assert store.lookup(chain) == num and np.array_equal(dsts[-1], datas[-1])
        store.close()
    ref = _rate(nbytes, statistics.median(ref_s))
    rows = []
    for op, times in (("put", put_s), ("get", get_s)):
        rate = _rate(nbytes, statistics.median(times))
        rows.append(StoreBenchResult("cpu", op, chunk_mib, rate, ref, rate / ref))
    return rows


def bench_disk(chunk_mib: float, total_mib: float, repeats: int, directory: Path) -> list[StoreBenchResult]:
    """disk-tier put/get vs plain unbuffered file write/read, ``total_mib`` MiB per round."""
    chunk_bytes = int(chunk_mib * MiB)
    num = max(2, int(total_mib / chunk_mib))
    nbytes = num * chunk_bytes
    datas = _chunks(num, chunk_bytes, seed=1)
    dst = np.empty(chunk_bytes, dtype=np.uint8)
    tiers_put, tiers_get, refs_put, refs_get = [], [], [], []
    for r in range(repeats):
        root = directory / f"round{r}"
        ref_dir = root / "reference"
        ref_dir.mkdir(parents=True)
        tier = DiskTier(root / "tier", os.urandom(16), capacity_bytes=2 * nbytes)
        keys = [i.to_bytes(16, "little") for i in range(num)]

        def ref_write() -> None:
            for i, d in enumerate(datas):
                with open(ref_dir / f"{i}.bin", "wb", buffering=0) as f:
                    f.write(memoryview(d))

        def ref_read() -> None:
            for i in range(num):
                with open(ref_dir / f"{i}.bin", "rb", buffering=0) as f:
                    f.readinto(memoryview(dst))

        def tier_put() -> None:
            for k, d in zip(keys, datas):
                tier.put(k, memoryview(d))

        def tier_get() -> None:
            for k in keys:
                if not tier.get_into(k, memoryview(dst)):
                    raise RuntimeError("disk tier lost a chunk during the benchmark")

        pairs = [(refs_put, ref_write), (tiers_put, tier_put), (refs_get, ref_read), (tiers_get, tier_get)]
        if r % 2:  # alternate who goes first, so neither always meets a cold cache
            pairs = [pairs[1], pairs[0], pairs[3], pairs[2]]
        for times, fn in pairs:
            times.append(_timed(fn))
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for op, t, ref in (("put", tiers_put, refs_put), ("get", tiers_get, refs_get)):
        rate = _rate(nbytes, statistics.median(t))
        ref_rate = _rate(nbytes, statistics.median(ref))
        rows.append(StoreBenchResult("disk", op, chunk_mib, rate, ref_rate, rate / ref_rate))
    return rows


def run_store_bench(chunk_mibs: list[float], total_mib: float = 256, repeats: int = 5,
                    directory: Path | None = None) -> list[StoreBenchResult]:
    """All rows: cpu then disk for each chunk size.  Files go to ``directory`` (a temp dir by default).

    Raises:
        ValueError: a non-positive chunk size or total.
    """
    if total_mib <= 0 or any(c <= 0 for c in chunk_mibs):
        raise ValueError("chunk sizes and --total-mib must be positive numbers of MiB")
    rows: list[StoreBenchResult] = []
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=directory))
    try:
        for mib in chunk_mibs:
            rows += bench_cpu(mib, total_mib, repeats)
            rows += bench_disk(mib, total_mib, repeats, base / f"{mib}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows
