"""Store-level faults of the shared tier against real redis-server processes.

Each test narrates one fault: ``kill -9``, ``SIGSTOP`` then ``SIGCONT``, a restart with an empty
dataset, and a delaying TCP proxy.  In every one: no wrong byte is served, every lookup and load
returns within the deadline (plus scheduling slack on a loaded 2-core machine), and hits resume
once the server is back.
"""

from __future__ import annotations

import itertools
import time

from ..redis_servers import DelayProxy, wait_until
from .helpers import chain_of, make_store, payload, shared_prefix

DEADLINE_S = 0.3
SLACK_S = 0.7  # thread scheduling on a shared, loaded test machine
FAULT_SETTINGS = {"shared_deadline_s": DEADLINE_S, "shared_transfer_deadline_s": DEADLINE_S, "redis_timeout_s": 0.5, "redis_connect_timeout_s": 0.3,
                  "redis_breaker_failures": 2, "redis_breaker_probe_s": 0.5}


def host(url: str, prefix: str):
    return make_store(None, cpu_chunks=32, redis_url=url, redis_key_prefix=prefix, **FAULT_SETTINGS)


def put_chain(store, chain):
    store.put(chain, [payload(k) for k in chain])
    return store.flush(10)


def timed_lookup(store, chain) -> tuple[int, float]:
    t0 = time.monotonic()
    n = shared_prefix(store, chain)
    return n, time.monotonic() - t0


def remote_load(store, chain, n):
    """Load ``n`` chunks; assert every delivered byte is right; returns (chunks, seconds)."""
    t0 = time.monotonic()
    handle = store.prepare_load(chain, max_chunks=n)
    seconds = time.monotonic() - t0
    assert [buf.tobytes() for buf in handle.buffers] == [payload(k) for k in chain[:handle.num_chunks]]
    store.complete_load(handle, True)
    return handle.num_chunks, seconds


def hits_resume(url, prefix, chain) -> bool:
    """A fresh host (nothing cached locally) finds and loads the whole chain.  Callers retry: a
    loaded machine may miss a tight deadline now and then, which is a miss, never wrong bytes."""
    probe = host(url, prefix)
    try:
        return timed_lookup(probe, chain)[0] == len(chain) and remote_load(probe, chain, len(chain))[0] == len(chain)
    finally:
        probe.close()


def fresh_round_trip(writer, url, prefix, prompts):
    """Write a prompt never written before and read it on the other host (a failed write is not
    retried: the chunk sits in the writer's cpu tier and a new prompt is needed)."""
    def attempt() -> bool:
        chain = chain_of(next(prompts), 4)
        put_chain(writer, chain)
        return hits_resume(url, prefix, chain)
    return attempt


def test_kill9_then_restart_empty(redis_factory, key_prefix):
    server = redis_factory()
    writer, reader = host(server.url, key_prefix), host(server.url, key_prefix)
    before = chain_of(1, 4)
    assert put_chain(writer, before)
    assert wait_until(lambda: hits_resume(server.url, key_prefix, before), timeout_s=10)

    server.kill9()
    for _ in range(4):  # refused connections: misses, fast; the breaker opens
        n, seconds = timed_lookup(reader, before)
        assert n == 0 and seconds < DEADLINE_S + SLACK_S
    got, seconds = remote_load(reader, before, 4)
    assert got == 0 and seconds < DEADLINE_S + SLACK_S
    tier = reader.tier("redis")
    assert tier.breaker.num_opened >= 1
    put_chain(writer, chain_of(2, 3))  # writes while down are skipped and counted, never block
    skipped = writer.tier("redis").skipped_writes
    assert skipped >= 1
    assert writer.metrics.registry.get_sample_value("kvtier_tier_skipped_writes_total", {"tier": "redis"}) == skipped
    assert reader.metrics.registry.get_sample_value("kvtier_tier_breaker_state", {"tier": "redis"}) == 2  # open

    server.start()  # same port, empty dataset
    assert wait_until(fresh_round_trip(writer, server.url, key_prefix, itertools.count(100)), timeout_s=15)
    # the restart lost them: misses, not errors; the reader's breaker closes at its next probe
    assert wait_until(lambda: timed_lookup(reader, before)[0] == 0 and tier.breaker.state == 0, timeout_s=10)


def test_sigstop_then_sigcont(redis_factory, key_prefix):
    server = redis_factory()
    writer, reader = host(server.url, key_prefix), host(server.url, key_prefix)
    chain = chain_of(4, 4)
    assert put_chain(writer, chain)
    assert wait_until(lambda: hits_resume(server.url, key_prefix, chain), timeout_s=10)

    server.pause()  # 3 s here (10 s in the engine-level test): long enough for the breaker to open
    try:
        paused_until = time.monotonic() + 3.0
        worst = 0.0
        while time.monotonic() < paused_until:
            n, seconds = timed_lookup(reader, chain)
            assert n == 0
            worst = max(worst, seconds)
            got, seconds = remote_load(reader, chain, 4)
            assert got == 0
            worst = max(worst, seconds)
        assert worst < DEADLINE_S + SLACK_S, f"a call took {worst:.2f} s while the server was paused"
    finally:
        server.resume()
    assert wait_until(lambda: timed_lookup(reader, chain)[0] == 4 and remote_load(reader, chain, 4)[0] == 4,
                      timeout_s=15)  # the host that saw the pause hits again


