"""kvtier's vLLM KV events without an engine: real vLLM ``Request`` s hashed by vLLM's own block
hasher, the scheduler's real :class:`IndexMirror` fed :class:`RankReport` s, and the events
encoded and decoded with vLLM's own ``KVEventBatch`` (what a ZMQ subscriber receives).  The
check everywhere: the (block hash, medium) set the event stream implies equals what the mirror
says the tiers hold."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from kvtier.core.keys import chunk_keys
from kvtier.core.tiers.registry import event_medium
from kvtier.integrations.vllm.protocol import RankReport
from kvtier.integrations.vllm.scheduler.events import EventGroup, KVEventTracker
from kvtier.integrations.vllm.scheduler.reset import forget_mirror
from kvtier.integrations.vllm.scheduler.steps import IndexMirror

BLOCK = 16
CHUNK = 32  # two engine blocks per chunk
ROOT = bytes(range(16))
HASH = get_hash_fn_by_name("sha256")
init_none_hash(HASH)


def ext(hashes: list) -> list:
    """Block hashes as events carry them (vLLM's ``maybe_convert_block_hash``: 64-bit ints by default)."""
    return [maybe_convert_block_hash(h) for h in hashes]


def request(tokens: list[int], req_id: str = "r", salt: str | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, HASH))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def setup(tp: int = 1, **bounds: object) -> tuple[IndexMirror, KVEventTracker, Clock]:
    mirror = IndexMirror(tp)
    clock = Clock()
    tracker = KVEventTracker(mirror.tier, [EventGroup(0, BLOCK, True, "full_attention")], BLOCK, CHUNK,
                             clock=clock, **bounds)  # type: ignore[arg-type]
    return mirror, tracker, clock


def report(changes: list[tuple[bytes, str | None]], full: bool = False) -> RankReport:
    return RankReport(ROOT, changes, full=full)


def apply(mirror: IndexMirror, tracker: KVEventTracker, rank_reports: dict[int, RankReport]) -> None:
    """What ``SchedulerSide.update_connector_output`` does with one step's reports."""
    for rank in sorted(rank_reports):
        mirror.apply(rank, rank_reports[rank])
    if any(r.full for r in rank_reports.values()):
        tracker.observe((), full=True)
    else:
        for r in rank_reports.values():
            tracker.observe(k for k, _ in r.changes)


def wire(events: list) -> list:
    """The events as a ZMQ subscriber decodes them: vLLM's KVEventBatch through msgpack."""
    data = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events))
    return msgspec.msgpack.decode(data, type=KVEventBatch).events


def fold(state: set[tuple[bytes, str]], events: list) -> set[tuple[bytes, str]]:
    for ev in events:
        if isinstance(ev, BlockStored):
            state |= {(h, ev.medium) for h in ev.block_hashes}
        elif isinstance(ev, BlockRemoved):
            state -= {(h, ev.medium) for h in ev.block_hashes}
    return state


def held(mirror: IndexMirror, req: Request, keys: list[bytes]) -> set[tuple[bytes, str]]:
    """(hash, medium) of every block of every chunk the mirror holds."""
    out = set()
    for c, key in enumerate(keys):
        medium = event_medium(mirror.tier(key))
        if medium is not None:
            out |= {(h, medium) for h in ext(req.block_hashes[c * 2:(c + 1) * 2])}
    return out


