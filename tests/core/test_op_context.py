"""A request's context travels explicitly into the store (issue 33 item 4): its load's and save's
events reach the request's own sink, on whatever thread learned them, with the right tier, counts
and reasons; and the store's counters (what ``/metrics`` shows) count the same numbers with or
without a request's sink."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.context import (
    ChunkMissed,
    ChunksRead,
    ChunksServed,
    EngineLoad,
    EngineSave,
    Event,
    LoadCut,
    OpContext,
    Saved,
    SaveDropped,
    WriteDropped,
)
from kvtier.core.mover import RequestRecord, Tee
from kvtier.core.sinks import Miss
from kvtier.core.store import TieredStore
from kvtier.core.tenant import TenantId
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.core.tiers.wrappers import Fault, FaultyTier

from .helpers import CHUNK_BYTES, CHUNK_TOKENS, NS, chain_of, make_store, payload


class Events:
    """A sink that keeps every event in order, with the thread that emitted it."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.threads: set[str] = set()

    def emit(self, event: Event) -> None:
        self.events.append(event)
        self.threads.add(threading.current_thread().name)

    def of(self, kind: type) -> list[Event]:
        return [e for e in self.events if isinstance(e, kind)]


def on_disk(tmp_path, num_chunks, **overrides):
    """A restarted store whose chain of ``num_chunks`` chunks lives only on disk."""
    first = make_store(tmp_path, cpu_chunks=16, disk_chunks=32, write_mode="write-through")
    chain = chain_of(5, num_chunks)
    assert first.put(chain, [payload(k) for k in chain]) == num_chunks
    first.close()
    return make_store(tmp_path, cpu_chunks=16, disk_chunks=32, **overrides), chain


def flip(store, key):
    path = store.tier("disk").path(key)
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 7] ^= 0x40
    path.write_bytes(bytes(raw))


def test_a_load_from_cpu_and_disk_reaches_the_requests_record_by_tier(tmp_path):
    store, chain = on_disk(tmp_path, 6)
    assert len(store.get(chain[:2])) == 2  # chunks 0-1 promoted into the cpu tier; 2-5 only on disk
    record, events = RequestRecord(CHUNK_TOKENS), Events()
    before = store.stats()
    handle = store.prepare_load(chain, ctx=OpContext("req-1", None, Tee(record, events)))
    assert handle.tiers == ["cpu", "cpu", "disk", "disk", "disk", "disk"]
    assert [b.tobytes() for b in handle.buffers] == [payload(k) for k in chain]
    store.complete_load(handle, True, engine=EngineLoad(tokens={"disk": 6 * CHUNK_TOKENS}, engine_bytes=4096,
                                                        seconds=0.5))
    assert record.served_chunks == {"cpu": 2, "disk": 4}
    assert record.served_tokens() == {"cpu": 2 * CHUNK_TOKENS, "disk": 4 * CHUNK_TOKENS}
    assert record.read_chunks == {"disk": 4} and record.read_bytes == {"disk": 4 * CHUNK_BYTES}
    assert record.read_seconds["disk"] > 0 and "cpu" not in record.read_seconds
    assert record.loaded_tokens == {"disk": 6 * CHUNK_TOKENS} and record.load_seconds == 0.5
    assert record.miss is None and record.failed_loads == 0
    assert events.of(ChunksServed) == [ChunksServed({"cpu": 2, "disk": 4})]
    assert not events.of(ChunkMissed) and not events.of(LoadCut)
    # the store's counters saw the same load: the metrics sink is fed alongside the request's
    after = store.stats()
    assert after.tier("disk").load_hit_chunks - before.tier("disk").load_hit_chunks == 4
    assert after.tier("cpu").load_hit_chunks - before.tier("cpu").load_hit_chunks == 2
    assert after.transfer_bytes["disk_to_cpu"] - before.transfer_bytes["disk_to_cpu"] == 4 * CHUNK_BYTES
    assert after.transfer_bytes["cpu_to_engine"] - before.transfer_bytes["cpu_to_engine"] == 4096
    assert after.loaded_tokens["disk"] - before.loaded_tokens["disk"] == 6 * CHUNK_TOKENS
    store.check_integrity()
    store.close()


