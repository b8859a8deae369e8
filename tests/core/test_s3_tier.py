"""The s3 tier against a real S3 server (``rclone serve s3``, tests/s3_servers.py): what the shared
conformance suite does not cover.  A PUT is atomic (a reader racing a writer gets a miss or the
exact bytes), expiry by TTL, the capacity cap and its count rebuilt from a LIST, the reset hook,
and the preflight's one-sentence refusals."""

from __future__ import annotations

import threading

import numpy as np
import obstore
import pytest
from prometheus_client import CollectorRegistry

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.purge import reset_outside
from kvtier.core.tiers import GetResult, PutResult, TierContext, factory
from kvtier.core.tiers.s3 import factory as s3_factory
from kvtier.core.tiers.s3 import tier as s3_tier
from kvtier.core.tiers.sharedvalue import HEADER_BYTES
from kvtier.core.tiers.wrappers import unwrap

from ..redis_servers import wait_until
from ..s3_servers import ConditionalPutProxy
from .tier_harness import CHUNK, NS, OTHER_NS, make_s3_tier, s3_credentials_file


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def data(i: int, size: int = CHUNK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture
def bucket(s3_server):
    return s3_server.make_bucket()


@pytest.fixture
def creds(s3_server, tmp_path):
    return s3_credentials_file(tmp_path, s3_server)


@pytest.fixture
def front(s3_server):
    """rclone behind a front that answers 412 to a conditional PUT on an existing key, as AWS S3 does."""
    proxy = ConditionalPutProxy(s3_server)
    yield proxy
    proxy.close()


@pytest.fixture(params=["rclone", "412-front"])
def endpoint(request, s3_server):
    """Where the tiers of a test write: rclone itself (it ignores If-None-Match: the tier HEADs
    before each PUT) or the front honouring it (no HEAD; the server's 412 says "already there")."""
    return s3_server if request.param == "rclone" else request.getfixturevalue("front")


def objects(s3_server, bucket) -> list[str]:
    return sorted(m["path"] for page in obstore.list(s3_server.client(bucket)) for m in page)


def test_a_reader_racing_a_writer_gets_a_miss_or_the_exact_bytes(s3_server, bucket, creds):
    """S3 PUT is atomic: while one engine writes 8 MiB chunks (and deletes them again), readers of
    the same keys see no object or the whole one, never a part (a part would fail the length check:
    CORRUPT)."""
    size = 8 << 20
    writer = make_s3_tier(s3_server, bucket, NS, creds, shared_transfer_deadline_s=30.0)
    reader = make_s3_tier(s3_server, bucket, NS, creds, shared_transfer_deadline_s=30.0)
    payloads = {i: data(i, size) for i in range(3)}
    seen: dict[str, int] = {"hit": 0, "miss": 0}
    wrong: list[str] = []
    done = threading.Event()

    def read_loop() -> None:
        out = bytearray(size)
        while not done.is_set():
            for i, want in payloads.items():
                result = reader.get_into(key(i), memoryview(out))
                if result is GetResult.HIT:
                    seen["hit"] += 1
                    if bytes(out) != want:
                        wrong.append(f"chunk {i}: wrong bytes")
                elif result is GetResult.MISS:
                    seen["miss"] += 1
                else:
                    wrong.append(f"chunk {i}: {result}")

    threads = [threading.Thread(target=read_loop) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _round in range(4):
            for i, want in payloads.items():
                assert writer.put(key(i), want) is PutResult.STORED
            assert writer.delete_many([key(i) for i in payloads]) == [True] * 3
    finally:
        done.set()
        for t in threads:
            t.join(timeout=60)
        writer.close()
        reader.close()
    assert not wrong, wrong
    assert seen["miss"] + seen["hit"] > 0


def test_expired_objects_are_misses_and_the_sweep_deletes_them(s3_server, bucket, creds):
    # a TTL of 3 s, not 1: with Last-Modified's one-second resolution a put that took a second on a
    # loaded machine left a 1 s object expired before the first lookup (seen once under load 10)
    tier = make_s3_tier(s3_server, bucket, NS, creds, s3_ttl_s=3, s3_sweep_interval_s=3600)
    try:
        inner = unwrap(tier)
        assert isinstance(inner, s3_tier.S3Tier)
        assert tier.put(key(1), data(1)) is PutResult.STORED
        assert tier.contains(key(1))
        # Last-Modified has one-second resolution: wait until the object is past the TTL
        assert wait_until(lambda: not tier.contains(key(1)), timeout_s=15, interval_s=0.2)
        assert objects(s3_server, bucket) == [inner.object_key(key(1))]  # a lookup only hides it
        assert tier.get_into(key(1), memoryview(bytearray(CHUNK))) is GetResult.MISS
        assert objects(s3_server, bucket) == []  # the read that found it expired deleted it
        assert tier.put(key(2), data(2)) is PutResult.STORED  # a fresh one survives the sweep
        inner.sweep()
        assert objects(s3_server, bucket) == [inner.object_key(key(2))]
        assert tier.get_into(key(2), memoryview(out := bytearray(CHUNK))) is GetResult.HIT and bytes(out) == data(2)
        assert tier.corrupt == 0
    finally:
        tier.close()


def test_capacity_cap_deletes_the_oldest_and_a_second_engine_counts_from_the_listing(s3_server, endpoint, bucket,
                                                                                      creds):
    cap_gib = 3 * (CHUNK + HEADER_BYTES) / GiB
    one = make_s3_tier(endpoint, bucket, NS, creds, s3_capacity_gib=cap_gib, s3_sweep_interval_s=3600)
    two = None
    try:
        for i in range(5):
            assert one.put(key(i), data(i)) is PutResult.STORED
            usage = one.usage()
            assert usage.used_bytes <= usage.capacity_bytes == 3 * (CHUNK + HEADER_BYTES)
        assert one.keys() == [key(2), key(3), key(4)]
        inner = unwrap(one)
        assert objects(s3_server, bucket) == sorted(inner.object_key(key(i)) for i in (2, 3, 4))
        # another engine on the same namespace counts what the bucket holds, each object once,
        # even the ones it writes again itself
        two = make_s3_tier(endpoint, bucket, NS, creds, s3_capacity_gib=cap_gib, s3_sweep_interval_s=3600)
        assert wait_until(lambda: unwrap(two).sweeps >= 1, timeout_s=10)
        assert sorted(two.keys()) == [key(2), key(3), key(4)]
        assert two.put(key(4), data(4)) is PutResult.PRESENT
        assert two.usage().num_chunks == 3 and two.usage().used_bytes == 3 * (CHUNK + HEADER_BYTES)
        assert two.wire_stats().bytes["write"] == 0  # nothing stored: no written bytes counted
        two.check()
    finally:
        one.close()
        if two is not None:
            two.close()


def config_of(s3_server, bucket, creds, **extra) -> KVTierConfig:
    return KVTierConfig.from_dict({"s3_endpoint_url": s3_server.url, "s3_bucket": bucket, "s3_allow_http": True,
                                   "s3_credentials_file": str(creds), **extra})


def test_reset_hook_deletes_one_namespace_only(s3_server, bucket, creds):
    mine, other = make_s3_tier(s3_server, bucket, NS, creds), make_s3_tier(s3_server, bucket, OTHER_NS, creds)
    try:
        mine.put_many([key(1), key(2)], [data(1), data(2)])
        other.put(key(1), data(1))
        result = reset_outside("s3", config_of(s3_server, bucket, creds), NS)
        assert result is not None and result.ok and sorted(result.keys) == [key(1), key(2)]
        assert objects(s3_server, bucket) == [unwrap(other).object_key(key(1))]
    finally:
        mine.close()
        other.close()


def test_preflight_names_each_problem_in_one_sentence(s3_server, bucket, creds, tmp_path):
    plain = KVTierConfig.from_dict({"s3_endpoint_url": s3_server.url, "s3_bucket": bucket})
    (problem,) = factory.check("s3", plain)
    assert problem[0] == "s3_allow_http" and "plain HTTP" in problem[1] and "s3_allow_http: true" in problem[1]
    with pytest.raises(ConfigError, match="plain HTTP"):
        s3_factory.from_config(TierContext(plain, NS, CHUNK, 1, CollectorRegistry()))

    no_bucket = KVTierConfig.from_dict({"s3_endpoint_url": "https://minio.example:9000"})
    assert [k for k, _ in factory.check("s3", no_bucket)] == ["s3_bucket"]

    missing = config_of(s3_server, bucket, tmp_path / "nope")
    ((name, message),) = factory.check("s3", missing)
    assert name == "s3_credentials_file" and "cannot be read" in message

    bad = tmp_path / "bad-credentials"
    bad.write_text("[other]\naws_access_key_id = x\n", encoding="utf-8")
    ((name, message),) = factory.check("s3", config_of(s3_server, bucket, bad))
    assert "[default]" in message
    assert factory.check("s3", config_of(s3_server, bucket, creds)) == []


def test_credentials_never_go_in_the_endpoint_url():
    with pytest.raises(ConfigError, match="must not carry credentials") as err:
        KVTierConfig.from_dict({"s3_endpoint_url": "https://AKID:SECRETKEY@minio.example:9000", "s3_bucket": "kvcache"})
    assert "SECRETKEY" not in str(err.value)
    with pytest.raises(ConfigError, match="s3_key_prefix must be empty or end in '/'"):
        KVTierConfig.from_dict({"s3_bucket": "kvcache", "s3_key_prefix": "kvtier"})


def test_wrong_secret_key_is_a_refusal_that_leaves_the_breaker_closed(s3_server, bucket, tmp_path):
    """A 403 is the server answering: every call fails (counted) but the breaker stays closed."""
    wrong = tmp_path / "wrong"
    wrong.write_text(f"[default]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = nope-nope\n",
                     encoding="utf-8")
    tier = make_s3_tier(s3_server, bucket, NS, wrong, s3_breaker_failures=2)
    try:
        for i in range(4):
            assert tier.put(key(i), data(i)) is PutResult.FAILED
        stats = tier.wire_stats()
        assert stats.errors["put"] == 4 and stats.breaker_opened == 0
        assert "nope-nope" not in repr(tier.inner.__dict__)
    finally:
        tier.close()


def test_the_cap_never_deletes_an_object_rewritten_since_it_was_counted(s3_server, endpoint, bucket, creds):
    """Engine one counted chunk 0 as its oldest; another engine deleted and wrote it again since
    (a newer Last-Modified).  When one passes its cap it keeps that object (counted as new) and
    deletes the next oldest instead: an old count never deletes another engine's fresh object."""
    import time

    cap_gib = 2 * (CHUNK + HEADER_BYTES) / GiB
    one = make_s3_tier(endpoint, bucket, NS, creds, s3_capacity_gib=cap_gib, s3_sweep_interval_s=3600)
    other = make_s3_tier(endpoint, bucket, NS, creds)
    try:
        assert one.put_many([key(0), key(1)], [data(0), data(1)]) == [PutResult.STORED] * 2
        time.sleep(1.2)  # Last-Modified has one-second resolution
        assert other.delete(key(0)) and other.put(key(0), data(0)) is PutResult.STORED
        assert one.put(key(2), data(2)) is PutResult.STORED  # past the cap: key 0 is the oldest counted
        inner = unwrap(one)
        assert objects(s3_server, bucket) == sorted(inner.object_key(key(i)) for i in (0, 2))
        assert one.keys() == [key(2), key(0)] and one.usage().num_chunks == 2
        one.check()
    finally:
        one.close()
        other.close()


def test_the_probe_tells_reachable_auth_failed_no_bucket_and_unreachable(s3_server, bucket, creds, tmp_path):
    from kvtier.core.purge import probe_tier

    assert probe_tier("s3", config_of(s3_server, bucket, creds)).state == "reachable"
    wrong = tmp_path / "wrong"
    wrong.write_text(f"[default]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = nope-nope\n",
                     encoding="utf-8")
    refused = probe_tier("s3", config_of(s3_server, bucket, wrong))
    assert refused.state == "auth failed" and "nope-nope" not in refused.message
    missing = probe_tier("s3", config_of(s3_server, "no-such-bucket-here", creds))
    # the endpoint answered 404 for the bucket: up, not unreachable (it read "unreachable" before)
    assert missing.state == "no bucket" and "the endpoint answers, but the bucket does not exist" in missing.message
    assert "unreachable" not in missing.message and "no-such-bucket-here" in missing.message
    closed = probe_tier("s3", KVTierConfig.from_dict({"s3_endpoint_url": "http://127.0.0.1:9", "s3_bucket": bucket,
                                              "s3_allow_http": True, "s3_credentials_file": str(creds)}), 1.0)
    assert closed.state == "unreachable"


def test_rclone_replaces_an_object_despite_if_none_match_and_the_tier_heads_before_writing(s3_server, bucket, creds):
    """The test server ignores If-None-Match: * (rclone serve s3 v1.75: a second conditional PUT
    answers 200 and replaces the object).  The tier's one probe finds that out and each write then
    HEADs first: a second engine writing the same chunks gets PRESENT, the objects keep their
    bytes, each chunk is counted once and no written bytes are counted for them."""
    raw = s3_server.client(bucket)
    obstore.put(raw, "probe/k", b"one", mode="create", use_multipart=False)
    obstore.put(raw, "probe/k", b"two", mode="create", use_multipart=False)  # no 412
    assert bytes(obstore.get(raw, "probe/k").bytes()) == b"two"
    obstore.delete(raw, "probe/k")
    one, two = make_s3_tier(s3_server, bucket, NS, creds), make_s3_tier(s3_server, bucket, NS, creds)
    try:
        assert unwrap(one).conditional_honoured is None
        keys = [key(i) for i in range(3)]
        assert one.put_many(keys, [data(i) for i in range(3)]) == [PutResult.STORED] * 3
        assert unwrap(one).conditional_honoured is False
        assert two.put_many(keys, [data(10 + i) for i in range(3)]) == [PutResult.PRESENT] * 3
        assert two.put_many(keys, [data(i) for i in range(3)]) == [PutResult.PRESENT] * 3
        for i, k in enumerate(keys):
            assert two.get_into(k, memoryview(out := bytearray(CHUNK))) is GetResult.HIT and bytes(out) == data(i)
        assert two.usage().num_chunks == 3 and two.usage().used_bytes == 3 * (CHUNK + HEADER_BYTES)
        assert two.wire_stats().bytes["write"] == 0 and one.wire_stats().bytes["write"] == 3 * CHUNK
        two.check()
        assert objects(s3_server, bucket) == sorted(unwrap(one).object_key(k) for k in keys)  # probes deleted
    finally:
        one.close()
        two.close()


def test_a_server_answering_412_spares_every_head_and_counts_each_chunk_once(s3_server, front, bucket, creds):
    """Through a server that honours If-None-Match: * (the front): after the one probe (create,
    refused create, delete) a write is one conditional PUT per chunk and no HEAD; a second engine
    writing the same chunks gets the server's 412 as PRESENT, the objects keep their first bytes,
    each chunk is counted once and no written bytes are counted for a refused PUT."""
    one, two = make_s3_tier(front, bucket, NS, creds), make_s3_tier(front, bucket, NS, creds)
    try:
        keys = [key(i) for i in range(4)]
        assert one.put_many(keys, [data(i) for i in range(4)]) == [PutResult.STORED] * 4
        assert unwrap(one).conditional_honoured is True
        assert front.methods() == ["PUT", "PUT", "POST"] + ["PUT"] * 4  # the probe's delete is a bulk POST ?delete and front.refused == 1
        assert front.methods(conditional=True) == ["PUT"] * 6
        assert two.put_many(keys, [data(10 + i) for i in range(4)]) == [PutResult.PRESENT] * 4
        assert two.put(key(0), data(0)) is PutResult.PRESENT
        assert "HEAD" not in front.methods() and front.refused == 1 + 1 + 4 + 1
        for i, k in enumerate(keys):
            assert two.get_into(k, memoryview(out := bytearray(CHUNK))) is GetResult.HIT and bytes(out) == data(i)
        assert two.usage().num_chunks == 4 and two.usage().used_bytes == 4 * (CHUNK + HEADER_BYTES)
        assert one.usage().num_chunks == 4
        assert two.wire_stats().bytes["write"] == 0 and one.wire_stats().bytes["write"] == 4 * CHUNK
        one.check()
        two.check()
        assert objects(s3_server, bucket) == sorted(unwrap(one).object_key(k) for k in keys)
    finally:
        one.close()
        two.close()


def test_a_gateway_answering_501_to_if_none_match_gets_head_then_plain_put(s3_server, bucket, creds):
    """A gateway without conditional writes answers ``501 NotImplemented`` to ``If-None-Match: *``
    (the front with ``not_implemented``): the tier's probe takes that answer as "not honoured"
    (``s3_conditional_put`` left at its default), and every write is a HEAD then a PUT without the
    header: the chunks are stored, a present chunk is not written again."""
    gateway = ConditionalPutProxy(s3_server, not_implemented=True)
    tier = make_s3_tier(gateway, bucket, NS, creds)
    try:
        assert tier.put_many([key(1), key(2)], [data(1), data(2)]) == [PutResult.STORED] * 2
        assert unwrap(tier).conditional_honoured is False
        probes = len(gateway.methods(conditional=True))
        assert probes >= 1 and gateway.refused == probes  # only the probe carried the header
        # a HEAD then a plain PUT per chunk; the client sends a PUT again on a dropped connection
        # (s3_max_retries: seen once in CI under load), so the PUTs are counted by object
        plain = [(m, t) for m, t, c in list(gateway.requests) if not c]
        puts = [t for m, t in plain if m == "PUT"]
        assert sorted(m for m, _ in plain if m != "PUT") == ["HEAD", "HEAD", "POST"]
        assert len(set(puts)) == 2 and set(puts) <= {t for m, t in plain if m == "HEAD"}
        assert tier.put_many([key(1), key(2)], [data(3), data(4)]) == [PutResult.PRESENT] * 2
        assert len(gateway.methods(conditional=True)) == probes  # asked once
        assert gateway.methods(conditional=False).count("PUT") == len(puts)  # a present chunk: not written
        assert tier.get_into(key(1), memoryview(out := bytearray(CHUNK))) is GetResult.HIT and bytes(out) == data(1)
        assert objects(s3_server, bucket) == sorted(unwrap(tier).object_key(k) for k in (key(1), key(2)))
    finally:
        tier.close()
        gateway.close()


def test_without_conditional_put_each_write_heads_first_and_sends_no_if_none_match(s3_server, front, bucket, creds):
    """``s3_conditional_put: false`` (a gateway answering 501 to the header): no probe, no
    If-None-Match, a HEAD before each PUT; a present chunk is not written again."""
    tier = make_s3_tier(front, bucket, NS, creds, s3_conditional_put=False)
    try:
        assert tier.put_many([key(1), key(2)], [data(1), data(2)]) == [PutResult.STORED] * 2
        puts = [t for m, t, _ in list(front.requests) if m == "PUT"]  # by object: a retried PUT repeats one
        assert front.methods().count("HEAD") == 2 and len(set(puts)) == 2
        assert tier.put_many([key(1), key(2)], [data(3), data(4)]) == [PutResult.PRESENT] * 2
        assert front.methods().count("HEAD") == 4 and front.methods().count("PUT") == len(puts)  # not written
        assert front.methods(conditional=True) == [] and unwrap(tier).conditional_honoured is False
        assert tier.get_into(key(1), memoryview(out := bytearray(CHUNK))) is GetResult.HIT and bytes(out) == data(1)
        assert tier.usage().num_chunks == 2
    finally:
        tier.close()


def test_the_cap_is_the_engines_total_across_tensor_parallel_ranks(s3_server, bucket, creds):
    """Each tensor-parallel rank stores under its own namespace, and each rank's tier counted and capped
    its namespace at the whole s3_capacity_gib: a TP=2 engine's bucket held twice the cap (an outside
    probe read capacity 1 GiB per rank for a 1 GiB cap, while disk_gib is split), and /metrics' capacity,
    summed over ranks, read twice the configured total."""
    cap_gib = 4 * (CHUNK + HEADER_BYTES) / GiB
    config = config_of(s3_server, bucket, creds, s3_capacity_gib=cap_gib, s3_sweep_interval_s=3600)
    ranks = [s3_factory.from_config(TierContext(config, ns, CHUNK, 2, CollectorRegistry())) for ns in (NS, OTHER_NS)]
    try:
        for rank in ranks:
            assert rank is not None
            for i in range(4):
                assert rank.put(key(i), data(i)) is PutResult.STORED
            assert rank.usage().capacity_bytes == 2 * (CHUNK + HEADER_BYTES)
        assert len(objects(s3_server, bucket)) == 4  # the cap, over both ranks
    finally:
        for rank in ranks:
            if rank is not None:
                rank.close()