def test_chunks_appearing_moving_and_leaving_are_stored_and_removed_at_their_medium() -> None:
    mirror, tracker, _ = setup()
    req = request(list(range(1000, 1000 + 4 * CHUNK + 5)))
    keys = [bytes(k) for k in chunk_keys(ROOT, req.all_token_ids, CHUNK)]
    assert len(keys) == 4
    for c, key in enumerate(keys[:3]):
        tracker.record(req, key, 0, c)  # scheduled saves of chunks 0-2
    apply(mirror, tracker, {0: report([(keys[0], "cpu"), (keys[1], "cpu"), (keys[3], "cpu")], full=True)})
    first = wire(tracker.take_events())
    # chunk 3's hashes are unknown (never saved nor looked up here): not announced
    assert [type(e) for e in first] == [BlockStored, BlockStored]
    e0, e1 = first
    assert e0.block_hashes == ext(req.block_hashes[0:2]) and e0.parent_block_hash is None
    assert e1.block_hashes == ext(req.block_hashes[2:4]) and e1.parent_block_hash == ext(req.block_hashes[1:2])[0]
    assert e1.token_ids == list(req.all_token_ids[CHUNK:2 * CHUNK])
    assert (e0.medium, e0.block_size, e0.group_idx, e0.locality, e0.lora_name, e0.extra_keys) == \
        ("CPU", BLOCK, 0, "LOCAL", None, None)
    stream = fold(set(), first)
    assert stream == held(mirror, req, keys[:3])

    # chunk 0 spills to disk and leaves cpu, chunk 1 is evicted, chunk 2 arrives in cpu
    apply(mirror, tracker, {0: report([(keys[0], "disk"), (keys[1], None), (keys[2], "cpu")])})
    second = wire(tracker.take_events())
    removed = [e for e in second if isinstance(e, BlockRemoved)]
    assert [(e.medium, sorted(e.block_hashes)) for e in removed] == [("CPU", sorted(ext(req.block_hashes[0:4])))]
    assert sorted((e.medium, e.block_hashes[0]) for e in second if isinstance(e, BlockStored)) == \
        sorted([("STORAGE", ext(req.block_hashes[0:1])[0]), ("CPU", ext(req.block_hashes[4:5])[0])])
    stream = fold(stream, second)
    assert stream == held(mirror, req, keys[:3])
    assert tracker.take_events() == []  # nothing changed: nothing said
    assert not tracker.pending()
    counters = tracker.take_counters()
    assert counters.pop("kv_events_seconds") > 0
    assert counters == {"kv_events_stored": 4, "kv_events_removed": 2}
    assert tracker.take_counters() == {}  # taken: the next call reports only what changed since


def test_a_chunk_is_announced_only_when_every_rank_holds_it_at_the_slowest_rank_medium() -> None:
    mirror, tracker, _ = setup(tp=2)
    req = request(list(range(2 * CHUNK + 1)))
    keys = [bytes(k) for k in chunk_keys(ROOT, req.all_token_ids, CHUNK)]
    tracker.record(req, keys[0], 0, 0)
    apply(mirror, tracker, {0: report([(keys[0], "cpu")], full=True), 1: report([], full=True)})
    assert tracker.take_events() == []  # rank 1 does not hold it: no load could use it
    apply(mirror, tracker, {1: report([(keys[0], "disk")])})
    events = wire(tracker.take_events())
    assert [(type(e), e.medium) for e in events] == [(BlockStored, "STORAGE")]


def test_a_reset_removes_every_announced_chunk_and_a_saved_again_chunk_is_announced_again() -> None:
    mirror, tracker, _ = setup()
    req = request(list(range(3 * CHUNK)))
    keys = [bytes(k) for k in chunk_keys(ROOT, req.all_token_ids, CHUNK)]
    for c, key in enumerate(keys):
        tracker.record(req, key, 0, c)
    apply(mirror, tracker, {0: report([(keys[0], "cpu"), (keys[1], "disk"), (keys[2], "disk")], full=True)})
    stream = fold(set(), wire(tracker.take_events()))
    assert len(stream) == 6
    forget_mirror(mirror, 1)
    tracker.reset()
    assert tracker.pending()
    stream = fold(stream, wire(tracker.take_events()))
    assert stream == set() and tracker.announced() == {}
    # the rank applied the order: its first report of the new epoch, then the chunk saved again
    apply(mirror, tracker, {0: RankReport(ROOT, [], full=True, epoch=1)})
    apply(mirror, tracker, {0: RankReport(ROOT, [(keys[0], "cpu")], epoch=1)})
    stream = fold(stream, wire(tracker.take_events()))
    assert stream == held(mirror, req, keys)


def test_the_map_is_bounded_and_a_forgotten_announced_chunk_is_removed_or_counted_dropped() -> None:
    mirror, tracker, _ = setup(max_chunks=2, removed_backlog=2)
    req = request(list(range(4 * CHUNK)))
    keys = [bytes(k) for k in chunk_keys(ROOT, req.all_token_ids, CHUNK)]
    apply(mirror, tracker, {0: report([(k, "cpu") for k in keys], full=True)})
    tracker.record(req, keys[0], 0, 0)
    tracker.record(req, keys[1], 0, 1)
    stream = fold(set(), wire(tracker.take_events()))
    tracker.record(req, keys[2], 0, 2)  # keys[0] leaves the map: announced removed (2 hashes fit the backlog)
    tracker.record(req, keys[3], 0, 3)  # keys[1] leaves too: its removal does not fit and is dropped
    events = wire(tracker.take_events())
    stream = fold(stream, events)
    assert {h for h, _ in stream} == set(ext(req.block_hashes[2:8]))  # keys[1]'s dropped removal
    assert len(tracker.announced()) == 2
    counters = tracker.take_counters()
    counters.pop("kv_events_seconds")
    assert counters == {"kv_events_stored": 4, "kv_events_removed": 1, "kv_events_dropped": 1}


