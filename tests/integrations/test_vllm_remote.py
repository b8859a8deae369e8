"""The scheduler's shared-tier lookups (kvtier.integrations.vllm.scheduler.remote) against real redis-servers.

Stores stand in for the workers of another engine (one per tensor-parallel rank, each with its
own namespace, as under vLLM); the scheduler-side :class:`RemoteLookups` asks Redis about their
pages as the scheduler does (``poll_pages``: the page keys no local tier holds) and must never
block: "ask again" (``None``) until the answer is in, bounded by ``shared_deadline_s``; a dead
server is a prompt miss.  The engine-level version is
tests/integrations/test_vllm_redis_tier.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from kvtier.core.config import KVTierConfig
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.scheduler.remote import RemoteLookups, shared_tier_configured
from tests.core.helpers import CHUNK_BYTES, CHUNK_TOKENS, NS, chain_of, payload
from tests.redis_servers import DelayProxy


def _config(url: str, prefix: str, **settings: object) -> KVTierConfig:
    values = {"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 16 * CHUNK_BYTES / 2**30, "redis_url": url,
              "redis_key_prefix": prefix, "shared_deadline_s": 2.0, "redis_timeout_s": 2.0, **settings}
    return KVTierConfig.from_dict(values)


def _rank(url: str, prefix: str, tp_rank: int, chain, tp_size: int = 1) -> tuple[TieredStore, bytes]:
    """A worker rank's store that saved ``chain`` (written through to Redis); its namespace digest."""
    namespace = dataclasses.replace(NS, tp_size=tp_size, tp_rank=tp_rank)
    store = TieredStore(_config(url, prefix), namespace, CHUNK_BYTES, tp_size)
    assert store.put(chain, [payload(k) for k in chain]) == len(chain)
    assert store.flush(10)
    return store, namespace.digest()


def _answer(lookups: RemoteLookups, req_id: str, keys, timeout_s: float = 10.0) -> tuple[frozenset[bytes], int]:
    """Poll as the scheduler does once per step: (the keys found, number of "ask again" replies before it)."""
    asks = 0
    end = time.monotonic() + timeout_s
    while (found := lookups.poll_pages(req_id, keys)) is None:
        asks += 1
        assert time.monotonic() < end, "the lookup never answered"
        time.sleep(0.01)
    return found, asks


def test_a_prefix_another_engine_saved_is_found_without_blocking(redis_server, key_prefix):
    chain = chain_of(11, 6)
    store, namespace = _rank(redis_server.url, key_prefix, 0, chain)
    proxy = DelayProxy(redis_server.port, delay_s=0.2)  # a server the step must not wait for
    # deadlines a loaded 2-core machine meets through the proxy (connection set-up is 2 round trips more)
    lookups = RemoteLookups(_config(proxy.url, key_prefix, shared_deadline_s=5.0, redis_timeout_s=5.0))
    try:
        assert not lookups.bind([b""])  # the worker's namespace not reported yet: no lookup
        assert lookups.bind([namespace])
        t0 = time.perf_counter()
        assert lookups.poll_pages("r1", chain) is None  # ask again
        assert time.perf_counter() - t0 < 0.1  # never waits on the network
        found, asks = _answer(lookups, "r1", chain)
        assert (found, lookups.asked, lookups.timed_out) == (set(chain), 1, 0)
        assert asks >= 1
        assert lookups.poll_pages("r1", chain) == set(chain) and lookups.asked == 1  # asked again: the known answer
        # pages saved locally since are no longer asked: the answer known covers the rest, nothing sent
        assert lookups.poll_pages("r1", chain[2:]) == set(chain[2:]) and lookups.asked == 1
        lookups.forget("r1")
        other = chain_of(12, 3)
        assert _answer(lookups, "r2", other)[0] == frozenset()  # never saved: a miss
        # what the scheduler-side connector exports (kvtier_shared_lookups_*): 6 of 9 pages found
        assert lookups.counters() == {"shared_lookups": 2, "shared_lookups_answered": 2, "shared_lookups_timed_out": 0,
                                      "shared_lookups_superseded": 0, "shared_lookups_skipped": 0,
                                      "shared_lookup_chunks": 6 + 3, "shared_lookup_hit_chunks": 6,
                                      "shared_lookup_sealed_away_chunks": 0}
        assert lookups.pending == 0
    finally:
        lookups.close()
        proxy.close()
        store.close()


