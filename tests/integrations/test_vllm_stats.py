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