def test_delaying_proxy(redis_server, key_prefix):
    proxy = DelayProxy(redis_server.port)
    try:
        writer, reader = host(redis_server.url, key_prefix), host(proxy.url, key_prefix)
        chain = chain_of(5, 4)
        assert put_chain(writer, chain)
        assert wait_until(lambda: hits_resume(proxy.url, key_prefix, chain), timeout_s=10)

        proxy.delay_s = 1.0  # every segment held 1 s each way: slower than the deadline
        for _ in range(3):
            n, seconds = timed_lookup(reader, chain)
            assert n == 0 and seconds < DEADLINE_S + SLACK_S
        got, seconds = remote_load(reader, chain, 4)
        assert got == 0 and seconds < DEADLINE_S + SLACK_S

        proxy.delay_s = 0.0
        assert wait_until(lambda: timed_lookup(reader, chain)[0] == 4 and remote_load(reader, chain, 4)[0] == 4,
                          timeout_s=20)
    finally:
        proxy.close()


def test_restart_empty_then_the_same_chunks_are_written_again(redis_factory, key_prefix):
    """A server restarted empty (or one that evicted on its own) no longer holds what this store
    wrote: a chunk computed again after it left the cpu tier is written again, so the other hosts
    hit it again (found by the engine-level fault test: before, hits never resumed)."""
    server = redis_factory()
    writer = make_store(None, cpu_chunks=4, redis_url=server.url, redis_key_prefix=key_prefix, **FAULT_SETTINGS)
    chain = chain_of(6, 4)
    assert put_chain(writer, chain)
    assert wait_until(lambda: hits_resume(server.url, key_prefix, chain), timeout_s=10)
    server.stop()
    server.start()  # same port, empty dataset
    put_chain(writer, chain_of(7, 4))  # other chunks push the chain out of the 4-chunk cpu tier
    assert writer.lookup(chain) == 0
    assert wait_until(fresh_round_trip(writer, server.url, key_prefix, itertools.count(200)), timeout_s=15)
    assert put_chain(writer, chain)  # computed again: stored in the cpu tier and written to Redis again
    assert wait_until(lambda: hits_resume(server.url, key_prefix, chain), timeout_s=10)
    writer.close()


def test_a_full_server_refusing_writes_keeps_serving_reads(redis_factory, key_prefix):
    """Redis full under its default ``maxmemory-policy noeviction`` answers every SET with -OOM
    but still serves GETs.  The refusals are counted as failed writes; they must not open the
    breaker, or the reads of chunks already there would be skipped too (while another process's
    lookups, whose EXISTS calls succeed, keep promising them: a load retried every step)."""
    server = redis_factory()
    writer, reader = host(server.url, key_prefix), host(server.url, key_prefix)
    try:
        stored = chain_of(7100, 4)
        assert put_chain(writer, stored)
        client = server.client()
        client.config_set("maxmemory", max(1, int(client.info("memory")["used_memory"]) // 2))
        for i in range(6):  # more refused writes than redis_breaker_failures (2)
            put_chain(writer, chain_of(7200 + i, 2))
        wire = writer.stats().tier("redis").wire
        assert wire is not None
        assert wire.errors["put"] >= 3, "the refused writes are counted"
        assert wire.breaker_state == 0 and wire.breaker_opened == 0, "refused writes leave the breaker closed"
        assert timed_lookup(reader, chain_of(7205, 2))[0] == 0  # nothing of them reached the server
        assert timed_lookup(reader, stored)[0] == 4
        assert remote_load(reader, stored, 4)[0] == 4  # byte-exact, checked in remote_load
        # the writer itself still reads from the server (its breaker is closed): drop its cpu copy first
        local = host(server.url, key_prefix)
        try:
            assert remote_load(local, stored, 4)[0] == 4
        finally:
            local.close()
    finally:
        writer.close()
        reader.close()


def test_a_cluster_node_named_without_redis_cluster_logs_one_cause_naming_the_fix(redis_cluster, key_prefix, caplog):
    """A Cluster node's URL without ``redis_cluster: true``: the plain client's commands for keys of
    the other nodes' slots get ``MOVED``.  Each reply named its own slot and node, so every one was
    a new cause for the log limiter (23 WARNING lines for 40 chunks, none naming the fix); now every
    ``MOVED`` is one cause per op that says to set ``redis_cluster``.  Those chunks are not written
    (no wrong byte: they are misses), and the node's own slots still work (probe: /tmp/st57/clustermis.py)."""
    import logging

    caplog.set_level(logging.WARNING, logger="kvtier")
    store = make_store(None, cpu_chunks=64, redis_url=redis_cluster.url, redis_key_prefix=key_prefix,
                       write_mode="write-through", shared_deadline_s=5.0, shared_transfer_deadline_s=5.0)
    chains = [chain_of(900 + i, 1) for i in range(40)]  # one chunk each: a third of them on the named node
    try:
        for chain in chains:
            put_chain(store, chain)
        moved = store.stats().tiers["redis"].wire
        assert moved is not None and moved.errors["put"] > 0 and moved.skipped_writes > 0
    finally:
        store.close()
    store = make_store(None, cpu_chunks=64, redis_url=redis_cluster.url, redis_key_prefix=key_prefix,
                       shared_deadline_s=5.0, shared_transfer_deadline_s=5.0)  # a restart: only the server holds them
    try:
        found = [shared_prefix(store, chain) for chain in chains]
        for chain, n in zip(chains, found):
            handle = store.mover.prepare_load(chain, max_chunks=n)
            assert [b.tobytes() for b in handle.buffers] == [payload(k) for k in chain[:n]]
            store.mover.complete_load(handle, True)
    finally:
        store.close()
    assert 0 < sum(found) < 40, found  # some keys live on the named node, most on the other two (P(none) ~1e-7)
    lines = [r.getMessage() for r in caplog.records if "redis tier" in r.getMessage() and "refused" in r.getMessage()]
    assert len(lines) <= 2 and all("set redis_cluster: true" in line for line in lines), lines
    assert any(" put refused" in line for line in lines)
