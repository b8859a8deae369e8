"""Fault and guard wrappers (kvtier.core.tiers.wrappers, kvtier.core.tiers.guarded) around real
tiers: the store handles what a faulty tier returns, and GuardedTier turns a slow or dead backend
into counted misses within its deadline without ever writing into a buffer it gave back."""

from __future__ import annotations

import logging
import time

import pytest

from kvtier.core.config import KVTierConfig
from kvtier.core.store import TieredStore
from kvtier.core.tiers import DiskTier, GetResult, PutResult
from kvtier.core.tiers.breaker import BreakerState, CircuitBreaker
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.wrappers import Fault, FaultyTier, SlowTier, unwrap

from .helpers import CHUNK_BYTES, CHUNK_TOKENS, NS, chain_of, payload


def _store_with_faulty_disk(tmp_path, rules):
    faulty: list[FaultyTier] = []

    def wrap(tier):
        faulty.append(FaultyTier(tier, rules))
        return faulty[-1]

    config = KVTierConfig.from_dict({"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 8 * CHUNK_BYTES / 2**30,
                                     "write_mode": "write-through", "disk_path": str(tmp_path / "disk"),
                                     "disk_gib": 64 * 2 * CHUNK_BYTES / 2**30})
    store = TieredStore(config, NS, CHUNK_BYTES, wrap=wrap)
    return store, faulty[0]


def test_failed_lower_tier_writes_are_counted_and_the_chunks_stay_only_in_the_cpu_tier(tmp_path):
    chain = chain_of(1, 4)
    store, disk = _store_with_faulty_disk(tmp_path, [Fault("put", "error", keys=frozenset(chain[2:]))])
    try:
        assert store.put(chain, [payload(k) for k in chain]) == 4
        store.flush()
        assert disk.injected == {"error": 2}
        s = store.stats()
        assert s.tier("disk").write_errors == 2 and s.dropped_saves == 2
        assert [unwrap(disk).contains(k) for k in chain] == [True, True, False, False]
        assert set(store.dirty_keys()) == set(chain[2:])  # never written: still only in DRAM
        store.check_integrity()
    finally:
        store.close()


def test_a_corrupt_read_from_a_lower_tier_cuts_the_load_and_is_forgotten(tmp_path):
    chain = chain_of(2, 4)
    store, disk = _store_with_faulty_disk(tmp_path, [Fault("get", "corrupt", keys=frozenset({chain[2]}))])
    try:
        assert store.put(chain, [payload(k) for k in chain]) == 4
        store.flush()
        with store.index.lock:  # the cpu tier forgets the chain (as its eviction would): only the disk tier has it
            for key in chain:
                store.index.evict_top(key)
        assert store.get(chain) == [payload(k) for k in chain[:2]]  # chunk 2 failed verification: the load stops
        assert store.stats().corrupt_chunks == 1 and disk.injected == {"corrupt": 1}
        assert not disk.contains(chain[2]) and store.lookup(chain) == 2
        store.check_integrity()
    finally:
        store.close()


def test_guarded_slow_read_is_a_counted_miss_within_the_deadline_and_never_lands_late(tmp_path):
    disk = DiskTier(tmp_path, NS.digest(), capacity_bytes=16 * 2 * CHUNK_BYTES, io="buffered")
    key = chain_of(3, 1)[0]
    assert disk.put(key, payload(key)) is PutResult.STORED
    guarded = GuardedTier(SlowTier(disk, get_s=0.6), deadline_s=0.1, transfer_deadline_s=0.1, io_threads=2,
                          queue_depth=4, breaker=CircuitBreaker(3, 60.0))
    try:
        dst = bytearray(CHUNK_BYTES)
        assert guarded.get_into(key, memoryview(dst)) is GetResult.MISS
        assert guarded.wire_stats().errors["get"] == 1
        time.sleep(0.8)  # the late read has finished by now, into the guard's own buffer
        assert dst == bytearray(CHUNK_BYTES)
    finally:
        guarded.close()