def test_values_sealed_under_another_master_key_are_never_found_and_counted_once(redis_server, key_prefix, tmp_path):
    """Issue 36: the scheduler's lookups with a key ring read each value's header and key id, so a
    prefix another engine saved under a master key this one does not hold is never offered (however
    often it is asked), each value counted once in ``shared_lookup_sealed_away_chunks`` and left in
    Redis; with the key that sealed it, the same lookup finds it."""
    import redis

    keys = {}
    for name, text in (("a", "first-master-key-0123456789abcdef0123456789"),
                       ("b", "second-master-key-0123456789abcdef0123456789")):
        keys[name] = tmp_path / f"key-{name}"
        keys[name].write_text(text, encoding="utf-8")

    def sealed(name: str) -> dict:
        return {"codecs": {"redis": ["aes-256-gcm"]}, "encryption": {"master_key_file": str(keys[name])}}
    chain = chain_of(13, 4)
    namespace = NS.digest()
    store = TieredStore(_config(redis_server.url, key_prefix, **sealed("a")), NS, CHUNK_BYTES)
    assert store.put(chain, [payload(k) for k in chain]) == len(chain)
    assert store.flush(10)
    store.close()
    wrong = RemoteLookups(_config(redis_server.url, key_prefix, **sealed("b")))
    right = RemoteLookups(_config(redis_server.url, key_prefix, **sealed("a")))
    try:
        assert wrong.bind([namespace]) and right.bind([namespace])
        for req in ("r1", "r2", "r3"):  # asked again and again: never offered, counted once
            assert _answer(wrong, req, chain)[0] == frozenset()
        c = wrong.counters()
        assert (c["shared_lookup_chunks"], c["shared_lookup_hit_chunks"]) == (3 * len(chain), 0)
        assert c["shared_lookup_sealed_away_chunks"] == len(chain)
        assert _answer(right, "r1", chain)[0] == set(chain)
        assert right.counters()["shared_lookup_sealed_away_chunks"] == 0
    finally:
        wrong.close()
        right.close()
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert len(list(client.scan_iter(match=f"{key_prefix}*"))) == len(chain)  # left in place
    finally:
        client.close()


def test_replaced_and_dropped_lookups_count_as_superseded(redis_server, key_prefix):
    """F-lookup-counters (break test s5-2): a lookup replaced when the request's span changed, or
    dropped with its request, before its answer was read, counts as superseded, so that
    sent == answered + superseded + pending at every scrape (it was 20 sent, 16 answered, 0 pending)."""
    chain = chain_of(16, 6)
    store, namespace = _rank(redis_server.url, key_prefix, 0, chain)
    proxy = DelayProxy(redis_server.port, delay_s=0.3)  # answers come after the span changes below
    lookups = RemoteLookups(_config(proxy.url, key_prefix, shared_deadline_s=5.0, redis_timeout_s=5.0))

    def adds_up() -> bool:
        c = lookups.counters()
        return c["shared_lookups"] == c["shared_lookups_answered"] + c["shared_lookups_superseded"] + lookups.pending

    try:
        assert lookups.bind([namespace])
        assert lookups.poll_pages("r1", chain) is None  # sent, not answered
        assert (lookups.asked, lookups.pending, lookups.superseded) == (1, 1, 0) and adds_up()
        assert lookups.poll_pages("r1", chain[2:]) is None  # the local hit grew: a new lookup replaces the first
        assert (lookups.asked, lookups.pending, lookups.superseded) == (2, 1, 1) and adds_up()
        assert _answer(lookups, "r1", chain[2:])[0] == set(chain[2:])  # the replacement's answer
        assert (lookups.answered, lookups.pending) == (1, 0) and adds_up()
        assert lookups.poll_pages("r1", chain[2:]) == set(chain[2:]) and lookups.asked == 2  # known answer, nothing sent
        assert lookups.poll_pages("r2", chain) is None
        lookups.forget("r2")  # the request went away before its answer was read
        lookups.forget("r1")  # answered: not superseded
        assert lookups.counters() == {"shared_lookups": 3, "shared_lookups_answered": 1,
                                      "shared_lookups_timed_out": 0, "shared_lookups_superseded": 2,
                                      "shared_lookups_skipped": 0, "shared_lookup_chunks": 4,
                                      "shared_lookup_hit_chunks": 4, "shared_lookup_sealed_away_chunks": 0}
        assert lookups.pending == 0 and adds_up()
    finally:
        lookups.close()
        proxy.close()
        store.close()


def test_a_chunk_counts_only_when_every_rank_holds_it(redis_server, key_prefix):
    chain = chain_of(13, 5)
    rank0, ns0 = _rank(redis_server.url, key_prefix, 0, chain, tp_size=2)
    rank1, ns1 = _rank(redis_server.url, key_prefix, 1, chain[:3], tp_size=2)
    lookups = RemoteLookups(_config(redis_server.url, key_prefix))
    try:
        assert lookups.bind([ns0, ns1])
        assert _answer(lookups, "r", chain)[0] == set(chain[:3])  # rank 1 holds only three
        assert lookups.bind([ns0, ns0]) and _answer(lookups, "s", chain)[0] == set(chain)  # rebinding follows the ranks
    finally:
        lookups.close()
        rank0.close()
        rank1.close()


