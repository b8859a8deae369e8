"""Engines with different ``shared_secret`` settings on one node pool (docs/node.md, "Isolation").

The redis and s3 tiers keep each secret's values in its own key space, so such engines share
nothing.  The node pool indexed values by (namespace, chunk key) alone: an engine with another
secret, or none, found the others' values, failed their digest and deleted them (probe
/tmp/st57/node.py: 4 found, 0 served, 2 counted corrupt, and the writer then found 0).  Now a
value is indexed, fingerprinted and sealed under its pool name in its secret's key space
(:mod:`kvtier.core.tiers.node.names`), and the owner keeps each value's space beside it; the
namespace and tenant record are unchanged, so owner recovery and ``kvtier purge`` work as
before.  Engines with one secret still share everything.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.purge import reset_outside
from kvtier.core.tiers import GetResult, PutResult, TierContext, builtin
from kvtier.core.tiers.node import server
from kvtier.core.tiers.node.names import NO_SPACE, PoolNames, space_hex
from kvtier.core.tiers.node.pool import open_pool
from kvtier.core.tiers.sharedvalue import keyspace
from kvtier.core.tiers.wrappers import unwrap

from .helpers import chain_of, make_store, payload, shared_prefix

SECRETS = {"s1": "node-secret-one-0123456789abcdef", "s2": "node-secret-two-0123456789abcdef"}


def _store(node_server, secret: str | None):
    extra = {"shared_secret": SECRETS[secret]} if secret else {}
    return make_store(None, cpu_chunks=8, write_mode="write-through", node_socket=node_server.socket,
                      shared_deadline_s=5.0, shared_transfer_deadline_s=5.0, tiers=["cpu", "node"], **extra)


@pytest.mark.parametrize("reader", ["s2", None])
def test_an_engine_with_another_secret_neither_finds_nor_deletes_the_values(node_server, reader) -> None:
    """Both ways: the other engine finds none of the s1 engine's values and deletes none, then
    writes its own values of the same chunks beside them; each engine then finds and loads its
    own (none counted corrupt), the other's untouched."""
    chain = chain_of(31, 4)
    writer = _store(node_server, "s1")
    try:
        writer.put(chain, [payload(k) for k in chain])
        assert writer.flush(10)
    finally:
        writer.close()
    other = _store(node_server, reader)
    try:
        found = shared_prefix(other, chain)
        handle = other.mover.prepare_load(chain, max_chunks=found)
        other.mover.complete_load(handle, True)
        corrupt = other.stats().tiers["node"].corrupt_chunks
        other.put(chain, [payload(k)[::-1] for k in chain])  # its own values of the same chunks
        assert other.flush(10)
    finally:
        other.close()
    kept, own = [], []
    for secret, counted in (("s1", kept), (reader, own)):  # each in turn, after the other wrote
        again = _store(node_server, secret)
        try:
            counted.append(shared_prefix(again, chain))
            handle = again.mover.prepare_load(chain, max_chunks=counted[0])
            again.mover.complete_load(handle, True)
            counted.append(again.stats().tiers["node"].corrupt_chunks)
        finally:
            again.close()
    assert (found, corrupt, kept, own) == (0, 0, [4, 0], [4, 0])
    assert node_server.stats().num_values == 8


CHUNK = 4096
TIER_NS = bytes(range(16))


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def data(i: int, secret: str | None) -> bytes:
    """Chunk ``i``'s bytes as the engine with ``secret`` writes them (each space's differ)."""
    return np.random.default_rng([i, {None: 0, "s1": 1, "s2": 2}[secret]]).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


def _config(node_server, secret: str | None) -> KVTierConfig:
    extra = {"shared_secret": SECRETS[secret]} if secret else {}
    return KVTierConfig.from_dict({"node_socket": node_server.socket, "shared_deadline_s": 5.0,
                                   "shared_transfer_deadline_s": 5.0, "node_timeout_s": 5.0, **extra})


