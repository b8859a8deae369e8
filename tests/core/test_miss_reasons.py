"""Why a chunk missed, from facts the store has (issue 35): the ghost lists (:mod:`kvtier.core.ghosts`)
and the reasons a load, a save and a read report to the request's context.

Real tiers throughout: a cpu tier, a disk tier in a temporary directory, a real redis-server
(paused with SIGSTOP for the deadline and the open breaker).  Each test drives the store into one
state an operator meets and checks the reason the request hears, and where a distance applies, the
``kvtier_ghost_hit_distance_bytes`` histogram the store exports.
"""

from __future__ import annotations

import time

from kvtier.core.context import OpContext
from kvtier.core.ghosts import GhostList, Ghosts
from kvtier.core.keys import ChunkKey, Namespace, request_root
from kvtier.core.mover import RequestRecord
from kvtier.core.sinks import Miss

from .helpers import CHUNK_BYTES, CHUNK_TOKENS, NS, chain_of, make_store, payload
from .test_redis_faults import FAULT_SETTINGS


def explain(store, chain, pos: int) -> Miss | None:
    """Save ``chain`` as a request that computed it (vLLM's save after a miss), asking the store
    why chunk ``pos`` was not held; the request's answer."""
    record = RequestRecord(CHUNK_TOKENS)
    handle = store.prepare_store(chain, ctx=OpContext("req", None, record), explain=pos)
    store.complete_store(handle, True)
    return record.explained


def load(store, chain, **kwargs) -> RequestRecord:
    record = RequestRecord(CHUNK_TOKENS)
    handle = store.prepare_load(chain, ctx=OpContext("req", None, record), **kwargs)
    assert handle.wait(30)
    store.complete_load(handle, True)
    return record


def distances(store, tier: str) -> tuple[float, float]:
    """(ghost hits observed, sum of their distances) of ``tier`` in the store's own registry."""
    count = store.metrics.registry.get_sample_value("kvtier_ghost_hit_distance_bytes_count", {"tier": tier})
    total = store.metrics.registry.get_sample_value("kvtier_ghost_hit_distance_bytes_sum", {"tier": tier})
    return count or 0.0, total or 0.0


def test_a_ghost_list_keeps_its_limit_and_measures_the_distance_in_evicted_bytes() -> None:
    ghosts = GhostList("cpu", limit=3, stored_bytes=100)
    keys = [ChunkKey(bytes([i]) * 16) for i in range(5)]
    for i, key in enumerate(keys):
        ghosts.add(key, "evicted", seq=i)
    assert len(ghosts) == 3 and keys[0] not in ghosts and keys[1] not in ghosts  # the oldest two forgotten
    assert ghosts.evicted_bytes == 500
    ghost, distance = ghosts.take(keys[2])
    assert ghost.reason == "evicted" and distance == 200  # keys 3 and 4 were evicted after it
    assert ghosts.take(keys[2]) is None  # asked for again once: forgotten
    ghosts.add(keys[0], "reset", seq=9)  # not an eviction: no bytes, no distance
    assert ghosts.evicted_bytes == 500 and ghosts.take(keys[0])[1] is None
    both = Ghosts([GhostList("cpu", 4, 100), GhostList("disk", 4, 100)])
    both.add("cpu", keys[0], "evicted")
    both.add("disk", keys[0], "purged")  # the later loss is the one that made it unavailable
    assert both.take_all(keys[0]).reason == "purged" and both.hits == {"cpu": 1, "disk": 1}
    assert both.take_distances() == [("cpu", 0)]  # only the eviction has a distance