def test_guarded_breaker_opens_after_failures_and_skips_calls_until_a_probe_succeeds(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvtier")
    disk = DiskTier(tmp_path, NS.digest(), capacity_bytes=16 * 2 * CHUNK_BYTES, io="buffered")
    keys = chain_of(4, 3)
    faulty = FaultyTier(disk, [Fault("get", "raise", keys=frozenset(keys[:2]))])  # a dead backend, twice
    guarded = GuardedTier(faulty, deadline_s=2.0, transfer_deadline_s=2.0, io_threads=2, queue_depth=4,
                          breaker=CircuitBreaker(2, 0.2))
    try:
        for k in keys:
            assert guarded.put(k, payload(k)) is PutResult.STORED
        dst = bytearray(CHUNK_BYTES)
        assert [guarded.get_into(k, memoryview(dst)) for k in keys[:2]] == [GetResult.MISS] * 2  # raised twice
        assert guarded.breaker.state is BreakerState.OPEN
        assert guarded.get_into(keys[2], memoryview(dst)) is GetResult.MISS  # skipped, the inner tier not asked
        w = guarded.wire_stats()
        assert w.errors["get"] == 2 and w.skipped_calls["get"] == 1 and w.breaker_opened == 1
        assert faulty.injected == {"raise": 2}
        time.sleep(0.3)  # past breaker_probe_s: the next call is the probe, and the backend is healthy again
        assert guarded.get_into(keys[2], memoryview(dst)) is GetResult.HIT and dst == bytearray(payload(keys[2]))
        assert guarded.breaker.state is BreakerState.CLOSED
        back = [r for r in caplog.records if "reachable again after" in r.getMessage()]  # one line: the tier is back
        assert len(back) == 1 and back[0].levelno == logging.INFO
        assert guarded.get_into(keys[2], memoryview(dst)) is GetResult.HIT
        assert len([r for r in caplog.records if "reachable again" in r.getMessage()]) == 1  # not per success
    finally:
        guarded.close()


def test_a_fault_rule_refuses_what_its_op_cannot_have():
    with pytest.raises(ValueError, match="a corrupt fault applies to get"):
        Fault("put", "corrupt")


def test_faulty_tier_get_rules_apply_to_the_blob_verbs(tmp_path):
    """FaultyTier's ``get`` rules reach the blob verbs too (drills of a tier's variable-length and
    ranged reads): an ``error`` is a miss without reaching the tier, a ``corrupt`` is counted and
    the key forgotten in the real disk tier, a ``delay`` delays and then reads."""
    disk = DiskTier(tmp_path, NS.digest(), capacity_bytes=1 << 20)
    keys = chain_of(5, 3)
    value = payload(keys[0])[:1001]  # an odd length: the variable-length path
    faulty = FaultyTier(disk, [Fault("get", "error", keys=frozenset({keys[0]}), times=3),
                               Fault("get", "corrupt", keys=frozenset({keys[1]}), times=1),
                               Fault("get", "delay", keys=frozenset({keys[2]}), times=1, delay_s=0.2)])
    try:
        for k in keys:
            assert faulty.put(k, value) is PutResult.STORED
        out = memoryview(bytearray(2048))
        assert faulty.get(keys[0]) is None and faulty.read_into(keys[0], out) is None
        assert faulty.get_range(keys[0], 0, 8) is None and disk.contains(keys[0])  # the tier was not asked
        assert faulty.get(keys[0]) == value  # the rule's three calls are spent
        assert faulty.get_range(keys[1], 0, 8) is None
        assert faulty.corrupt == 1 and not disk.contains(keys[1]) and disk.get(keys[1]) is None
        t0 = time.monotonic()
        assert faulty.read_into(keys[2], out) == 1001 and bytes(out[:1001]) == value
        assert time.monotonic() - t0 >= 0.2
        assert faulty.injected == {"error": 3, "corrupt": 1, "delay": 1}
    finally:
        faulty.close()
