"""Store benchmark: put/get throughput of the cpu and disk tiers against the machine's own
reference, measured in the same run.

- cpu tier, ``put``: ``TieredStore.put`` (prepare_store, copy into the page pool, complete_store);
  ``get``: ``prepare_load`` + copy of every chunk into a caller buffer + ``complete_load``
  (what a load into the engine does).  Reference: ``numpy.copyto`` of the same bytes between
  two preallocated arrays.
- disk tier, ``put``: ``DiskTier.put_many`` (checksum, temp file, header, rename); ``get``:
  ``DiskTier.get_many`` (read + verify every byte), ``threads`` chunks at a time (``io_threads``),
  buffered or ``O_DIRECT``.  Reference: plain ``open``/``pwrite``/``preadv``/``close`` of the
  same bytes to/from fresh files in the same directory, with the same thread count and the same
  I/O mode.  Buffers are page-aligned, as the cpu tier's pages are.

Each figure is the median of ``repeats`` rounds, tier and reference interleaved in each round so
both see the same machine state (the machine is shared and noisy; ratios are what compare).
"""

from __future__ import annotations

import errno
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.keys import ChunkKey, Namespace, chunk_keys, request_root
from kvtier.core.store import TieredStore
from kvtier.core.tiers.base import GetResult, PutResult
from kvtier.core.tiers.disk.chunkio import ALIGN, O_DIRECT, aligned_buffer
from kvtier.core.tiers.disk.iomode import direct_supported
from kvtier.core.tiers.disk.tier import CHOOSER, DiskTier

MiB = 1 << 20


@dataclass(frozen=True)
class StoreBenchResult:
    """One row: ``gib_per_s`` of the tier op (median round), the reference's, their ratio (tier /
    reference), the I/O mode and thread count both used, and the lowest and highest ratio of a
    single round (tier and reference timed back to back): the spread a noisy machine gives."""

    tier: str
    op: str
    chunk_mib: float
    gib_per_s: float
    reference_gib_per_s: float
    ratio: float
    io: str = "memory"
    threads: int = 1
    ratio_min: float = 0.0
    ratio_max: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / GiB / max(seconds, 1e-9)


def _timed(fn: Callable[[], object]) -> float:
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
        def copy_all() -> None:
            for d, s in zip(dsts, datas):
                np.copyto(d, s)

        if r % 2:  # alternate who goes first, so neither always meets a cold cache
            put_s.append(_timed(lambda: store.put(chain, datas)))
            ref_s.append(_timed(copy_all))
        else:
            ref_s.append(_timed(copy_all))
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
        per_round = [r / t for t, r in zip(times, ref_s)]
        rows.append(StoreBenchResult("cpu", op, chunk_mib, rate, ref, rate / ref, "memory", 1,
                                     min(per_round), max(per_round)))
    return rows


def _aligned_chunks(num: int, chunk_bytes: int, seed: int) -> list[np.ndarray]:
    """Like :func:`_chunks`, in page-aligned memory (as the cpu tier's pages are)."""
    out = []
    for block in _chunks(num, chunk_bytes, seed):
        buf = np.frombuffer(aligned_buffer(chunk_bytes), dtype=np.uint8)
        np.copyto(buf, block)
        out.append(buf)
    return out


def _raw_io(directory: Path, direct: bool, threads: int) -> tuple[Callable[[list[np.ndarray]], None],
                                                                   Callable[[list[np.ndarray]], None]]:
    """(write, read) of the reference: one file per chunk, ``threads`` files at a time, plain
    ``open``/``pwrite``/``preadv``/``close`` (with ``O_DIRECT`` when ``direct``), no checks."""
    flags = O_DIRECT if direct else 0

    def write_one(i: int, data: np.ndarray) -> None:
        fd = os.open(directory / f"{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
        try:
            os.pwrite(fd, data.data, 0)
        finally:
            os.close(fd)

    def read_one(i: int, dst: np.ndarray) -> None:
        fd = os.open(directory / f"{i}.bin", os.O_RDONLY | flags)
        try:
            os.preadv(fd, [dst.data], 0)
        finally:
            os.close(fd)

    def run(fn: Callable[[int, np.ndarray], None], bufs: list[np.ndarray]) -> None:
        if threads == 1:
            for i, b in enumerate(bufs):
                fn(i, b)
            return
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, range(len(bufs)), bufs))

    return (lambda bufs: run(write_one, bufs)), (lambda bufs: run(read_one, bufs))


def bench_disk(chunk_mib: float, total_mib: float, repeats: int, directory: Path, threads: int = 1,
               io: str = "buffered", read_way: str = "auto") -> list[StoreBenchResult]:
    """disk-tier put/get (verified) vs raw file write/read of the same bytes, ``total_mib`` MiB
    per round, ``threads`` chunks at a time in both, in ``io`` mode (``buffered`` or ``direct``)
    for both.  Buffers are page-aligned, as the cpu tier's pages are.  ``read_way``: buffered
    reads ``auto`` (as measured, kvtier.core.tiers.disk.tier.ReadChooser), or always ``serial`` / ``split``
    (rows labelled ``buffered:serial`` / ``buffered:split``).

    Raises:
        RuntimeError: the tier lost or corrupted a chunk during the run.
    """
    chunk_bytes = int(chunk_mib * MiB)
    num = max(2, int(total_mib / chunk_mib))
    nbytes = num * chunk_bytes
    datas = _aligned_chunks(num, chunk_bytes, seed=1)
    dsts = [np.frombuffer(aligned_buffer(chunk_bytes), dtype=np.uint8) for _ in range(num)]
    for d in dsts:
        d[::4096] = 0  # fault the pages in before timing
    times: dict[str, list[float]] = {"put": [], "get": [], "ref_put": [], "ref_get": []}
    forced, CHOOSER.force = CHOOSER.force, None if read_way == "auto" else read_way
    try:
        _rounds(chunk_bytes, num, repeats, directory, threads, io, datas, dsts, times)
    finally:
        CHOOSER.force = forced
    label = io if read_way == "auto" or io != "buffered" else f"{io}:{read_way}"
    rows = []
    for op in ("put", "get"):
        rate = _rate(nbytes, statistics.median(times[op]))
        ref_rate = _rate(nbytes, statistics.median(times[f"ref_{op}"]))
        per_round = [ref / t for t, ref in zip(times[op], times[f"ref_{op}"])]
        rows.append(StoreBenchResult("disk", op, chunk_mib, rate, ref_rate, rate / ref_rate, label, threads,
                                     min(per_round), max(per_round)))
    return rows


