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
from kvtier.core.tiers import GetResult, PutResult, TierContext, factory
from kvtier.core.tiers import s3 as s3_tier
from kvtier.core.tiers.sharedvalue import HEADER_BYTES
from kvtier.core.tiers.wrappers import unwrap

from ..redis_servers import wait_until
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
    tier = make_s3_tier(s3_server, bucket, NS, creds, s3_ttl_s=1, s3_sweep_interval_s=3600)
    try:
        inner = unwrap(tier)
        assert isinstance(inner, s3_tier.S3Tier)
        assert tier.put(key(1), data(1)) is PutResult.STORED
        assert tier.contains(key(1))
        # Last-Modified has one-second resolution: wait until the object is past the TTL
        assert wait_until(lambda: not tier.contains(key(1)), timeout_s=10, interval_s=0.2)
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


def test_capacity_cap_deletes_the_oldest_and_a_second_engine_counts_from_the_listing(s3_server, bucket, creds):
    cap_gib = 3 * (CHUNK + HEADER_BYTES) / GiB
    one = make_s3_tier(s3_server, bucket, NS, creds, s3_capacity_gib=cap_gib, s3_sweep_interval_s=3600)
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
        two = make_s3_tier(s3_server, bucket, NS, creds, s3_capacity_gib=cap_gib, s3_sweep_interval_s=3600)
        assert wait_until(lambda: unwrap(two).sweeps >= 1, timeout_s=10)
        assert sorted(two.keys()) == [key(2), key(3), key(4)]
        assert two.put(key(4), data(4)) is PutResult.PRESENT
        assert two.usage().num_chunks == 3 and two.usage().used_bytes == 3 * (CHUNK + HEADER_BYTES)
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
        result = factory.reset_outside("s3", config_of(s3_server, bucket, creds), NS)
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
        s3_tier.from_config(TierContext(plain, NS, CHUNK, 1, CollectorRegistry()))

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


def test_the_cap_never_deletes_an_object_rewritten_since_it_was_counted(s3_server, bucket, creds):
    """Engine one counted chunk 0 as its oldest; another engine deleted and wrote it again since
    (a newer Last-Modified).  When one passes its cap it keeps that object (counted as new) and
    deletes the next oldest instead: an old count never deletes another engine's fresh object."""
    import time

    cap_gib = 2 * (CHUNK + HEADER_BYTES) / GiB
    one = make_s3_tier(s3_server, bucket, NS, creds, s3_capacity_gib=cap_gib, s3_sweep_interval_s=3600)
    other = make_s3_tier(s3_server, bucket, NS, creds)
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


def test_the_probe_tells_reachable_auth_failed_and_unreachable(s3_server, bucket, creds, tmp_path):
    from kvtier.core.tiers.s3probe import probe_s3

    assert probe_s3(config_of(s3_server, bucket, creds)).state == "reachable"
    wrong = tmp_path / "wrong"
    wrong.write_text(f"[default]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = nope-nope\n",
                     encoding="utf-8")
    refused = probe_s3(config_of(s3_server, bucket, wrong))
    assert refused.state == "auth failed" and "nope-nope" not in refused.message
    missing = probe_s3(config_of(s3_server, "no-such-bucket-here", creds))
    assert missing.state == "unreachable" and "no such bucket" in missing.message
    closed = probe_s3(KVTierConfig.from_dict({"s3_endpoint_url": "http://127.0.0.1:9", "s3_bucket": bucket,
                                              "s3_allow_http": True, "s3_credentials_file": str(creds)}), 1.0)
    assert closed.state == "unreachable"
