"""One conformance suite that every registered tier passes (see tests/core/tier_harness.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import GetResult, PutResult, available_tiers
from kvtier.core.tiers.base import Tier, capabilities
from kvtier.core.tiers.breaker import CircuitBreaker
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.registry import spec
from kvtier.core.tiers.wrappers import FaultyTier, unwrap

from .tier_harness import CHUNK, HARNESSES, NS, OTHER_NS


@pytest.fixture(params=sorted(HARNESSES))
def harness(request, tmp_path):
    return HARNESSES[request.param](request, tmp_path)


def guarded_faulty(inner: Tier, harness) -> Tier:
    """``inner`` under both wrappers with no faults to inject: each must be a pass-through."""
    return GuardedTier(FaultyTier(inner), deadline_s=harness.deadline_s / 2, transfer_deadline_s=harness.deadline_s / 2,
                       io_threads=4, queue_depth=16, breaker=CircuitBreaker(3, 0.5))


@pytest.fixture(params=["bare", "wrapped"])
def wrapping(request):
    return request.param


@pytest.fixture
def tier(harness, wrapping):
    t = harness.make(NS)
    if wrapping == "wrapped":
        t = guarded_faulty(t, harness)
    yield t
    t.close()


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def data(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


def read(tier, k) -> tuple[GetResult, bytes]:
    out = bytearray(CHUNK)
    result = tier.get_into(k, memoryview(out))
    return result, bytes(out)


def test_every_registered_tier_has_a_harness():
    variants = {name.split("-")[0] for name in HARNESSES}
    assert set(available_tiers()) <= variants, f"no conformance harness for {set(available_tiers()) - variants}"


def test_tier_implements_exactly_the_capabilities_its_record_declares(harness, tier, wrapping):
    """The registry record's capabilities (typed protocols, kvtier.core.tiers.base) are what the
    store relies on instead of probing attributes: a record must not promise one the tier lacks,
    nor hide one it has."""
    from tests.dict_tier import SPEC as DICT_SPEC

    record = DICT_SPEC if harness.tier_name == DICT_SPEC.name else spec(harness.tier_name)
    # a wrapper forwards every capability but staging (the store's top tier is never wrapped)
    want = record.capabilities - {"staging"} if wrapping == "wrapped" else record.capabilities
    assert capabilities(tier) == want
    assert tier.name == record.name and tier.shared == record.shared


def test_put_get_roundtrip_byte_identical(tier):
    assert tier.put(key(1), data(1)) is PutResult.STORED
    assert tier.contains(key(1)) and not tier.contains(key(2))
    assert tier.contains_many([key(2), key(1)]) == [False, True]
    result, got = read(tier, key(1))
    assert result is GetResult.HIT and got == data(1)
    assert read(tier, key(2))[0] is GetResult.MISS


def test_batch_forms_keep_order(tier):
    keys = [key(i) for i in range(3)]
    assert tier.put_many(keys, [data(i) for i in range(3)]) == [PutResult.STORED] * 3
    outs = [bytearray(CHUNK) for _ in range(4)]
    results = tier.get_many(keys[::-1] + [key(9)], [memoryview(o) for o in outs])
    assert results == [GetResult.HIT] * 3 + [GetResult.MISS]
    assert [bytes(o) for o in outs[:3]] == [data(2), data(1), data(0)]


def test_usage_counts_chunks_and_delete_forgets(tier):
    before = tier.usage()
    for i in range(3):
        tier.put(key(i), data(i))
    after = tier.usage()
    assert after.num_chunks == before.num_chunks + 3
    assert after.used_bytes >= before.used_bytes + 3 * CHUNK
    assert set(tier.keys()) >= {key(0), key(1), key(2)}
    assert tier.delete_many([key(0), key(9)]) == [True, False]
    assert not tier.contains(key(0)) and read(tier, key(0))[0] is GetResult.MISS
    assert tier.usage().num_chunks == after.num_chunks - 1
    tier.check()


def test_put_of_present_key_keeps_original(tier):
    tier.put(key(1), data(1))
    assert tier.put(key(1), data(2)) is PutResult.PRESENT
    assert read(tier, key(1)) == (GetResult.HIT, data(1))


def test_capacity_is_never_exceeded(harness, tier):
    if harness.capacity_chunks is None:
        pytest.skip("a shared tier's capacity is the server's (maxmemory); see the redis eviction test")
    n = harness.capacity_chunks
    results = tier.put_many([key(i) for i in range(n + 2)], [data(i) for i in range(n + 2)])
    assert results == [PutResult.STORED] * n + [PutResult.NO_ROOM] * 2
    usage = tier.usage()
    assert usage.num_chunks == n and usage.used_bytes <= usage.capacity_bytes
    assert usage.used_bytes + usage.free_bytes == usage.capacity_bytes
    tier.check()


@pytest.mark.parametrize("how", ["flip", "truncate", "foreign"])
def test_tampered_value_is_a_counted_miss_and_forgotten(harness, tier, how):
    if harness.tamper is None:
        pytest.skip(f"{harness.tier_name} pages are process memory: nothing outside can tamper with them")
    tier.put(key(1), data(1))
    tier.put(key(2), data(2))
    harness.tamper(unwrap(tier), key(1), how)
    assert read(tier, key(1))[0] is GetResult.CORRUPT
    assert tier.corrupt == 1
    assert not tier.contains(key(1))  # the bad value was removed
    assert read(tier, key(1))[0] is GetResult.MISS
    assert read(tier, key(2)) == (GetResult.HIT, data(2))  # neighbours unaffected
    tier.check()


def test_other_namespace_never_sees_the_chunk(harness, tier):
    if harness.tamper is None:
        pytest.skip(f"{harness.tier_name} is private to one process and namespace")
    tier.put(key(1), data(1))
    other = harness.make(OTHER_NS)
    try:
        assert not other.contains(key(1))
        assert read(other, key(1))[0] is GetResult.MISS
    finally:
        other.close()


def test_clear_removes_the_namespace_and_never_another(harness, tier):
    for i in range(1, 4):
        tier.put(key(i), data(i))
    other = harness.make(OTHER_NS) if harness.tamper is not None else None  # a namespace stored beside it
    try:
        if other is not None:
            other.put(key(1), data(1))
        result = tier.clear()
        assert result.ok and sorted(result.keys) == [key(i) for i in range(1, 4)]
        assert not any(tier.contains(key(i)) for i in range(1, 4))
        assert read(tier, key(2))[0] is GetResult.MISS
        assert tier.usage().num_chunks == 0 and tier.keys() == []
        tier.check()
        assert tier.put(key(2), data(2)) is PutResult.STORED  # usable at once
        assert read(tier, key(2)) == (GetResult.HIT, data(2))
        if other is not None:
            assert read(other, key(1)) == (GetResult.HIT, data(1))
    finally:
        if other is not None:
            other.close()


def test_concurrent_callers_get_exact_bytes(tier):
    errors: list[str] = []

    def worker(base: int) -> None:
        for i in range(base, base + 3):
            if not tier.put(key(i), data(i)).stored:
                continue  # no room is allowed; wrong bytes are not
            result, got = read(tier, key(i))
            if result is GetResult.HIT and got != data(i):
                errors.append(f"wrong bytes for chunk {i}")
            tier.delete(key(i))

    threads = [threading.Thread(target=worker, args=(10 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not errors
    tier.check()


def test_stalled_backend_is_a_miss_within_the_deadline(harness, tier):
    if harness.stall is None:
        pytest.skip(f"{harness.tier_name} has no backend that can stall")
    tier.put(key(1), data(1))
    with harness.stall(unwrap(tier), key(1)):
        t0 = time.monotonic()
        result, _ = read(tier, key(1))
        elapsed = time.monotonic() - t0
    assert result is not GetResult.HIT
    assert elapsed < harness.deadline_s, f"a read of a stalled backend took {elapsed:.2f} s"