def _tier(node_server, secret: str | None):
    """The node tier as an engine with ``secret`` builds it (the plug-in: GuardedTier over NodeTier)."""
    tier = builtin.NODE.build(TierContext(_config(node_server, secret), TIER_NS, CHUNK, 1, CollectorRegistry()))
    assert tier is not None
    return tier


def read(tier, k) -> tuple[GetResult, bytes]:
    out = bytearray(CHUNK)
    return tier.get_into(k, memoryview(out)), bytes(out)


def _until_hit(tier, k) -> None:
    """Wait (at most 10 s) until ``tier`` reads ``k`` again: re-attached to a restarted owner."""
    deadline = time.monotonic() + 10.0
    while read(tier, k)[0] is not GetResult.HIT and time.monotonic() < deadline:
        time.sleep(0.05)


def _three(node_server, n: int) -> dict:
    """An engine of each setting (s1, s2, no secret), each having written chunks 0..n-1 with its bytes."""
    tiers = {s: _tier(node_server, s) for s in ("s1", "s2", None)}
    for s, tier in tiers.items():
        assert tier.put_many([key(i) for i in range(n)], [data(i, s) for i in range(n)]) == [PutResult.STORED] * n
    return tiers


def _each_reads_its_own(tiers: dict, n: int) -> None:
    for s, tier in tiers.items():
        assert [read(tier, key(i)) for i in range(n)] == [(GetResult.HIT, data(i, s)) for i in range(n)], s
        assert sorted(tier.keys()) == [key(i) for i in range(n)], s  # its own, by chunk key
        assert tier.corrupt == 0, s


def test_pool_names_are_a_secrets_own_permutation_of_the_chunk_keys_and_its_space_the_shared_tiers():
    """Without a secret a pool name is the chunk key (an old pool's values stay readable), space 0;
    under each secret another name for every key, undone by that secret alone; the space is the
    first 8 hex digits of the redis and s3 key space segment; a key of another length is refused."""
    keys = [key(i) for i in range(300)]
    plain, one, two = PoolNames(None), PoolNames(SECRETS["s1"].encode()), PoolNames(SECRETS["s2"].encode())
    assert plain.names(keys) == keys and plain.space == NO_SPACE and space_hex(plain.space) == ""
    named = {s: n.names(keys) for s, n in (("s1", one), ("s2", two))}
    assert all(len(n) == 16 for n in named["s1"]) and len(set(named["s1"]) | set(named["s2"]) | set(keys)) == 900
    assert one.keys_of(named["s1"]) == keys and two.keys_of(named["s1"]) != keys
    assert space_hex(one.space) == keyspace(SECRETS["s1"].encode())[:8] != space_hex(two.space)
    with pytest.raises(ValueError, match="16 bytes"):
        one.names([b"short"])


def test_the_same_chunks_of_three_key_spaces_live_side_by_side_and_a_clear_takes_one_space(node_server):
    """One pool, one namespace, the same chunk keys under s1, s2 and no secret: each engine is
    served its own bytes and lists its own chunk keys; a clear (an engine's reset) removes its
    space's values alone, named by their chunk keys.  Two engines of one secret share them."""
    tiers = _three(node_server, 3)
    twin = _tier(node_server, "s1")
    try:
        assert node_server.stats().num_values == 9
        _each_reads_its_own(tiers, 3)
        assert [read(twin, key(i)) for i in range(3)] == [(GetResult.HIT, data(i, "s1")) for i in range(3)]
        assert twin.put(key(0), data(0, "s1")) is PutResult.PRESENT  # one secret, one value
        cleared = tiers["s1"].clear()
        assert cleared.ok and sorted(cleared.keys) == [key(i) for i in range(3)]
        assert [read(twin, key(i))[0] for i in range(3)] == [GetResult.MISS] * 3
        _each_reads_its_own({s: tiers[s] for s in ("s2", None)}, 3)
        assert node_server.stats().num_values == 6
        unwrap(tiers["s2"]).check()
    finally:
        for tier in (*tiers.values(), twin):
            tier.close()