def test_a_slow_server_is_a_miss_after_the_deadline(redis_server, key_prefix):
    chain = chain_of(14, 4)
    store, namespace = _rank(redis_server.url, key_prefix, 0, chain)
    proxy = DelayProxy(redis_server.port, delay_s=1.5)
    lookups = RemoteLookups(_config(proxy.url, key_prefix, shared_deadline_s=0.3))
    try:
        assert lookups.bind([namespace])
        t0 = time.monotonic()
        found, asks = _answer(lookups, "r", chain)
        assert found == frozenset() and asks >= 1
        # answered at the deadline (the tier's own, or the lookup's), not when the server was
        assert 0.3 <= time.monotonic() - t0 < 1.5
    finally:
        lookups.close()
        proxy.close()
        store.close()


def test_an_answer_past_the_deadline_is_a_time_out_however_late_it_is_read(redis_server, key_prefix):
    """A scheduler that polls only after the tier itself gave up (at its own deadline, a miss) still
    counts a time-out: whether the lookup timed out depends on when its answer came, not on when
    the next engine step read it (a loaded host's slow steps made this flaky in an engine test)."""
    chain = chain_of(15, 4)
    store, namespace = _rank(redis_server.url, key_prefix, 0, chain)
    proxy = DelayProxy(redis_server.port, delay_s=1.5)
    lookups = RemoteLookups(_config(proxy.url, key_prefix, shared_deadline_s=0.3))
    try:
        assert lookups.bind([namespace])
        assert lookups.poll_pages("r", chain) is None  # sent; the tier answers (empty) at its deadline
        time.sleep(1.0)  # the next poll comes long after both deadlines
        assert lookups.poll_pages("r", chain) == frozenset()
        assert (lookups.answered, lookups.timed_out) == (1, 1)
    finally:
        lookups.close()
        proxy.close()
        store.close()


def test_a_killed_server_is_a_prompt_miss(redis_factory, key_prefix):
    server = redis_factory()
    chain = chain_of(15, 4)
    store, namespace = _rank(server.url, key_prefix, 0, chain)
    lookups = RemoteLookups(_config(server.url, key_prefix))
    try:
        assert lookups.bind([namespace])
        assert _answer(lookups, "before", chain)[0] == set(chain)
        server.kill9()
        t0 = time.monotonic()
        assert _answer(lookups, "after", chain)[0] == frozenset()  # connection refused: a miss, no exception
        assert time.monotonic() - t0 < 2.0
    finally:
        lookups.close()
        store.close()


def test_the_shared_tier_is_asked_only_when_configured():
    assert not shared_tier_configured(KVTierConfig.from_dict({}))
    assert shared_tier_configured(KVTierConfig.from_dict({"redis_url": "redis://127.0.0.1:1/0"}))
    assert not shared_tier_configured(KVTierConfig.from_dict({"redis_url": "redis://127.0.0.1:1/0",
                                                              "tiers": ["cpu", "disk"]}))


def test_a_slow_server_logs_its_time_outs_once_per_interval_not_once_per_request(redis_server, key_prefix, caplog):
    """A soak's probe: behind a slow server every request's lookup passes ``shared_deadline_s``, and each
    logged its own INFO line (vLLM logs INFO): one line per request, without end.  Now one line per
    10 s, the next saying how many were held back; the counters still count every time-out."""
    chain = chain_of(16, 2)
    store, namespace = _rank(redis_server.url, key_prefix, 0, chain)
    proxy = DelayProxy(redis_server.port, delay_s=1.0)
    lookups = RemoteLookups(_config(proxy.url, key_prefix, shared_deadline_s=0.1, redis_breaker_failures=100))
    try:
        assert lookups.bind([namespace])
        with caplog.at_level(logging.INFO, logger="kvtier"):
            for i in range(6):
                assert _answer(lookups, f"r{i}", chain)[0] == frozenset()
                lookups.forget(f"r{i}")
        lines = [r.getMessage() for r in caplog.records if "passed shared_deadline_s" in r.getMessage()]
        assert lookups.timed_out == 6 and len(lines) == 1, lines
        assert lines[0].startswith("kvtier: shared-tier lookup for request r0 passed shared_deadline_s=0.1")
    finally:
        lookups.close()
        proxy.close()
        store.close()