def test_a_corrupt_chunk_cuts_the_load_with_its_index_tier_and_reason(tmp_path):
    store, chain = on_disk(tmp_path, 5)
    flip(store, chain[2])
    record, events = RequestRecord(CHUNK_TOKENS), Events()
    handle = store.prepare_load(chain, ctx=OpContext("req-2", None, Tee(record, events)))
    assert handle.num_chunks == 2
    store.complete_load(handle, True)
    assert record.miss == Miss(2, "disk", "corrupt")
    assert events.of(ChunkMissed) == [ChunkMissed(2, "disk", "corrupt")]
    assert events.of(LoadCut) == [LoadCut(2, "disk", "corrupt", 3)]  # chunks 2, 3 and 4 were planned
    assert record.served_chunks == {"disk": 2}
    assert record.read_chunks == {"disk": 4}  # 3 and 4 arrived verified, but after the cut nothing is served
    assert store.stats().corrupt_chunks == 1
    store.check_integrity()
    store.close()


def test_chunks_no_tier_holds_end_the_load_as_new(tmp_path):
    store = make_store(tmp_path, cpu_chunks=8)
    chain = chain_of(3, 6)
    assert store.put(chain[:4], [payload(k) for k in chain[:4]]) == 4
    record = RequestRecord(CHUNK_TOKENS)
    assert len(store.get(chain, ctx=OpContext("req-3", None, record))) == 4
    assert record.miss == Miss(4, "", "new") and record.served_chunks == {"cpu": 4}  # never stored
    store.check_integrity()
    store.close()


def test_read_ahead_reports_from_its_own_thread_to_the_same_record(tmp_path):
    store, chain = on_disk(tmp_path, 6, io_threads=2)
    flip(store, chain[4])
    record, events = RequestRecord(CHUNK_TOKENS), Events()
    handle = store.prepare_load(chain, read_ahead=True, ctx=OpContext("req-4", None, Tee(record, events)))
    assert handle.pending is not None and handle.wait(30.0)
    store.complete_load(handle, True)
    assert any(name.startswith("kvtier-read-ahead") for name in events.threads)
    assert record.miss == Miss(4, "disk", "corrupt") and record.served_chunks == {"disk": 4}
    assert [e.chunks for e in events.of(ChunksRead)] == [2, 2, 1]  # batches of io_threads; chunk 4 failed
    store.check_integrity()
    store.close()


def test_a_saves_events_and_tenant_come_from_its_context(tmp_path):
    store = make_store(tmp_path, cpu_chunks=4)
    tenant = TenantId.of("acme", None)
    record, events = RequestRecord(CHUNK_TOKENS), Events()
    ctx = OpContext("req-5", tenant, Tee(record, events))
    chain = chain_of(9, 6)
    handle = store.prepare_store(chain, ctx=ctx)
    assert handle.num_chunks == 4 and handle.tenant == tenant  # four pages: two chunks find no room
    for buf, key in zip(handle.buffers, handle.keys):
        buf[:] = memoryview(payload(key))
    store.complete_store(handle, True, EngineSave(4 * CHUNK_TOKENS, 4 * CHUNK_BYTES, 0.1))
    assert events.of(SaveDropped) == [SaveDropped(2, "no_room")] and events.of(Saved) == [Saved(4)]
    assert record.saved_chunks == 4 and record.dropped_chunks == 2 and record.saved_tokens == 4 * CHUNK_TOKENS
    assert all(store.index.tenant.get(k) == tenant for k in chain[:4])  # the context's tenant is written with them
    s = store.stats()
    assert s.saved_chunks == 4 and s.dropped_saves == 2 and s.saved_tokens == 4 * CHUNK_TOKENS
    with pytest.raises(ValueError, match="not both"):
        store.prepare_store(chain, tenant=tenant, ctx=ctx)
    store.check_integrity()
    store.close()


