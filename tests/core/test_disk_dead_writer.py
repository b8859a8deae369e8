"""A writer SIGKILLed in the middle of a chunk write leaves a temporary file; it is recognised as
a dead writer's at once (its lock is free) and removed, at a restart however soon and by a live
sharer's rescan, so the directory never holds more than the tier's capacity.

Reproduced bug (issue 20): a restart within ``STALE_TMP_S`` (120 s) kept the leftover for its whole
life and did not count it: the directory held 12,779,520 bytes against ``disk_gib`` 12,582,912."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import DiskTier
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES

CHUNK = 8 << 20  # large enough that a write takes a while, so the kill lands inside one
NUM_CHUNKS = 3
NS = b"w" * 16
CAPACITY = NUM_CHUNKS * (CHUNK + HEADER_BYTES)

WRITER = """
import sys
import numpy as np
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import DiskTier
root, chunk, num = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tier = DiskTier(root, b"w" * 16, capacity_bytes=num * (chunk + 4096), io="buffered")
data = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()
for i in range(num - 1):  # present already when an earlier attempt's writer was killed between writes
    assert tier.put(ChunkKey(i.to_bytes(16, "big")), data).stored
print("ready", flush=True)
last = ChunkKey((num - 1).to_bytes(16, "big"))
while True:  # the last chunk, over and over: its temporary file exists most of the time
    tier.put(last, data)
    tier.delete(last)
"""


def tmp_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.tmp"))


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.parent.name != ".writers")


def kill_mid_write(root: Path, others: tuple[Path, ...] = ()) -> Path:
    """Run a writer process on ``root`` and SIGKILL it while its temporary file exists; returns that
    file.  ``others``: temporary files already there (another writer's), never taken for the writer's."""
    for _attempt in range(20):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(CHUNK), str(NUM_CHUNKS)],
                                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
            deadline = time.monotonic() + 30
            while not set(tmp_files(root)) - set(others) and time.monotonic() < deadline:
                time.sleep(0.0005)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        left = [p for p in tmp_files(root) if p not in others]
        if left:  # the kill landed inside a write
            return left[0]
    pytest.fail("the writer was never killed while its temporary file existed")


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def test_restart_right_after_a_sigkill_mid_write_removes_the_leftover_and_stays_within_capacity(tmp_path):
    tmp = kill_mid_write(tmp_path)
    assert time.time() - tmp.stat().st_mtime < 120  # young: an age rule alone would keep it
    restarted = DiskTier(tmp_path, NS, capacity_bytes=CAPACITY, io="buffered")
    assert not tmp.exists() and tmp_files(tmp_path) == []
    assert restarted.usage().num_chunks == NUM_CHUNKS - 1
    data = np.zeros(CHUNK, dtype=np.uint8).tobytes()
    assert restarted.put(key(NUM_CHUNKS - 1), data).value == "stored"  # the tier fills up to its capacity
    assert restarted.put(key(NUM_CHUNKS), data).value == "no_room"
    assert dir_bytes(tmp_path) == restarted.usage_exact() <= CAPACITY
    restarted.check()
    restarted.close()


def test_a_live_sharers_rescan_removes_a_dead_writers_leftover_and_keeps_a_live_ones(tmp_path):
    sharer = DiskTier(tmp_path, NS, capacity_bytes=CAPACITY, io="buffered")
    assert sharer.rescan().dead_tmp_removed == 0
    live = sharer.path(key(7)).with_name(f"{sharer.path(key(7)).name}.{sharer._writer.writer_id}.1.tmp")
    live.write_bytes(b"in flight")  # a temporary file of a live writer (this process) is never touched
    tmp = kill_mid_write(tmp_path, others=(live,))
    found = sharer.rescan()
    assert found.dead_tmp_removed == 1 and not tmp.exists() and live.exists()
    assert sorted(found.adopted) == [key(i) for i in range(NUM_CHUNKS - 1)]
    live.unlink()
    sharer.close()


IDLE_WRITER = """
import sys
from kvtier.core.tiers import DiskTier
tier = DiskTier(sys.argv[1], b"w" * 16, capacity_bytes=1 << 20, io="buffered")
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_restart_removes_the_lock_files_of_writers_killed_between_writes(tmp_path):
    """A soak that SIGKILLed 40 writers on one directory left 11 lock files in ``.writers``, never removed:
    a dead writer's lock file went only with a temporary file of its own, so every engine killed between
    writes (an OOM kill, a node drain, a crash loop) left one more for good."""
    writers = tmp_path / NS.hex() / ".writers"
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", IDLE_WRITER, str(tmp_path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    dead = sorted(writers.iterdir())
    assert len(dead) == 3 and tmp_files(tmp_path) == []  # killed between writes: no temporary file to go by
    for path in dead[:2]:  # old enough to be no new writer's, created and not locked yet
        os.utime(path, (time.time() - 120, time.time() - 120))
    live = DiskTier(tmp_path, NS, capacity_bytes=CAPACITY, io="buffered")  # alive while the next one starts
    os.utime(live._writer.path, (time.time() - 120, time.time() - 120))  # old, but held: never removed
    restarted = DiskTier(tmp_path, NS, capacity_bytes=CAPACITY, io="buffered")
    left = {p.name for p in writers.iterdir()}
    assert left == {dead[2].name, f"{live._writer.writer_id}.lock", f"{restarted._writer.writer_id}.lock"}
    live.close()
    restarted.close()
    assert {p.name for p in writers.iterdir()} == {dead[2].name}  # a young one waits for a later start
