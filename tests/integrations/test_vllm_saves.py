"""The saver thread's bounds (:mod:`kvtier.integrations.vllm.worker.saves`), on host tensors and a real
store: a full save queue is waited on for a bounded time, counted, and the job dropped (its pages
released); a save whose blocks are given back before it ran is released, never published."""

from __future__ import annotations

import time

import torch

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey, Namespace, chunk_keys
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.cache_groups import GroupKind, GroupSpec
from kvtier.integrations.vllm.protocol import PageMove, SaveJob
from kvtier.integrations.vllm.worker.copy import GroupCopiers
from kvtier.integrations.vllm.worker.layout import detect_layout
from kvtier.integrations.vllm.worker.saves import SaveQueue, save_jobs

BLOCKS, BLOCK_TOKENS, CHUNK = 16, 4, 8  # two blocks per chunk


def _setup() -> tuple[TieredStore, GroupCopiers, dict[str, torch.Tensor]]:
    caches = {f"l{i}": torch.randn(BLOCKS, 2, BLOCK_TOKENS, 8) for i in range(2)}
    layout = detect_layout(caches, BLOCKS, "test")
    group = GroupSpec(index=0, kind=GroupKind.FULL, block_size=BLOCK_TOKENS, layer_names=tuple(caches),
                      window_tokens=0, page_bytes=layout.block_bytes)
    copiers = GroupCopiers((group,), CHUNK, {0: layout}, caches)
    config = KVTierConfig(chunk_tokens=CHUNK, tiers=("cpu",), cpu_gib=16 * copiers.page_bytes / (1 << 30))
    ns = Namespace("saves-test", "float32", 2, 2, 8, layout.describe(), chunk_tokens=CHUNK)
    return TieredStore(config, ns, copiers.page_bytes), copiers, caches


def _job(req: str, seq: int, first_block: int) -> SaveJob:
    keys = chunk_keys(b"\x01" * 16, list(range(seq * 100, seq * 100 + CHUNK)), CHUNK)
    return SaveJob(req, (PageMove(bytes(keys[0]), 0, 0, 0, (first_block, first_block + 1)),), seq=seq)


def test_a_full_save_queue_is_waited_on_counted_and_the_job_dropped_and_a_given_back_save_never_published():
    store, copiers, caches = _setup()
    saver = SaveQueue(store, copiers, token_group=0, chunk_tokens=CHUNK, depth=1, wait_s=0.05)
    jobs = [_job(f"r{i}", i, 2 * i) for i in range(3)]
    try:
        with saver.hold():
            save_jobs(store, copiers, jobs[:1], {}, 0, CHUNK, saver)  # taken by the thread, held before copying
            for _ in range(100):
                if saver._queue.empty():
                    break
                time.sleep(0.01)
            save_jobs(store, copiers, jobs[1:], {}, 0, CHUNK, saver)  # r1 fills the queue, r2 finds it full
            assert saver.backpressure_waits == 1 and saver.backpressure_s >= 0.05 and saver.dropped == 1
            assert not saver.pending("r2") and saver.pending("r0") and saver.pending("r1")
            # r0's blocks are given back (a preemption) while its save cannot run: bounded, then voided
            assert saver.wait_for(["r0"], 0.05) is False
        assert saver.wait_for(None, 10.0) is True
        chain = [ChunkKey(j.pages[0].key) for j in jobs]
        assert [store.lookup(chain[i:i + 1]) for i in range(3)] == [0, 1, 0]  # voided, published, dropped
        assert saver.voided == 1 and saver.completed == 3
        counts = saver.counts()  # what the worker reports each step (kvtier_deferred_save*_total)
        assert (counts["deferred_save_waits"], counts["deferred_saves_dropped"], counts["deferred_saves_voided"]) \
            == (1, 1, 1) and counts["deferred_save_wait_seconds"] >= 0.05
        from kvtier.integrations.vllm.stats_table import counters
        assert {name: counters()[name][0] for name in counts} == {
            "deferred_save_waits": "kvtier_deferred_save_waits", "deferred_save_wait_seconds":
            "kvtier_deferred_save_wait_seconds", "deferred_saves_dropped": "kvtier_deferred_saves_dropped",
            "deferred_saves_voided": "kvtier_deferred_saves_voided"}
        assert sorted(saver.take_ended()) == [0, 1, 2]  # every number reported ended, whatever its end
        assert store.get(chain[1:2])[0] == bytes(torch.cat([caches[n][2:4].reshape(-1) for n in caches])
                                                  .numpy().view("uint8"))  # r1's blocks 2, 3, layer by layer
    finally:
        saver.close(5.0)
        store.close()