def _rounds(chunk_bytes: int, num: int, repeats: int, directory: Path, threads: int, io: str,
            datas: list[np.ndarray], dsts: list[np.ndarray], times: dict[str, list[float]]) -> None:
    """The timed rounds of :func:`bench_disk` (times appended to ``times``)."""
    nbytes = num * chunk_bytes
    for r in range(repeats):
        root = directory / f"round{r}"
        ref_dir = root / "reference"
        ref_dir.mkdir(parents=True)
        tier = DiskTier(root / "tier", os.urandom(16), capacity_bytes=2 * nbytes,
                        io="direct" if io == "direct" else "buffered", io_threads=threads)
        if tier.io_mode != io:
            tier.close()
            raise OSError(errno.EINVAL, f"the filesystem of {directory} refuses O_DIRECT")
        ref_write, ref_read = _raw_io(ref_dir, io == "direct", threads)
        keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(num)]

        def tier_put() -> None:
            if not all(r is PutResult.STORED for r in tier.put_many(keys, [d.data for d in datas])):
                raise RuntimeError("disk tier refused a chunk during the benchmark")

        def tier_get() -> None:
            if not all(r is GetResult.HIT for r in tier.get_many(keys, [d.data for d in dsts])):
                raise RuntimeError("disk tier lost a chunk during the benchmark")

        pairs = [("ref_put", lambda: ref_write(datas)), ("put", tier_put),
                 ("ref_get", lambda: ref_read(dsts)), ("get", tier_get)]
        if r % 2:  # alternate who goes first, so neither always meets a cold cache
            pairs = [pairs[1], pairs[0], pairs[3], pairs[2]]
        for name, fn in pairs:
            times[name].append(_timed(fn))
        tier.close()
        if not np.array_equal(dsts[-1], datas[-1]):
            raise RuntimeError("disk tier returned wrong bytes during the benchmark")
        shutil.rmtree(root, ignore_errors=True)


def run_store_bench(chunk_mibs: list[float], total_mib: float = 256, repeats: int = 5,
                    directory: Path | None = None, threads: Sequence[int] = (1,),
                    ios: Sequence[str] = ("buffered", "direct"),
                    read_ways: Sequence[str] = ("auto",)) -> tuple[list[StoreBenchResult], list[str]]:
    """All rows: for each chunk size, cpu (one thread) then disk for each I/O mode and thread count
    (buffered: once per ``read_ways`` entry, see :func:`bench_disk`).  Files go to ``directory``
    (a temp dir by default).

    Returns:
        (rows, notes): notes say which disk configurations were skipped and why (O_DIRECT
        refused by the filesystem, or a chunk size that is not a multiple of 4096 bytes).

    Raises:
        ValueError: a non-positive chunk size, total or thread count, or an unknown I/O mode.
    """
    if total_mib <= 0 or any(c <= 0 for c in chunk_mibs):
        raise ValueError("chunk sizes and --total-mib must be positive numbers of MiB")
    if not threads or any(t <= 0 for t in threads):
        raise ValueError("thread counts must be positive integers, e.g. --threads 1,2,4")
    if not ios or any(io not in ("buffered", "direct") for io in ios):
        raise ValueError("--disk-io must list buffered and/or direct, e.g. --disk-io buffered,direct")
    if not read_ways or any(w not in ("auto", "serial", "split") for w in read_ways):
        raise ValueError("--buffered-reads must list auto, serial and/or split, e.g. --buffered-reads auto,serial,split")
    rows: list[StoreBenchResult] = []
    notes: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=directory))
    try:
        direct_ok = direct_supported(base)
        if "direct" in ios and not direct_ok:
            notes.append(f"direct rows skipped: the filesystem of {base.parent} refuses O_DIRECT")
        for mib in chunk_mibs:
            rows += bench_cpu(mib, total_mib, repeats)
            for io in ios:
                if io == "direct" and not direct_ok:
                    continue
                if io == "direct" and int(mib * MiB) % ALIGN:
                    notes.append(f"direct rows at {mib:g} MiB skipped: O_DIRECT needs a multiple of 4 KiB")
                    continue
                for n in threads:
                    for way in read_ways if io == "buffered" else ("auto",):
                        before = CHOOSER.splits, CHOOSER.serials
                        rows += bench_disk(mib, total_mib, repeats, base / f"{mib}-{io}-{n}-{way}", n, io, way)
                        split, serial = CHOOSER.splits - before[0], CHOOSER.serials - before[1]
                        if io == "buffered" and way == "auto" and split + serial:
                            notes.append(f"buffered get at {mib:g} MiB, {n} thread(s): {split / (split + serial):.0%} "
                                         "of reads split over two threads (chosen by measurement, "
                                         "docs/store.md#disk-io)")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows, notes
