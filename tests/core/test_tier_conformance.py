"""One conformance suite that every tier passes (the disk tier in buffered and O_DIRECT mode)."""

import numpy as np
import pytest

from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import CpuTier, DiskTier
from kvtier.core.tiers.chunkfile import HEADER_BYTES

CHUNK = 4096
NS = bytes(range(16))


@pytest.fixture(params=["cpu", "disk-buffered", "disk-direct"])
def tier(request):
    if request.param == "cpu":
        return CpuTier(capacity_bytes=4 * CHUNK, page_bytes=CHUNK)
    mode = request.param.removeprefix("disk-")
    root = request.getfixturevalue("direct_dir" if mode == "direct" else "tmp_path")
    disk = DiskTier(root, NS, capacity_bytes=4 * (CHUNK + HEADER_BYTES), io=mode)
    assert disk.io_mode == mode
    return disk


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def data(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


def test_put_get_roundtrip_byte_identical(tier):
    assert tier.put(key(1), data(1))
    assert tier.contains(key(1)) and not tier.contains(key(2))
    out = bytearray(CHUNK)
    assert tier.get_into(key(1), memoryview(out))
    assert bytes(out) == data(1)
    assert not tier.get_into(key(2), memoryview(out))


def test_capacity_is_never_exceeded(tier):
    results = tier.put_many([key(i) for i in range(6)], [data(i) for i in range(6)])
    assert results == [True] * 4 + [False] * 2
    usage = tier.usage()
    assert usage.num_chunks == 4 and usage.used_bytes <= usage.capacity_bytes
    assert usage.used_bytes + usage.free_bytes == usage.capacity_bytes


def test_delete_frees_room(tier):
    for i in range(4):
        tier.put(key(i), data(i))
    assert tier.delete_many([key(0), key(9)]) == [True, False]
    assert tier.put(key(5), data(5))
    assert tier.contains_many([key(0), key(5)]) == [False, True]


def test_put_of_present_key_keeps_original(tier):
    tier.put(key(1), data(1))
    assert tier.put(key(1), data(2))
    out = bytearray(CHUNK)
    tier.get_many([key(1)], [memoryview(out)])
    assert bytes(out) == data(1)
    assert tier.usage().num_chunks == 1