def test_a_restarted_owner_takes_every_key_space_back_each_found_by_its_own_engines(node_server):
    """The owner SIGKILLed and restarted on the warm pool re-indexes every value from its envelope
    and its head, each in its key space: every engine is served its own bytes again, never another
    space's, and none is counted corrupt or deleted."""
    tiers = _three(node_server, 3)
    try:
        node_server.kill()
        node_server.start()
        assert node_server.stats().num_values == 9
        for tier in tiers.values():  # re-attached on a new connection
            _until_hit(tier, key(0))
        _each_reads_its_own(tiers, 3)
        assert node_server.stats().problem == "" and node_server.stats().num_values == 9
    finally:
        for tier in tiers.values():
            tier.close()


def test_a_reset_from_outside_takes_one_key_space_and_purge_every_one(node_server):
    """``reset_outside`` (vLLM's scheduler acknowledging a reset) removes the namespace's values of
    its configuration's key space alone, named by their chunk keys; ``kvtier purge --namespace``
    removes the namespace's values of every space (the namespace is the engine's, unchanged)."""
    tiers = _three(node_server, 2)
    try:
        dry = CliRunner().invoke(app, ["purge", "--node-socket", node_server.socket, "--all", "--dry-run", "--json"])
        assert dry.exit_code == 0 and json.loads(dry.output)["total"]["chunks"] == 6, dry.output
        result = reset_outside("node", _config(node_server, "s2"), TIER_NS)
        assert result is not None and result.ok and sorted(result.keys) == [key(0), key(1)]
        assert [read(tiers["s2"], key(i))[0] for i in range(2)] == [GetResult.MISS] * 2
        _each_reads_its_own({s: tiers[s] for s in ("s1", None)}, 2)
        gone = CliRunner().invoke(app, ["purge", "--node-socket", node_server.socket, "--namespace", TIER_NS.hex(),
                                        "--json"])
        assert gone.exit_code == 0 and json.loads(gone.output)["total"]["chunks"] == 4, gone.output
        assert node_server.stats().num_values == 0
    finally:
        for tier in tiers.values():
            tier.close()


def test_a_secrets_value_an_owner_before_key_spaces_published_is_dropped_once_and_counted(node_server, caplog):
    """A pool an owner before key spaces wrote: its heads carry no space (value bytes + 1 alone).
    Values without a secret are read as before; a value under a secret (a MAC in space 0: no engine
    of this kvtier names it now, whatever its name) is dropped by the next owner, counted in one
    warning, never served or crashed on."""
    tiers = {s: _tier(node_server, s) for s in ("s1", None)}
    try:
        for s, tier in tiers.items():
            assert tier.put(key(0), data(0, s)) is PutResult.STORED
        node_server.kill()
        pool = open_pool(node_server.pool)
        try:
            for page in np.flatnonzero(pool.heads).tolist():  # as an owner before key spaces wrote them
                pool.heads[page] = int(pool.heads[page]) & 0xFFFFFFFF
            names = PoolNames(SECRETS["s1"].encode()).names([key(0)])
            with caplog.at_level(logging.WARNING):
                owner = server.Owner(pool, server.ServeOptions(node_server.pool, 0.0625, node_server.pool))
            assert owner.dropped_unspaced == 1 and len(owner.index.values) == 1
            assert (TIER_NS, bytes(key(0))) in owner.index.values and (TIER_NS, names[0]) not in owner.index.values
            assert any("1 values written under a shared_secret before the pool had key spaces" in r.getMessage()
                       for r in caplog.records)
        finally:
            pool.close()
        node_server.start()  # once dropped, gone: the owner's own restart takes back the value without a secret
        _until_hit(tiers[None], key(0))
        assert read(tiers[None], key(0)) == (GetResult.HIT, data(0, None))
        assert read(tiers["s1"], key(0))[0] is GetResult.MISS
        assert node_server.stats().num_values == 1 and tiers[None].corrupt == tiers["s1"].corrupt == 0
    finally:
        for tier in tiers.values():
            tier.close()
