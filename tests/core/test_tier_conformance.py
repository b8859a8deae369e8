"""One conformance suite that every registered tier passes (see tests/core/tier_harness.py): the
fixed-length path the store uses (``get_into``/``get_many`` into buffers of the chunk's length) and
the blob verbs (``get``, ``read_into``, ``get_range``, ``put`` of any length), bare and under the
wrappers (GuardedTier over FaultyTier)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvtier.core.keys import ChunkKey
from kvtier.core.tenant import TenantId
from kvtier.core.tenant import record as tenant_record
from kvtier.core.tiers import GetResult, PutResult, available_tiers
from kvtier.core.tiers.base import BufferTooSmall, Paged, Tier, capabilities
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


def test_many_tampered_values_are_one_warning_line_per_cause(harness, tier, caplog):
    """A tier whose values all fail verification (written by another format or secret, a bad disk)
    logs one line per cause per interval, not one per chunk read; each is still counted and removed."""
    if harness.tamper is None:
        pytest.skip(f"{harness.tier_name} pages are process memory: nothing outside can tamper with them")
    for i in range(1, 4):
        tier.put(key(i), data(i))
        harness.tamper(unwrap(tier), key(i), "flip")
    caplog.set_level("WARNING")
    assert [read(tier, key(i))[0] for i in range(1, 4)] == [GetResult.CORRUPT] * 3
    lines = [r.getMessage() for r in caplog.records if "is unusable" in r.getMessage()]
    assert len(lines) == 1 and "at most one such line per cause" in lines[0], lines
    assert tier.corrupt == 3 and not any(tier.contains(key(i)) for i in range(1, 4))


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


# ---- the blob verbs (issue 33 item 5): every tier, the same cases -------------------------------
LENGTHS = [0, 1, 4097, CHUNK, 3 * CHUNK + 5]
"""Payload lengths every tier stores and returns: empty, one byte, odd, a chunk, more than a chunk."""


def blob(length: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8).tobytes()


def keeps_records(harness) -> bool:
    """Whether the tier writes values in the envelope, with the writer's tenant record (every
    tier below the cpu tier; the cpu tier's records are the store's top tier's business)."""
    return harness.tamper is not None


@pytest.mark.parametrize("length", LENGTHS)
def test_blob_verbs_store_and_return_any_length(harness, tier, length):
    """``put`` of any length, then ``get`` (returned), ``read_into`` (a longer buffer: the length
    back, the bytes in front, the rest untouched), ``read_into`` a buffer one byte short
    (BufferTooSmall naming the length, nothing written) and the fixed-length ``get_into`` of exactly
    that length; the tenant record comes back with every verified read."""
    k, value = key(100 + length), blob(length, length)
    writer = TenantId.of("salt-A", None)
    put = tier.put(k, value, writer)
    if length > CHUNK and isinstance(unwrap(tier), Paged):
        assert put is PutResult.NO_ROOM and not tier.contains(k)  # a page holds one chunk at most
        return
    assert put is PutResult.STORED and tier.contains(k)
    records: dict = {}
    assert tier.get(k, records) == value
    if keeps_records(harness):
        assert records[bytes(k)].raw == tenant_record(NS, writer)
    out = bytearray(b"\xee" * (length + 7))
    assert tier.read_into(k, memoryview(out)) == length
    assert bytes(out[:length]) == value and out[length:] == b"\xee" * 7
    if length:
        short = bytearray(b"\xee" * (length - 1))
        with pytest.raises(BufferTooSmall) as raised:
            tier.read_into(k, memoryview(short))
        assert raised.value.value_bytes == length and short == b"\xee" * (length - 1)
    exact = bytearray(length)
    assert tier.get_into(k, memoryview(exact)) is GetResult.HIT and bytes(exact) == value
    assert tier.get(key(99)) is None and tier.read_into(key(99), memoryview(out)) is None
    assert tier.delete(k) and tier.get(k) is None
    tier.check()


