"""Disk tier: crash-safe files, restart recovery, and corruption as a counted miss."""

import os
import time

import numpy as np
import pytest

from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import DiskTier
from kvtier.core.tiers.chunkfile import HEADER_BYTES
from kvtier.core.tiers.disk import STALE_TMP_S

CHUNK = 8192
NS = b"n" * 16


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def data(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


@pytest.fixture
def disk(tmp_path):
    tier = DiskTier(tmp_path, NS, capacity_bytes=100 * CHUNK)
    for i in range(3):
        assert tier.put(key(i), data(i))
    return tier


def read(tier, i):
    out = bytearray(CHUNK)
    return bytes(out) if tier.get_into(key(i), memoryview(out)) else None


def test_restart_rebuilds_index(disk, tmp_path):
    again = DiskTier(tmp_path, NS, capacity_bytes=100 * CHUNK)
    assert again.usage().num_chunks == 3
    assert again.usage().used_bytes == 3 * (CHUNK + HEADER_BYTES)
    assert read(again, 1) == data(1)


def test_stale_temp_files_removed_on_restart_fresh_ones_kept(disk, tmp_path):
    stale = disk.path(key(7)).with_name("x.kvc.123.456.tmp")
    stale.write_bytes(b"partial")
    old = time.time() - STALE_TMP_S - 10
    os.utime(stale, (old, old))
    fresh = disk.path(key(8)).with_name("y.kvc.123.456.tmp")  # another live process is writing it
    fresh.write_bytes(b"partial")
    DiskTier(tmp_path, NS, capacity_bytes=100 * CHUNK)
    assert not stale.exists() and fresh.exists()


def corrupt_cases():
    def flip(path):
        raw = bytearray(path.read_bytes())
        raw[HEADER_BYTES + 100] ^= 0xFF
        path.write_bytes(bytes(raw))

    def flip_header(path):
        raw = bytearray(path.read_bytes())
        raw[45] ^= 0x01  # inside the length field
        path.write_bytes(bytes(raw))

    def truncate(path):
        os.truncate(path, HEADER_BYTES + CHUNK // 2)

    def truncate_header(path):
        os.truncate(path, 20)

    def garbage(path):
        path.write_bytes(b"\0" * (CHUNK + HEADER_BYTES))

    def extra(path):
        with open(path, "ab") as f:
            f.write(b"tail")

    return [flip, flip_header, truncate, truncate_header, garbage, extra]


@pytest.mark.parametrize("damage", corrupt_cases(), ids=lambda f: f.__name__)
def test_corrupt_file_is_a_counted_miss_never_wrong_bytes(disk, damage, caplog):
    damage(disk.path(key(1)))
    assert read(disk, 1) is None
    assert disk.corrupt == 1
    assert not disk.contains(key(1)) and not disk.path(key(1)).exists()
    assert "unusable" in caplog.text
    assert read(disk, 0) == data(0) and read(disk, 2) == data(2)
    disk.check()


def test_foreign_namespace_file_is_a_miss(disk, tmp_path):
    other = DiskTier(tmp_path, b"o" * 16, capacity_bytes=100 * CHUNK)
    other.put(key(9), data(9))
    # an operator copies a file between namespaces: it must not be served
    target = disk.path(key(9))
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(other.path(key(9)).read_bytes())
    assert read(disk, 9) is None and disk.corrupt == 1


def test_file_renamed_to_another_key_is_a_miss(disk):
    src, dst = disk.path(key(0)), disk.path(key(5))
    dst.parent.mkdir(exist_ok=True)
    dst.write_bytes(src.read_bytes())
    assert read(disk, 5) is None and disk.corrupt == 1


def test_files_from_another_process_are_adopted(tmp_path):
    a = DiskTier(tmp_path, NS, capacity_bytes=100 * CHUNK)
    b = DiskTier(tmp_path, NS, capacity_bytes=100 * CHUNK)
    a.put(key(4), data(4))
    assert b.contains(key(4)) and read(b, 4) == data(4)
    a.delete(key(4))
    assert read(b, 4) is None  # deleted elsewhere: a plain miss


def test_fifo_at_a_chunk_path_is_a_miss_not_a_hang(disk):
    path = disk.path(key(1))
    path.unlink()
    os.mkfifo(path)
    assert read(disk, 1) is None and disk.corrupt == 1


def test_unremovable_entry_is_counted_and_logged_once(disk, caplog):
    path = disk.path(key(1))
    path.unlink()
    path.mkdir()
    (path / "inside").write_text("x")  # a non-empty directory cannot be unlinked
    for _ in range(3):
        assert read(disk, 1) is None
    assert disk.corrupt == 1 and caplog.text.count("unusable") == 1


def test_files_outside_their_shard_are_not_indexed(disk, tmp_path):
    src = disk.path(key(0))
    wrong = disk.dir / "zz"
    wrong.mkdir()
    (wrong / src.name).write_bytes(src.read_bytes())
    again = DiskTier(tmp_path, NS, capacity_bytes=100 * CHUNK)
    assert again.usage().num_chunks == 3
    again.check()


def test_reserved_header_bytes_are_checked(disk):
    path = disk.path(key(2))
    raw = bytearray(path.read_bytes())
    raw[75] = 1
    path.write_bytes(bytes(raw))
    assert read(disk, 2) is None and disk.corrupt == 1
