"""A disk tier's rescan never mistakes this process's own chunk files for another process's.

A soak of one engine alone on its directory (cpu 3 MiB, disk 6 MiB, ~2,700 requests) logged "the
disk tier held ... after adopting other engines' chunk files ... evicted N chunks" and a plain
store in a loop did the same: the rescan thread (every ``disk_rescan_s``, 2 s by default) listed a
shard while this process was writing or removing a file in it, so the chunk was forgotten as
removed from outside (a ``purged`` ghost, a removal in the change feed), then taken back as a
foreign file, the tier trimmed, a good chunk evicted for it; or a file whose removal was under way
was adopted after its unlink.  Both races are timing windows, so each test runs the writer and the
rescan side by side, as the store's threads do, for a bounded time and counts what a rescan
wrongly took in or dropped (without the fix: dozens of each a second here).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import DiskTier, PutResult

CHUNK = 1024
NS = b"o" * 16
RUN_S = 2.0


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def rescan_beside(tier: DiskTier, work: Callable[[threading.Event], None]) -> tuple[list[ChunkKey], list[ChunkKey]]:
    """Run ``work(stop)`` in this thread while another rescans ``tier`` in a loop (scan, then adopt:
    the store's two steps); returns every key the rescans adopted and every key they called gone."""
    stop = threading.Event()
    adopted: list[ChunkKey] = []
    gone: list[ChunkKey] = []

    def rescans() -> None:
        while not stop.is_set():
            found = tier.adopt(tier.scan())
            adopted.extend(found.adopted)
            gone.extend(found.gone)

    scanner = threading.Thread(target=rescans, name="test-rescan")
    scanner.start()
    try:
        work(stop)
    finally:
        stop.set()
        scanner.join()
    return adopted, gone


def test_a_rescan_during_this_process_writes_neither_drops_nor_adopts_them(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, NS, capacity_bytes=64 * (CHUNK + 4096))
    written: list[ChunkKey] = []
    puts = 0

    def write(stop: threading.Event) -> None:
        nonlocal puts
        end = time.monotonic() + RUN_S
        i = 0
        while time.monotonic() < end:
            k = key(i)
            assert tier.put(k, bytes([i % 256]) * CHUNK) == PutResult.STORED
            written.append(k)
            if len(written) > 32:  # stay within capacity: the oldest leaves, as an eviction does
                tier.delete(written.pop(0))
            i += 1
        puts = i

    adopted, gone = rescan_beside(tier, write)
    assert puts > 100  # the rescans ran beside many writes
    assert adopted == [] and gone == [], (f"{len(adopted)} of this process's own files adopted as another's and "
                                          f"{len(gone)} forgotten as removed from outside")
    assert sorted(tier.keys()) == sorted(written)  # the index is exactly what this process holds
    tier.check()
    tier.close()


def test_a_rescan_during_this_process_removals_never_takes_a_removed_file_back(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, NS, capacity_bytes=64 * (CHUNK + 4096))

    def churn(stop: threading.Event) -> None:
        end = time.monotonic() + RUN_S
        i = 0
        while time.monotonic() < end:
            keys = [key(i * 8 + j) for j in range(8)]
            for k in keys:
                tier.put(k, b"x" * CHUNK)
            for k in keys:
                tier.delete(k)  # forgotten at once, its file removed right after
            i += 1

    adopted, _gone = rescan_beside(tier, churn)
    assert adopted == [], f"{len(adopted)} files this process had removed were adopted back"
    assert tier.keys() == [] and tier.usage_exact() == 0
    assert not list(tier.dir.glob("*/*.kvc"))
    tier.check()
    tier.close()