def test_stored_events_are_rate_limited_and_none_is_lost() -> None:
    mirror, tracker, clock = setup(stored_per_s=10.0, stored_burst=2)
    req = request(list(range(5 * CHUNK + 1)))
    keys = [bytes(k) for k in chunk_keys(ROOT, req.all_token_ids, CHUNK)]
    for c, key in enumerate(keys):
        tracker.record(req, key, 0, c)
    apply(mirror, tracker, {0: report([(k, "disk") for k in keys], full=True)})
    counts = []
    stream: set[tuple[bytes, str]] = set()
    for _ in range(6):
        events = wire(tracker.take_events())
        counts.append(len(events))
        stream = fold(stream, events)
        clock.now += 0.1  # one token a step at 10 a second
    assert counts == [2, 1, 1, 1, 0, 0]
    assert stream == held(mirror, req, keys) and not tracker.pending()


def test_the_journal_announces_a_restarted_engines_disk_chunks_and_a_foreign_one_is_ignored(tmp_path: Path) -> None:
    mirror, tracker, _ = setup(journal_dir=tmp_path)
    req = request(list(range(3 * CHUNK)), salt="tenant-a")
    keys = [bytes(k) for k in chunk_keys(ROOT, req.all_token_ids, CHUNK)]
    for c, key in enumerate(keys):
        tracker.record(req, key, 0, c)
    apply(mirror, tracker, {0: report([(k, "cpu") for k in keys], full=True)})
    before = wire(tracker.take_events())
    assert before[0].extra_keys == [("tenant-a",), None]  # the cache_salt, on the first block only
    assert tracker.load_journal(ROOT) == 0  # as the scheduler does once the mirror is ready: none yet
    assert tracker.save_journal()

    # the restarted engine: its disk tier holds chunks 0 and 2 (chunk 1 was evicted meanwhile)
    mirror2, tracker2, _ = setup(journal_dir=tmp_path)
    apply(mirror2, tracker2, {0: report([(keys[0], "disk"), (keys[2], "disk")], full=True)})
    assert tracker2.load_journal(ROOT) == 3
    after = wire(tracker2.take_events())
    assert fold(set(), after) == held(mirror2, req, keys)
    stored = [e for e in after if isinstance(e, BlockStored)]
    assert {tuple(e.block_hashes) for e in stored} == {tuple(before[0].block_hashes), tuple(before[2].block_hashes)}
    assert all(e.medium == "STORAGE" and e.token_ids == b.token_ids for e, b in zip(stored, before[::2]))
    # what the stopped engine had announced at CPU (its cpu tier, gone with it) is withdrawn: a router
    # reading the stream across the restart holds what the restarted engine holds, at one medium each
    assert [(e.medium, len(e.block_hashes)) for e in after if isinstance(e, BlockRemoved)] == [("CPU", 6)]
    assert fold(fold(set(), before), after) == held(mirror2, req, keys)

    # a journal written under another block-hash seed names nothing: ignored; garbage too, never raised
    path = next(tmp_path.glob(".kvtier-kv-events-*.msgpack"))
    journal = msgspec.msgpack.decode(path.read_bytes())
    journal[1] = b"another seed"
    path.write_bytes(msgspec.msgpack.encode(journal))
    assert setup(journal_dir=tmp_path)[1].load_journal(ROOT) == 0
    path.write_bytes(b"\x00garbage")
    assert setup(journal_dir=tmp_path)[1].load_journal(ROOT) == 0
    assert setup(journal_dir=tmp_path)[1].load_journal(b"\x01" * 16) == 0  # another namespace: no journal


def test_pages_of_groups_that_are_not_full_attention_are_not_announced() -> None:
    mirror = IndexMirror(1)
    tracker = KVEventTracker(mirror.tier, [EventGroup(0, BLOCK, True), EventGroup(1, BLOCK, False)], BLOCK, CHUNK)
    req = request(list(range(CHUNK + 1)))
    tracker.record(req, b"g1" * 8, 1, 0)
    tracker.record(req, b"g0" * 8, 0, 0)
    apply(mirror, tracker, {0: report([(b"g1" * 8, "cpu"), (b"g0" * 8, "cpu")], full=True)})
    assert [e.group_idx for e in tracker.take_events()] == [0]


@pytest.mark.parametrize("bad", [{"max_chunks": 0}, {"stored_per_s": 0.0}, {"stored_burst": 0}])
def test_bounds_must_be_positive(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        setup(**bad)