def test_never_stored_is_new_and_another_tenants_identical_prompt_is_new_too(tmp_path) -> None:
    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=16, write_mode="write-through")
    a = chain_of(1, 3, salt="tenant-a")
    assert explain(store, a, 0) == Miss(0, "", "new")
    assert load(store, a).served_chunks == {"cpu": 3}
    b = chain_of(1, 3, salt="tenant-b")  # the same tokens under another cache_salt: other keys
    assert not set(a) & set(b)
    store.flush()  # the write-through copies are on disk
    for key in a:
        store.index.evict_top(key)  # tenant A's chunks stay on disk and leave ghosts in the cpu tier
    assert load(store, b).miss == Miss(0, "", "new")  # nothing of A's reaches B, not even a reason
    assert explain(store, b, 0) == Miss(0, "", "new")
    assert load(store, a).served_chunks == {"disk": 3}  # while A's are still held
    # the key root folds in the model (namespace) as well as the tenant: another model's prompt is new too
    other = Namespace(model="other-model", kv_dtype=NS.kv_dtype, num_layers=NS.num_layers, num_kv_heads=NS.num_kv_heads,
                      head_size=NS.head_size, layout=NS.layout, chunk_tokens=NS.chunk_tokens)
    assert request_root(other, cache_salt="tenant-a") != request_root(NS, cache_salt="tenant-a")
    store.close()


def test_evicted_from_cpu_then_served_by_disk_names_the_cpu_eviction_and_its_distance(tmp_path) -> None:
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=32)
    first = chain_of(2, 2)
    store.put(first, [payload(k) for k in first])
    fillers = [chain_of(100 + i, 2) for i in range(4)]  # 10 chunks through an 8-chunk cpu tier
    for chain in fillers:
        store.put(chain, [payload(k) for k in chain])
    store.flush()
    assert not store.index.resident(first[0]) and store.index.ghosts.lists["cpu"].get(first[0]).reason == "evicted"
    record = load(store, first)
    assert record.served_chunks == {"disk": 2}
    assert record.below == Miss(0, "disk", "evicted")  # why not from cpu: it evicted them
    hits, total = distances(store, "cpu")
    assert hits == 2  # both chunks promoted back while their ghosts were listed
    # both were evicted by the fillers, one after the other (1 chunk evicted after the first, 0 after
    # the second); the promotion took the first one's ghost, then evicted 1 chunk for its page before
    # it took the second's: 2 chunks in all, whichever order the policy evicted them in
    assert total == 2 * CHUNK_BYTES
    store.close()


def test_evicted_from_disk_too_is_evicted_from_disk(tmp_path) -> None:
    store = make_store(tmp_path, cpu_chunks=2, disk_chunks=4)
    first = chain_of(3, 2)
    store.put(first, [payload(k) for k in first])
    for i in range(3):  # 8 chunks through 2 cpu pages and 4 chunk files: the first two leave both
        chain = chain_of(200 + i, 2)
        store.put(chain, [payload(k) for k in chain])
        store.flush()
    assert store.lookup(first) == 0
    assert load(store, first).miss == Miss(0, "disk", "evicted")  # the disk's loss came last
    assert explain(store, first, 0) == Miss(0, "disk", "evicted")
    assert distances(store, "disk")[0] >= 1
    store.close()


def test_a_victim_the_disks_admission_refuses_is_not_admitted(tmp_path) -> None:
    store = make_store(tmp_path, cpu_chunks=2, disk_chunks=16, admission={"disk": "reused"})
    first = chain_of(4, 2)
    store.put(first, [payload(k) for k in first])  # never used: the disk tier will not take it
    other = chain_of(5, 2)
    store.put(other, [payload(k) for k in other])
    store.flush()
    assert store.lookup(first) == 0
    assert explain(store, first, 1) == Miss(1, "disk", "not_admitted")
    store.close()


