"""CPU cost of write-through vs write-back in a TieredStore with a real disk tier (issue 9).

Stores 256 chunks of 1 MiB (128 tokens at 8 KiB) in each mode, twice, and prints per chunk: the
caller's put time, the time until the disk writes are done, and the process CPU time (caller +
writer threads).  Usage: ``python scripts/write_mode_cost.py`` (writes under /tmp, cleans up).
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time

import numpy as np

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.keys import Namespace, chunk_keys, request_root
from kvtier.core.store import TieredStore

CHUNK_BYTES = 1 << 20  # 128 tokens × 8 KiB
NUM_CHUNKS = 256


def run(mode: str) -> tuple[float, float, float]:
    """(caller seconds, seconds until on disk, CPU seconds) for NUM_CHUNKS chunks in ``mode``."""
    directory = tempfile.mkdtemp(dir="/tmp")
    config = KVTierConfig.from_dict({
        "chunk_tokens": 128, "cpu_gib": (NUM_CHUNKS + 8) * CHUNK_BYTES / GiB, "disk_path": directory,
        "disk_gib": 2 * NUM_CHUNKS * (CHUNK_BYTES + 8192) / GiB, "write_mode": mode, "save_queue_depth": 1024})
    namespace = Namespace(model="m", kv_dtype="f", num_layers=8, num_kv_heads=2, head_size=64, layout="t")
    store = TieredStore(config, namespace, CHUNK_BYTES)
    chain = chunk_keys(request_root(namespace), np.arange(NUM_CHUNKS * 128), 128)
    data = [np.random.default_rng(i).integers(0, 256, CHUNK_BYTES, dtype=np.uint8) for i in range(16)]
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for i in range(0, NUM_CHUNKS, 16):
        store.put(chain[i:i + 16], data)
    caller = time.perf_counter() - t0
    store.flush()
    r1, total = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    store.close()
    shutil.rmtree(directory, ignore_errors=True)
    return caller, total, cpu


def main() -> int:
    for _ in range(2):
        for mode in ("write-back", "write-through"):
            caller, total, cpu = run(mode)
            print(f"{mode:14s} put (caller) {caller * 1e3 / NUM_CHUNKS:.3f} ms/chunk  until on disk "
                  f"{total * 1e3 / NUM_CHUNKS:.3f} ms/chunk  cpu {cpu * 1e3 / NUM_CHUNKS:.3f} ms/chunk")
    print("load average", os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
