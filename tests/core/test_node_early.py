"""Early copies (:mod:`kvtier.core.tiers.node.early`) with a real owner: a value this engine wrote
or pinned before is copied and verified while its pin is in flight and served only where the pin's
answer names the same pages and generation; anything else is copied again after the answer, or is
a miss, never the early bytes."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import GetResult, PutResult, TierContext, builtin
from kvtier.core.tiers.node import tier as tier_module
from kvtier.core.tiers.node.client import NodeClient
from kvtier.core.tiers.node.early import Locations
from kvtier.core.tiers.node.tier import NodeTier
from kvtier.core.tiers.wrappers import unwrap

CHUNK = 8192
NS = bytes(range(16))


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def data(i: int) -> bytes:
    return np.random.default_rng(100 + i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


def engine_tier(socket: str):
    """The node tier as an engine builds it (GuardedTier over NodeTier), verifying inline: the only
    way early copies are made (on 2 CPUs the measured way is inline too)."""
    config = KVTierConfig.from_dict({"node_socket": socket, "shared_deadline_s": 2.0,
                                     "shared_transfer_deadline_s": 2.0, "node_timeout_s": 2.0})
    tier = builtin.NODE.build(TierContext(config, NS, CHUNK, 1, CollectorRegistry()))
    assert tier is not None
    inner = unwrap(tier)
    assert isinstance(inner, NodeTier)
    inner.verifier.overlap = False
    return tier, inner


def read_all(tier, keys: list[ChunkKey]) -> tuple[list[GetResult], list[bytes]]:
    outs = [bytearray(CHUNK) for _ in keys]
    got = tier.get_many(keys, [memoryview(o) for o in outs])
    return got, [bytes(o) for o in outs]


def test_values_this_engine_wrote_or_pinned_are_copied_early_and_served_exactly(node_server):
    """The writer serves its own values from early copies at its first read; another engine reads
    them the ordinary way first (it has never seen where they lie) and early from then on."""
    writer, mine = engine_tier(node_server.socket)
    reader, theirs = engine_tier(node_server.socket)
    keys = [key(i) for i in range(4)]
    try:
        assert writer.put_many(keys, [data(i) for i in range(4)]) == [PutResult.STORED] * 4
        assert read_all(writer, keys) == ([GetResult.HIT] * 4, [data(i) for i in range(4)])
        assert mine.early_reads == 4
        assert read_all(reader, keys) == ([GetResult.HIT] * 4, [data(i) for i in range(4)])
        assert theirs.early_reads == 0
        assert read_all(reader, keys) == ([GetResult.HIT] * 4, [data(i) for i in range(4)])
        assert theirs.early_reads == 4
    finally:
        writer.close()
        reader.close()


def test_an_early_copy_the_pins_answer_does_not_confirm_is_never_served(node_server):
    """A remembered place that now holds another value (here: the place of key 2 noted for key 1):
    the early copy into key 1's buffer fails its header check, the pin names key 1's real place, so
    key 1 is copied again from there and served exactly, with nothing counted corrupt or deleted.
    A value moved since is copied again from where the pin says too."""
    tier, inner = engine_tier(node_server.socket)
    other = NodeTier(NodeClient(node_server.socket, 5.0, "other"), NS, None, 5.0)
    try:
        assert tier.put_many([key(1), key(2)], [data(1), data(2)]) == [PutResult.STORED] * 2
        pool = inner.client.pool
        assert pool is not None
        where_2 = inner.locations.lookup(pool, [bytes(key(2))])[0]
        assert where_2 is not None
        inner.locations.note(pool, [(bytes(key(1)), where_2)])
        assert read_all(tier, [key(1)]) == ([GetResult.HIT], [data(1)])
        assert inner.early_reads == 0 and inner.corrupt == 0
        assert node_server.stats().num_values == 2
        # moved by another engine (deleted, written again elsewhere): the old pages, not granted
        # again, still hold the old bytes under the old generation; the early copy of them is
        # not what the pin names, so it is not served
        where_1 = inner.locations.lookup(pool, [bytes(key(1))])[0]
        assert where_1 is not None
        assert other.delete(key(1)) and other.put(key(3), data(3)) is PutResult.STORED
        assert other.put(key(1), data(1)) is PutResult.STORED
        assert read_all(tier, [key(1)]) == ([GetResult.HIT], [data(1)])
        assert inner.early_reads == 0  # copied again after the pin, from where the owner said
        assert inner.locations.lookup(pool, [bytes(key(1))])[0] not in (None, where_1)
        assert read_all(tier, [key(1), key(3)]) == ([GetResult.HIT] * 2, [data(1), data(3)])
        assert inner.early_reads == 1  # key 1, noted at its new place by the last pin (key 3: never seen here)
    finally:
        tier.close()
        other.close()


def test_an_early_copy_whose_pages_change_generation_after_it_is_never_served(node_server, monkeypatch):
    """Key 1 copied early, then its pages given a newer generation (as a grant to another writer after
    the pin's lease ran out would) before the answer is read: the answer still names the old place
    and generation, but the batch's generation check after every copy refuses it: a miss, never the
    early bytes; key 2 beside it is served.  With the generation back, key 1 is served again."""
    tier, inner = engine_tier(node_server.socket)
    real = tier_module.copy_early
    bumped: list[int] = []

    def copy_then_bump(verifier, locations, pool, keys, dsts, until):
        out = real(verifier, locations, pool, keys, dsts, until)
        where = locations.lookup(pool, [bytes(key(1))])[0]
        assert where is not None and 0 in out  # key 1 (first) was copied early
        pool.gens[where[0]] += 1
        bumped.append(where[0])
        return out
    try:
        assert tier.put_many([key(1), key(2)], [data(1), data(2)]) == [PutResult.STORED] * 2
        monkeypatch.setattr(tier_module, "copy_early", copy_then_bump)
        got, outs = read_all(tier, [key(1), key(2)])
        assert got == [GetResult.MISS, GetResult.HIT] and outs[1] == data(2)
        assert inner.early_reads == 1 and inner.corrupt == 0
        monkeypatch.setattr(tier_module, "copy_early", real)
        inner.client.pool.gens[bumped[0]] -= 1  # (the owner's view again)
        assert read_all(tier, [key(1), key(2)]) == ([GetResult.HIT] * 2, [data(1), data(2)])
    finally:
        tier.close()


def test_an_owner_that_does_not_answer_serves_nothing_from_early_copies(node_server):
    """SIGSTOP of the owner: the pin is sent and the early copies are made (the pool is mapped), but
    without the answer nothing is served: misses within the deadline, as without early copies."""
    tier, inner = engine_tier(node_server.socket)
    try:
        assert tier.put_many([key(1), key(2)], [data(1), data(2)]) == [PutResult.STORED] * 2
        node_server.pause()
        try:
            got, _ = read_all(tier, [key(1), key(2)])
            assert got == [GetResult.MISS] * 2 and inner.early_reads == 0
        finally:
            node_server.resume()
        assert read_all(tier, [key(1), key(2)]) == ([GetResult.HIT] * 2, [data(1), data(2)])
        assert inner.early_reads == 2
    finally:
        tier.close()


def test_locations_are_bounded_per_pool_and_forgotten_with_their_pool():
    """The oldest noted place goes first past the bound; a note on another pool (the owner made a
    new one) forgets every place of the old."""
    first, second = object(), object()
    places = Locations(max_entries=3)
    places.note(first, [(bytes([i]), (i, 10, 1)) for i in range(5)])  # type: ignore[arg-type]
    assert len(places) == 3
    assert places.lookup(first, [bytes([i]) for i in range(5)]) == [None, None, (2, 10, 1), (3, 10, 1), (4, 10, 1)]  # type: ignore[arg-type]
    places.note(first, [(bytes([3]), None)])  # type: ignore[arg-type]
    assert places.lookup(first, [bytes([3])]) == [None]  # type: ignore[arg-type]
    assert places.lookup(second, [bytes([2])]) == [None]  # type: ignore[arg-type]
    places.note(second, [(bytes([9]), (9, 10, 2))])  # type: ignore[arg-type]
    assert len(places) == 1 and places.lookup(first, [bytes([2])]) == [None]  # type: ignore[arg-type]