def test_ranged_reads_clip_at_the_end_and_miss_when_absent(tier):
    length = CHUNK - 3  # odd, and within one cpu page
    k, value = key(7), blob(length, 7)
    assert tier.put(k, value) is PutResult.STORED
    assert tier.put(key(8), b"") is PutResult.STORED
    cases = [(0, 0), (0, length), (0, length + 100), (5, 10), (17, 1), (length - 1, 10), (length, 5),
             (length + 10, 5), (CHUNK // 2, CHUNK)]
    for offset, n in cases:
        assert tier.get_range(k, offset, n) == value[offset:offset + n], (offset, n)
    assert tier.get_range(key(8), 0, 10) == b""  # an empty value: present, nothing in range
    assert tier.get_range(key(9), 0, 10) is None  # absent
    for offset, n in [(-1, 4), (0, -1)]:
        with pytest.raises(ValueError):
            tier.get_range(k, offset, n)
    assert tier.get(k) == value  # ranged reads change nothing


@pytest.mark.parametrize("verb", ["get", "read_into", "get_into"])
def test_a_flipped_payload_byte_is_a_miss_on_every_whole_read(harness, tier, verb):
    """One payload byte flipped in the tier's storage: every whole read verifies the envelope's
    digest, so the value is a miss (never served), counted in ``corrupt`` and removed."""
    if harness.tamper is None:
        pytest.skip(f"{harness.tier_name} pages are process memory: nothing outside can tamper with them")
    length = CHUNK - 3
    k, value = key(11), blob(length, 11)
    tier.put(k, value)
    tier.put(key(12), value)
    harness.tamper(unwrap(tier), k, "flip")
    out = bytearray(length)
    if verb == "get":
        assert tier.get(k) is None
    elif verb == "read_into":
        assert tier.read_into(k, memoryview(bytearray(length + 1))) is None
    else:
        assert tier.get_into(k, memoryview(out)) is GetResult.CORRUPT
    assert tier.corrupt == 1 and not tier.contains(k)
    assert tier.get(k) is None and tier.get_range(k, 0, 4) is None  # removed
    assert tier.get(key(12)) == value  # neighbours unaffected
    tier.check()


def test_a_ranged_read_checks_the_header_but_not_the_payloads_bytes(harness, tier):
    """The documented limit of ``get_range`` (kvtier.core.tiers.valueread): no per-range digest
    exists, so a flipped payload byte comes back as stored (which is why ranged reads never serve
    KV), while a value whose header belongs to another namespace is a counted miss and removed."""
    if harness.tamper is None:
        pytest.skip(f"{harness.tier_name} pages are process memory: nothing outside can tamper with them")
    length = CHUNK - 3
    value = blob(length, 13)
    tier.put(key(13), value)
    tier.put(key(14), value)
    harness.tamper(unwrap(tier), key(13), "flip")
    if harness.recoded:  # an encrypted payload has no plain range: the ranged read is a verified whole read
        assert tier.get_range(key(13), 16, 3) is None and tier.corrupt == 1
    else:
        assert tier.get_range(key(13), 16, 3) == value[16:17] + bytes([value[17] ^ 0x01]) + value[18:19]
        assert tier.corrupt == 0
    harness.tamper(unwrap(tier), key(14), "foreign")
    assert tier.get_range(key(14), 0, 8) is None
    assert tier.corrupt == 1 + harness.recoded and not tier.contains(key(14))


def test_the_toy_tier_has_no_blob_verb_code_of_its_own():
    """The dict tier (tests/dict_tier.py) stores and loads whole values only; every verb above
    (reads of any length, ranges, verification, tenant records) is kvtier's EnvelopeTier."""
    from kvtier.core.tiers.envelopetier import EnvelopeTier
    from tests.dict_tier import DictTier

    assert issubclass(DictTier, EnvelopeTier)
    own = set(vars(DictTier))
    assert not own & {"get", "read_into", "get_range", "get_into", "get_many", "put"}
    assert {"load", "store"} <= own


STALL_DEADLINE_S = 0.5
"""The wrapper's deadlines in the blob-verb stall test: each of its three reads waits them out in full
(2 s each under :func:`guarded_faulty`: 6 s of a unit-test worker's time per tier, for the same check)."""


def test_stalled_backend_is_a_miss_within_the_deadline_for_the_blob_verbs(harness):
    """Under GuardedTier (a bare shared tier raises on a fault: the deadline is the wrapper's); each
    read returns within the wrapper's deadline plus the margin :func:`guarded_faulty`'s leave (its
    deadline is half the harness's)."""
    if harness.stall is None:
        pytest.skip(f"{harness.tier_name} has no backend that can stall")
    inner = harness.make(NS)
    tier = GuardedTier(FaultyTier(inner), deadline_s=STALL_DEADLINE_S, transfer_deadline_s=STALL_DEADLINE_S,
                       io_threads=4, queue_depth=16, breaker=CircuitBreaker(3, 0.5))
    margin_s = harness.deadline_s / 2
    try:
        # written through the bare tier (its own deadlines): the short ones are for the stalled reads
        assert inner.put(key(1), data(1)) is PutResult.STORED
        with harness.stall(unwrap(inner), key(1)):
            for verb in (lambda: tier.get(key(1)), lambda: tier.get_range(key(1), 0, 16),
                         lambda: tier.read_into(key(1), memoryview(bytearray(CHUNK)))):
                t0 = time.monotonic()
                assert verb() is None
                assert time.monotonic() - t0 < STALL_DEADLINE_S + margin_s
    finally:
        tier.close()