def test_the_counters_count_the_same_with_or_without_a_requests_sink(tmp_path):
    """The same operations on two stores, one with a request's record teed in: equal snapshots."""
    snapshots = []
    for i, with_record in enumerate((False, True)):
        store, chain = on_disk(tmp_path / str(i), 6)
        flip(store, chain[3])
        ctx = OpContext("req-6", None, RequestRecord(CHUNK_TOKENS)) if with_record else None
        other = chain_of(11, 6)
        store.put(other, [payload(k) for k in other], ctx=ctx)
        store.lookup(chain, ctx=ctx)
        store.complete_load(store.prepare_load(chain, ctx=ctx), True, engine=EngineLoad(tokens={"disk": 12}))
        store.complete_load(store.prepare_load(other, ctx=ctx), False)
        store.ttl_pin(other[:2], 60.0, ctx=ctx)
        store.load_skipped(EngineLoad(unfilled_tokens={"cpu": 8}), ctx=ctx)
        store.flush()
        snapshots.append(dataclasses.replace(store.stats(), transfer_seconds={}))
        store.close()
    plain, teed = snapshots
    assert plain == teed
    assert plain.tier("disk").load_hit_chunks == 3 and plain.failed_loads == 1 and plain.ttl_pin_chunks == 2


def faulty_disk_store(tmp_path, rules, **overrides):
    """A store whose disk tier injects ``rules`` (:class:`FaultyTier`)."""
    values = {"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 16 * CHUNK_BYTES / GiB, "disk_path": str(tmp_path / "disk"),
              "disk_gib": 32 * (CHUNK_BYTES + HEADER_BYTES) / GiB, **overrides}
    return TieredStore(KVTierConfig.from_dict(values), NS, CHUNK_BYTES, wrap=lambda tier: FaultyTier(tier, rules))


def test_a_disk_read_that_fails_is_a_load_failed_chunk(tmp_path):
    store = faulty_disk_store(tmp_path, [], write_mode="write-through")
    chain = chain_of(13, 4)
    assert store.put(chain, [payload(k) for k in chain]) == 4
    store.flush()
    store.clear(["cpu"])  # the chunks are now only on disk
    store.tier("disk").rules.append(Fault("get", "error", keys=frozenset([chain[1]])))
    record = RequestRecord(CHUNK_TOKENS)
    handle = store.prepare_load(chain, ctx=OpContext("req-7", None, record))
    assert handle.num_chunks == 1
    store.complete_load(handle, True)
    assert record.miss == Miss(1, "disk", "load_failed") and record.served_chunks == {"disk": 1}
    assert record.below == Miss(0, "disk", "reset")  # read from disk: the cpu tier had been reset
    store.check_integrity()
    store.close()


def test_writes_a_full_queue_refused_reach_the_saving_request(tmp_path):
    """Write-through with one queue slot and a slow disk: most of a save's writes are dropped; the
    request hears of each, per tier, and the counters count each once."""
    store = faulty_disk_store(tmp_path, [Fault("put", "delay", delay_s=0.5)], write_mode="write-through",
                              save_queue_depth=1, io_threads=1)
    record, events = RequestRecord(CHUNK_TOKENS), Events()
    chain = chain_of(17, 6)
    before = store.stats().dropped_saves
    assert store.put(chain, [payload(k) for k in chain], ctx=OpContext("req-8", None, Tee(record, events))) == 6
    dropped = store.stats().dropped_saves - before
    assert dropped >= 4  # one write running, one queued, at most
    assert events.of(WriteDropped) == [WriteDropped("disk", dropped, "queue_full")]
    assert record.unwritten_chunks == {"disk": dropped} and record.saved_chunks == 6
    store.flush()
    store.close()