def test_a_victim_whose_spill_a_full_queue_drops_is_save_dropped(tmp_path) -> None:
    from kvtier.core.tiers.wrappers import Fault, FaultyTier

    from .helpers import HEADER_BYTES, GiB, KVTierConfig, TieredStore

    values = {"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 4 * CHUNK_BYTES / GiB, "write_mode": "write-back",
              "disk_path": str(tmp_path / "disk"), "disk_gib": 16 * (CHUNK_BYTES + HEADER_BYTES) / GiB,
              "save_queue_depth": 1, "io_threads": 1}
    store = TieredStore(KVTierConfig.from_dict(values), NS, CHUNK_BYTES,
                        wrap=lambda tier: FaultyTier(tier, [Fault("put", "delay", delay_s=0.3)]))
    chains = [chain_of(10 + i, 2) for i in range(4)]
    for chain in chains:  # each save evicts 2 victims whose spills queue behind a slow write
        store.put(chain, [payload(k) for k in chain])
    store.flush()
    reasons = {explain(store, chain, 0).reason for chain in chains[:2] if store.lookup(chain) == 0}
    assert "save_dropped" in reasons, reasons
    store.close()


def test_a_tenants_save_its_quota_leaves_no_room_for_is_quota(tmp_path) -> None:
    store = make_store(tmp_path, cpu_chunks=4, tenant_quotas={"salts": {"small": 0.5}})
    from kvtier.core.tenant import TenantId

    big = TenantId.of("big", None)
    pinned = chain_of(6, 4, salt="big")
    store.put(pinned, [payload(k) for k in pinned], tenant=big)
    held = store.pin_resident(pinned)  # every page pinned: the next save finds no room
    try:
        late = chain_of(7, 2, salt="small")
        record = RequestRecord(CHUNK_TOKENS)
        handle = store.prepare_store(late, ctx=OpContext("req", TenantId.of("small", None), record))
        store.complete_store(handle, True)
        assert handle.num_chunks == 0 and record.dropped_chunks == 2
    finally:
        store.cancel_load(held)
    assert explain(store, late, 0) == Miss(0, "cpu", "quota")
    store.close()


def test_corrupt_purged_and_reset_chunks_say_so(tmp_path) -> None:
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=32, write_mode="write-through", disk_rescan_s=0)
    corrupt, purged, reset = chain_of(20, 2), chain_of(21, 2), chain_of(22, 2)
    for chain in (corrupt, purged, reset):
        store.put(chain, [payload(k) for k in chain])
    store.flush()
    store.clear(["cpu"])  # only on disk now
    disk = store.tier("disk")
    path = disk.path(corrupt[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one payload bit
    path.write_bytes(bytes(data))
    record = load(store, corrupt)
    assert record.miss == Miss(1, "disk", "corrupt") and record.served_chunks == {"disk": 1}
    assert explain(store, corrupt, 1) == Miss(1, "disk", "corrupt")
    disk.path(purged[0]).unlink()  # what kvtier purge does to a file, from outside the engine
    assert load(store, purged).miss == Miss(0, "disk", "purged")  # the read found it gone
    disk.path(purged[1]).unlink()
    store.rescan()  # the engine's rescan notices the other one
    assert explain(store, purged, 1) == Miss(1, "disk", "purged")
    store.clear(["cpu", "disk"])
    assert explain(store, reset, 0).reason == "reset"
    store.close()


def test_a_paused_shared_tier_misses_by_deadline_then_by_its_open_breaker(redis_factory, key_prefix) -> None:
    server = redis_factory()
    writer = make_store(None, cpu_chunks=32, redis_url=server.url, redis_key_prefix=key_prefix, **FAULT_SETTINGS)
    reader = make_store(None, cpu_chunks=32, redis_url=server.url, redis_key_prefix=key_prefix, **FAULT_SETTINGS)
    chain = chain_of(30, 2)
    writer.put(chain, [payload(k) for k in chain])
    assert writer.flush(10)
    server.pause()
    try:
        reasons = []
        deadline = time.monotonic() + 10
        while "breaker_open" not in reasons and time.monotonic() < deadline:
            record = load(reader, chain, max_chunks=2)
            assert record.served_chunks == {}
            reasons.append(record.miss.reason)
            assert record.miss.tier == "redis"
        assert reasons[0] == "deadline" and reasons[-1] == "breaker_open", reasons
    finally:
        server.resume()
    writer.close()
    reader.close()
