"""The store with a shared redis tier: two stores ("hosts") on one real redis-server.

Narrated: host A saves a prompt; host B, which never saw it, asks (one presence batch, as the
scheduler's remote lookup does: ``shared_prefix``), loads it from Redis, and serves the exact bytes.
The scheduler's "ask again" while the server is slow is tested in tests/integrations/test_vllm_remote.py.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest
import redis

from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import GetResult, PutResult
from kvtier.core.tiers.redis import stream as redisstream
from kvtier.core.tiers.sharedvalue import ValueCodec

from .helpers import chain_of, make_store, payload, shared_prefix
from .tier_harness import make_redis_tier


def put_chain(store, chain):
    return store.put(chain, [payload(k) for k in chain])


def host(url: str, prefix: str, cpu_chunks: int = 16, **settings):
    # a deadline that a loaded 2-core test machine meets (tests/core/test_redis_faults.py uses tight ones)
    values = {"shared_deadline_s": 2.0, "shared_transfer_deadline_s": 2.0, "redis_timeout_s": 2.0, **settings}
    return make_store(None, cpu_chunks=cpu_chunks, redis_url=url, redis_key_prefix=prefix, **values)


def test_prefix_saved_on_host_a_is_a_hit_on_host_b(redis_server, key_prefix):
    a, b = host(redis_server.url, key_prefix), host(redis_server.url, key_prefix)
    chain = chain_of(1, 5)
    assert put_chain(a, chain) == 5
    assert a.flush(10)
    assert b.lookup(chain) == 0  # local tiers only: never the network
    n = shared_prefix(b, chain)
    assert n == 5
    handle = b.prepare_load(chain, max_chunks=n)
    assert handle.tiers == ["redis"] * 5
    assert [buf.tobytes() for buf in handle.buffers] == [payload(k) for k in chain]
    b.complete_load(handle, True)
    assert b.stats().tier("redis").load_hit_chunks == 5
    assert b.lookup(chain) == 5  # promoted into B's cpu tier
    assert b.metrics.registry.get_sample_value("kvtier_load_hit_chunks_total", {"tier": "redis"}) == 5
    for store in (a, b):
        store.check_integrity()
        store.close()


def test_the_redis_tiers_wire_numbers_are_in_the_stores_snapshot_and_its_metrics(redis_server, key_prefix):
    a, b = host(redis_server.url, key_prefix), host(redis_server.url, key_prefix)
    chain = chain_of(3, 4)
    put_chain(a, chain)
    assert a.flush(10)
    assert shared_prefix(b, chain + chain_of(4, 2)) == 4
    handle = b.prepare_load(chain, max_chunks=4)
    b.complete_load(handle, True)
    wrote, read = a.stats().tier("redis").wire, b.stats().tier("redis").wire
    assert wrote is not None and read is not None and a.stats().tier("cpu").wire is None
    assert wrote.bytes["write"] == 4 * len(payload(chain[0])) and wrote.bytes["read"] == 0
    assert read.bytes["read"] == 4 * len(payload(chain[0])) and read.seconds["read"] > 0
    assert (read.lookup_keys, read.lookup_hit_keys) == (6, 4)
    assert (read.breaker_state, read.total_errors, read.skipped_writes) == (0, 0, 0)
    sample = b.metrics.registry.get_sample_value
    assert sample("kvtier_tier_lookup_hit_keys_total", {"tier": "redis"}) == 4
    assert sample("kvtier_tier_bytes_total", {"tier": "redis", "direction": "read"}) == read.bytes["read"]
    assert sample("kvtier_tier_breaker_state", {"tier": "redis"}) == 0
    assert sample("kvtier_tier_errors_total", {"tier": "redis", "op": "get"}) == 0
    for store in (a, b):
        store.close()


def test_local_head_and_remote_tail_form_one_prefix(redis_server, key_prefix):
    a, b = host(redis_server.url, key_prefix), host(redis_server.url, key_prefix)
    chain = chain_of(2, 6)
    put_chain(a, chain)
    a.flush(10)
    put_chain(b, chain[:2])
    assert b.lookup(chain) == 2
    assert shared_prefix(b, chain) == 6
    handle = b.prepare_load(chain, max_chunks=6)
    assert handle.tiers == ["cpu", "cpu"] + ["redis"] * 4
    assert [buf.tobytes() for buf in handle.buffers] == [payload(k) for k in chain]
    b.complete_load(handle, True)
    b.flush(10)
    b.check_integrity()


def test_remote_prefix_stops_at_the_first_gap(redis_server, key_prefix):
    a, b = host(redis_server.url, key_prefix), host(redis_server.url, key_prefix)
    chain = chain_of(3, 5)
    put_chain(a, chain[:3])
    a.flush(10)
    assert shared_prefix(b, chain) == 3
    assert b.get(chain) == [payload(k) for k in chain[:3]]  # get() checks presence first itself


def _redis_tier(store):
    return next(lt.tier for lt in store.index.lower if lt.shared)


def test_shared_secret_rejects_values_written_without_it(redis_server, key_prefix, caplog):
    plain = host(redis_server.url, key_prefix)
    signed = host(redis_server.url, key_prefix, shared_secret="a-secret-of-at-least-16")
    chain = chain_of(5, 3)
    put_chain(plain, chain)  # an engine without the secret
    plain.flush(10)
    assert shared_prefix(signed, chain) == 0  # another key space: never seen, never deleted
    assert signed.stats().corrupt_chunks == 0
    reader = host(redis_server.url, key_prefix)
    assert shared_prefix(reader, chain) == 3  # still there for engines without a secret
    # A writer with access to the server but not the secret (an attacker) plants values under
    # the signed engine's keys: present, but never accepted, and deleted.
    client = redis_server.client()
    for k in chain:
        client.set(_redis_tier(signed).rkey(k), client.get(_redis_tier(plain).rkey(k)))
    assert shared_prefix(signed, chain) == 3
    with caplog.at_level(logging.WARNING):
        handle = signed.prepare_load(chain, max_chunks=3)
    assert handle.num_chunks == 0
    signed.complete_load(handle, True)
    assert signed.stats().corrupt_chunks == 3  # one pipelined batch: each value verified, each deleted
    assert shared_prefix(signed, chain) == 0


def test_engines_with_different_secrets_share_nothing_and_destroy_nothing(redis_server, key_prefix):
    a = host(redis_server.url, key_prefix, shared_secret="a-secret-of-at-least-16")
    b = host(redis_server.url, key_prefix, shared_secret="another-secret-0123456")
    chain = chain_of(6, 3)
    put_chain(a, chain)
    a.flush(10)
    assert shared_prefix(b, chain) == 0
    handle = b.prepare_load(chain)  # asks the shared tier itself: nothing there under b's secret
    assert handle.num_chunks == 0
    b.complete_load(handle, True)
    put_chain(b, chain)  # b writes its own values beside a's
    b.flush(10)
    assert b.stats().corrupt_chunks == 0
    for secret, chunks in (("a-secret-of-at-least-16", 3), ("another-secret-0123456", 3)):
        fresh = host(redis_server.url, key_prefix, shared_secret=secret)  # an empty cpu tier
        assert shared_prefix(fresh, chain) == chunks
        handle = fresh.prepare_load(chain, max_chunks=chunks)
        assert handle.num_chunks == chunks and fresh.stats().corrupt_chunks == 0
        fresh.complete_load(handle, True)
        fresh.close()
    assert _redis_tier(a).rkey(chain[0]) != _redis_tier(b).rkey(chain[0])
    assert b"a-secret" not in _redis_tier(a).rkey(chain[0])  # the key space is derived one-way


def test_keys_spread_over_every_cluster_shard(redis_cluster, key_prefix):
    a = host(redis_cluster.url, key_prefix, cpu_chunks=64, redis_cluster=True)
    b = host(redis_cluster.url, key_prefix, cpu_chunks=64, redis_cluster=True)
    chain = chain_of(6, 30)
    put_chain(a, chain)
    assert a.flush(20)
    per_node = [len(list(n.client().scan_iter(match=f"{key_prefix}*".encode(), count=1000)))
                for n in redis_cluster.nodes]
    assert sum(per_node) == 30 and all(count > 0 for count in per_node), per_node
    assert shared_prefix(b, chain) == 30
    assert b.get(chain) == [payload(k) for k in chain]
    a.close()
    b.close()


def test_server_eviction_is_a_miss_never_wrong_bytes(redis_factory, key_prefix):
    server = redis_factory(extra=("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"))
    tier = make_redis_tier(server.url, bytes(16), key_prefix)
    size = 64 * 1024
    blobs = {i: bytes([i % 251]) * size for i in range(80)}  # 5 MiB into a 2 MiB server
    keys = {i: i.to_bytes(16, "little") for i in blobs}
    for i, blob in blobs.items():
        tier.put(keys[i], blob)
    outs = [bytearray(size) for _ in blobs]
    results = tier.get_many([keys[i] for i in blobs], [memoryview(o) for o in outs])
    assert GetResult.CORRUPT not in results
    assert results.count(GetResult.MISS) > 0 and results.count(GetResult.HIT) > 0
    for i, (result, out) in enumerate(zip(results, outs)):
        if result is GetResult.HIT:
            assert bytes(out) == blobs[i]
    tier.check()
    tier.close()


def test_password_from_env_and_never_logged(redis_factory, key_prefix, monkeypatch, caplog):
    server = redis_factory(extra=("--requirepass", "pw-Zq81-secret"))
    monkeypatch.setenv("TEST_REDIS_PW", "pw-Zq81-secret")
    store = host(server.url, key_prefix, redis_password_env="TEST_REDIS_PW")
    chain = chain_of(7, 2)
    put_chain(store, chain)
    assert store.flush(10)
    authed = redis.Redis(host="127.0.0.1", port=server.port, password="pw-Zq81-secret")
    assert authed.dbsize() == 2  # written with the password from the environment
    with caplog.at_level(logging.DEBUG):
        wrong = host(f"redis://:wrong-Pw-771@127.0.0.1:{server.port}/0", key_prefix)
        assert shared_prefix(wrong, chain) == 0  # refused: a miss, not an exception
    assert "wrong-Pw-771" not in caplog.text and "pw-Zq81-secret" not in caplog.text
    from prometheus_client import generate_latest

    exported = generate_latest(wrong.metrics.registry).decode()
    assert "wrong-Pw-771" not in exported and "redis://***@127.0.0.1" in exported


def test_missing_password_env_is_one_clear_error(redis_server, key_prefix, monkeypatch):
    monkeypatch.delenv("TEST_REDIS_PW_UNSET", raising=False)
    with pytest.raises(ConfigError, match="TEST_REDIS_PW_UNSET"):
        host(redis_server.url, key_prefix, redis_password_env="TEST_REDIS_PW_UNSET")


def test_bad_url_is_one_clear_error():
    with pytest.raises(ConfigError, match="redis:// or rediss://") as err:
        make_store(None, cpu_chunks=4, redis_url="http://user:hunter2-pw@host:6379")
    assert "hunter2-pw" not in str(err.value)


def test_tls_server_round_trip_and_unverifiable_server_is_a_miss(redis_factory, key_prefix, tmp_path):
    from ..redis_servers import TlsFiles

    tls = TlsFiles.make(tmp_path / "tls")
    server = redis_factory(tls=tls)
    assert server.url.startswith("rediss://")
    a = host(server.url, key_prefix, redis_tls_ca_file=str(tls.ca))
    b = host(server.url, key_prefix, redis_tls_ca_file=str(tls.ca))
    chain = chain_of(8, 3)
    put_chain(a, chain)
    assert a.flush(10)
    assert shared_prefix(b, chain) == 3
    assert b.get(chain) == [payload(k) for k in chain]
    # the system CAs do not know the test CA: the handshake fails, and that is a miss, not an error
    untrusted = host(server.url, key_prefix)
    assert shared_prefix(untrusted, chain) == 0 and untrusted.get(chain) == []
    # plain redis:// against the TLS port: also a miss
    plain = host(server.url.replace("rediss://", "redis://"), key_prefix)
    assert shared_prefix(plain, chain) == 0


def test_cluster_down_at_start_is_a_run_of_misses_not_a_failed_start(key_prefix):
    from ..redis_servers import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    store = host(dead, key_prefix, redis_cluster=True, shared_deadline_s=1.0, redis_connect_timeout_s=0.2)
    chain = chain_of(9, 2)
    assert shared_prefix(store, chain) == 0  # the engine starts and serves; the tier misses
    assert store.put(chain, [payload(k) for k in chain]) == 2  # saved locally; the redis write fails
    assert store.flush(10) and store.tier("redis").skipped_writes == 2
    assert store.get(chain) == [payload(k) for k in chain]  # served from the cpu tier
    store.close()


def test_streamed_put_stores_exactly_the_encoded_value_and_a_changed_payload_is_corrupt(redis_server, key_prefix):
    # put_many sends header and payload as two pieces of one SET argument (tiers/redis/stream.py):
    # the server must hold byte for byte what ValueCodec.encode would have joined, with its TTL
    ns = os.urandom(16)
    tier = make_redis_tier(redis_server.url, ns, key_prefix, redis_ttl_s=777)
    assert tier._streamed
    raw = redis.Redis.from_url(redis_server.url)
    keys = [ChunkKey(os.urandom(16)) for _ in range(5)]
    # payloads below and above redisstream.SMALL_BYTES (joined with their framing, or sent apart)
    datas = [np.frombuffer(os.urandom(n), dtype=np.uint8).copy() for n in (1000, 200_000, 5096, 70_000, 17_384)]
    assert tier.put_many(keys, [memoryview(d) for d in datas]) == [PutResult.STORED] * 5
    assert tier.put_many(keys[:2], [memoryview(d) for d in datas[:2]]) == [PutResult.PRESENT] * 2
    for key, data in zip(keys, datas):
        assert raw.get(tier.rkey(key)) == bytes(ValueCodec(ns, None).encode(key, data))
        assert 700 < raw.ttl(tier.rkey(key)) <= 777
    # a payload that changes after its digest was taken (a write abandoned at the deadline, its
    # buffer reused): the reader sees a corrupt value, deletes it, and never serves it
    codec = ValueCodec(ns, None)
    key = ChunkKey(os.urandom(16))
    header = codec.header(key, memoryview(datas[0]))
    changed = datas[0].copy()
    changed[17] ^= 1
    raw.set(tier.rkey(key), header + changed.tobytes())
    dst = np.empty_like(datas[0])
    assert tier.get_many([key], [memoryview(dst)]) == [GetResult.CORRUPT]
    assert raw.exists(tier.rkey(key)) == 0
    tier.close()
    raw.close()


def test_streamed_get_reads_every_reply_shape_and_an_error_reply_leaves_the_pool_usable(redis_server, key_prefix):
    # tiers/redisstream.get_many parses replies itself: values smaller than its 64 KiB line buffer
    # (several replies in one recv), larger ones (received straight into the value), empty, absent
    client = redis.Redis.from_url(redis_server.url, socket_timeout=10)
    sizes = [0, 1, 100, 65_530, 65_536, 70_001, 3 << 20]
    values = {f"{key_prefix}v{i}".encode(): os.urandom(n) for i, n in enumerate(sizes)}
    client.mset(values)
    keys = [*values, f"{key_prefix}absent".encode()]
    taken: list[int] = []

    def take(n: int) -> bytearray:
        taken.append(n)
        return bytearray(n)

    got = redisstream.get_many(client, keys * 2, take)
    assert [None if v is None else bytes(v) for v in got] == [*values.values(), None] * 2
    assert taken == sizes * 2
    client.rpush(f"{key_prefix}list".encode(), b"x")  # a GET of a list is an error reply (WRONGTYPE)
    with pytest.raises(redisstream.ReplyError, match="WRONGTYPE"):
        redisstream.get_many(client, [keys[0], f"{key_prefix}list".encode(), keys[1]], take)
    assert [bytes(v) for v in redisstream.get_many(client, keys[:2], take)] == list(values.values())[:2]
    assert client.ping()
    client.delete(*keys, f"{key_prefix}list".encode())
    client.close()


def test_a_put_to_a_paused_server_fails_within_the_deadline_and_the_next_one_is_whole(redis_factory, key_prefix):
    # the streamed writer may be mid-value when the caller gives up: its connection is dropped, so
    # the server never stores a partial value, and every value read back afterwards is whole
    server = redis_factory()
    ns = os.urandom(16)
    tier = make_redis_tier(server.url, ns, key_prefix, shared_transfer_deadline_s=0.5, redis_timeout_s=1.0)
    keys = [ChunkKey(os.urandom(16)) for _ in range(8)]
    datas = [np.frombuffer(os.urandom(4 << 20), dtype=np.uint8).copy() for _ in keys]  # beyond socket buffers
    assert tier.put_many(keys[:1], [memoryview(datas[0])]) == [PutResult.STORED]  # connected
    server.pause()
    try:
        t0 = time.monotonic()
        assert tier.put_many(keys[1:], [memoryview(d) for d in datas[1:]]) == [PutResult.FAILED] * 7
        assert time.monotonic() - t0 < 0.5 + 0.7  # the deadline, plus scheduling slack on a loaded machine
    finally:
        server.resume()
    time.sleep(1.5)  # the abandoned writer's socket times out and is dropped
    # the SETs the kernel had taken in full may have run once the server resumed (whole values,
    # PRESENT now); a half-sent one was discarded with its connection (STORED now)
    again = tier.put_many(keys[1:], [memoryview(d) for d in datas[1:]])
    assert set(again) <= {PutResult.STORED, PutResult.PRESENT} and PutResult.STORED in again
    dsts = [np.empty_like(d) for d in datas]
    assert tier.get_many(keys, [memoryview(d) for d in dsts]) == [GetResult.HIT] * 8
    assert all(np.array_equal(a, b) for a, b in zip(dsts, datas))
    assert tier.wire_stats().skipped_writes == 7
    tier.close()
