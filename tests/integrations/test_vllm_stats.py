"""The connector's per-step stats are changes of the store's one snapshot (kvtier.core.stats)."""

from kvtier.core.handles import EngineLoad, EngineSave
from kvtier.integrations.vllm.stats import KVTierStats, store_counters, store_gauges
from tests.core.helpers import CHUNK_BYTES, break_disk_shards, chain_of, make_store, payload


def test_step_stats_are_snapshot_deltas_and_tokens_come_from_rank_0_only(tmp_path):
    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=16)
    a = chain_of(1, 3)
    saving = store.prepare_store(a)
    for i, buf in enumerate(saving.buffers):
        buf[:] = i
    store.complete_store(saving, True, EngineSave(3 * store.chunk_tokens, 3 * CHUNK_BYTES, 0.25))
    first = store.stats()
    assert store_counters(first, None) == {"saved_tokens": 3 * store.chunk_tokens, "save_bytes": 3 * CHUNK_BYTES,
                                           "save_seconds": 0.25}
    # the integration reports engine-side facts with each load; the store counts them
    store.complete_load(store.prepare_load(a), True, engine=EngineLoad(
        tokens={"disk": 40}, unfilled_tokens={"disk": 24}, failed_blocks=2, rerouted_chunks=1, engine_bytes=4096,
        seconds=0.5))
    store.load_skipped(EngineLoad(tokens={"cpu": 8}, unfilled_tokens={"cpu": 8}, resumed=True))
    second = store.stats()
    rank0 = store_counters(second, first)
    assert rank0 == {"loaded_tokens_disk": 40, "unfilled_tokens_disk": 24, "reloaded_tokens": 8,
                     "load_failed_blocks": 2, "rerouted_chunks": 1, "load_bytes": 4096, "load_seconds": 0.5}
    assert store_counters(second, first, tp_rank=1) == {"load_bytes": 4096, "load_seconds": 0.5}
    assert store_counters(second, second) == {}
    gauges = store_gauges(second)
    assert gauges["usage_bytes_cpu"] == second.tier("cpu").used_bytes == 3 * CHUNK_BYTES
    assert gauges["capacity_bytes_disk"] == second.tier("disk").capacity_bytes > 0
    # two ranks' stats sum (vLLM's aggregate), as the exported counters do
    both = KVTierStats(data={"counters": dict(rank0), "gauges": dict(gauges)})
    both.aggregate(KVTierStats(data={"counters": store_counters(second, first, 1), "gauges": dict(gauges)}))
    assert both.data["counters"]["load_bytes"] == 8192 and both.data["counters"]["loaded_tokens_disk"] == 40
    assert both.data["gauges"]["usage_bytes_cpu"] == 6 * CHUNK_BYTES
    store.close()


def test_failed_disk_writes_reach_the_step_counters(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=16, write_mode="write-through")
    before = store.stats()
    a = chain_of(3, 2)
    break_disk_shards(store.index.lower[0].tier, a)
    store.put(a, [payload(k) for k in a])
    store.flush()
    assert store_counters(store.stats(), before)["disk_write_errors"] == 2
    store.close()


def test_one_pass_reading_equals_every_reader_on_every_registered_tier():
    """The per-step report reads a snapshot in one pass (stats.store_values, no call per
    counter); it must give what each reader of store_counter_readers gives, for every registered
    tier kind (cpu, disk, the shared ones: wire numbers, codec numbers), every value distinct."""
    from itertools import count

    from kvtier.core.codecstats import CodecNumbers
    from kvtier.core.stats import StoreStats, TierStats, WireStats
    from kvtier.core.tiers import registry
    from kvtier.integrations.vllm.stats import store_values
    from kvtier.integrations.vllm.stats_table import store_counter_readers

    n = count(1)
    names = [spec.name for spec in registry.specs()]
    wire = {t: WireStats(errors={"get": next(n), "put": next(n)}, skipped_calls={"get": next(n)},
                         skipped_writes=next(n), calls={"read": next(n)}, seconds={"read": next(n) / 8},
                         bytes={"read": next(n)}) for t in names}
    codec = {t: CodecNumbers(encoded_bytes=next(n), stored_bytes=next(n), encode_seconds=next(n) / 4,
                             decode_seconds=next(n) / 2, decrypt_failures=next(n)) for t in names}
    tiers = {t: TierStats(evictions=next(n), corrupt_chunks=next(n), write_errors=next(n), reset_chunks=next(n),
                          quota_evictions=next(n), wire=wire[t], codec=codec[t]) for t in names}
    top = registry.top_tier()
    directions = [f"{top}_to_engine", f"engine_to_{top}"]
    snapshot = StoreStats(chunk_bytes=64, chunk_tokens=16, tiers=tiers, dropped_saves=next(n),
                          flush_missed_chunks=next(n), transfer_bytes={d: next(n) for d in directions},
                          transfer_seconds={d: next(n) / 16 for d in directions},
                          loaded_tokens={t: next(n) for t in names}, unfilled_tokens={t: next(n) for t in names},
                          reloaded_tokens=next(n), saved_tokens=next(n), load_failed_blocks=next(n),
                          rerouted_chunks=next(n), ttl_pin_chunks=next(n), ttl_pin_refused_chunks=next(n))
    expected = {name: read(snapshot) for name, read in store_counter_readers().items()}
    assert len(names) >= 3 and all(expected.values())
    assert store_values(snapshot) == expected
    assert store_counters(snapshot, None) == expected
