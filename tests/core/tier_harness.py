"""How the conformance suite builds and tampers with each registered tier (real tiers, no mocks).

One :class:`TierHarness` per tier variant.  Adding a tier to the registry without a harness here
fails ``test_every_registered_tier_has_a_harness``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvtier.core.codecsettings import envelope_args
from kvtier.core.config import KVTierConfig
from kvtier.core.encryption import OVERHEAD_BYTES
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import CpuTier, DiskTier, PutResult, Tier, TierContext, builtin
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.core.tiers.redis import factory as redis_factory
from kvtier.core.tiers.redis import tier as redis_tier
from kvtier.core.tiers.sharedvalue import HEADER_BYTES as VALUE_HEADER_BYTES
from kvtier.core.tiers.sharedvalue import ValueCodec

CHUNK = 4096
NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
CAPACITY_CHUNKS = 4


@dataclass
class TierHarness:
    """Builds one tier variant and reaches into its storage the way a fault would.

    Attributes:
        tier_name: the registry name this harness covers.
        make: ``make(namespace) -> Tier``; two tiers made by one harness share storage.
        tamper: ``tamper(tier, key, how)`` with ``how`` in ``flip`` (one payload byte),
            ``truncate`` (drop the payload's tail), ``foreign`` (replace the value by the same key's
            value written under another namespace); ``None`` for a tier nothing outside the process
            can reach (cpu pages).
        stall: a context manager during which the tier's backend does not answer (reads must
            still return within the tier's deadline); ``None`` if the tier has no backend to stall.
        capacity_chunks: chunks the tier holds, or ``None`` for a shared tier (the server evicts).
    """

    tier_name: str
    make: Callable[[bytes], Tier]
    tamper: Callable[[Tier, ChunkKey, str], None] | None = None
    stall: Callable[[Tier, ChunkKey], contextlib.AbstractContextManager[Any]] | None = None
    capacity_chunks: int | None = CAPACITY_CHUNKS
    deadline_s: float = 2.0
    recoded: bool = False
    """Its codec chain changes the stored bytes (encryption): a ranged read is a verified whole read."""


def cpu_harness(_request: pytest.FixtureRequest, _tmp: Path) -> TierHarness:
    return TierHarness("cpu", lambda ns: CpuTier(capacity_bytes=CAPACITY_CHUNKS * CHUNK, page_bytes=CHUNK))


def encrypted_settings(tmp: Path, tier: str, compressed: bool = False) -> dict[str, Any]:
    """The config keys that encrypt ``tier`` at rest (``compressed``: compress first) under a
    master key written to a file in ``tmp``."""
    key_file = tmp / "master-key"
    key_file.write_text("conformance-master-key-0123456789abcdef\n", encoding="utf-8")
    chain = ["blosc2-zstd-shuffle2", "aes-256-gcm"] if compressed else ["aes-256-gcm"]
    return {"codecs": {tier: chain}, "encryption": {"master_key_file": str(key_file)}}


def disk_harness(request: pytest.FixtureRequest, tmp: Path, mode: str = "buffered", encrypted: bool = False) -> TierHarness:
    if mode == "direct":
        tmp = request.getfixturevalue("direct_dir")  # a filesystem that honours O_DIRECT
    codec_args = None
    if encrypted:
        config = KVTierConfig.from_dict({"disk_path": str(tmp), "disk_gib": 1, **encrypted_settings(tmp, "disk")})
        codec_args = envelope_args(config, "disk")

    def make(ns: bytes) -> Tier:
        overhead = OVERHEAD_BYTES if encrypted else 0
        disk = DiskTier(tmp, ns, capacity_bytes=CAPACITY_CHUNKS * (CHUNK + HEADER_BYTES + overhead), io=mode,  # type: ignore[arg-type]
                        codec_args=codec_args)
        assert disk.io_mode == mode
        return disk

    def tamper(tier: Tier, key: ChunkKey, how: str) -> None:
        assert isinstance(tier, DiskTier)
        path = tier.path(key)
        raw = bytearray(path.read_bytes())
        if how == "flip":
            raw[HEADER_BYTES + 17] ^= 0x01
        elif how == "truncate":
            del raw[HEADER_BYTES + CHUNK // 2:]
        elif how == "foreign":
            other = DiskTier(tmp, OTHER_NS, capacity_bytes=CAPACITY_CHUNKS * (CHUNK + HEADER_BYTES), io=mode)  # type: ignore[arg-type]
            assert other.put(key, bytes(raw[HEADER_BYTES:])) is PutResult.STORED
            raw = bytearray(other.path(key).read_bytes())
        path.write_bytes(bytes(raw))

    @contextlib.contextmanager
    def stall(tier: Tier, key: ChunkKey) -> Iterator[None]:
        # a FIFO at the chunk's path: a plain open() would wait forever for a writer
        assert isinstance(tier, DiskTier)
        path = tier.path(key)
        path.unlink(missing_ok=True)
        os.mkfifo(path)
        try:
            yield
        finally:
            path.unlink(missing_ok=True)

    return TierHarness("disk", make, tamper, stall, recoded=encrypted)



def make_redis_tier(url: str, ns: bytes, prefix: str, **settings: Any) -> redis_tier.RedisTier:
    """A redis tier on ``url`` built the way the store builds it (from a config)."""
    # a deadline that a loaded 2-core test machine meets; the fault tests use tight ones
    config = KVTierConfig.from_dict({"redis_url": url, "redis_key_prefix": prefix, "shared_deadline_s": 2.0,
                                     "shared_transfer_deadline_s": 2.0,
                                     "redis_timeout_s": 2.0, **settings})
    tier = redis_factory.from_config(TierContext(config, ns, CHUNK, 1, CollectorRegistry()))
    assert tier is not None
    return tier


def _redis_harness(name: str, url: str, raw: Any, node_of: Callable[[bytes], Any], recoded: bool = False,
                   **settings: Any) -> TierHarness:
    prefix = f"conf-{uuid.uuid4().hex[:8]}:"

    def make(ns: bytes) -> Tier:
        return make_redis_tier(url, ns, prefix, **settings)

    def tamper(tier: Tier, key: ChunkKey, how: str) -> None:
        assert isinstance(tier, redis_tier.RedisTier)
        rk = tier.rkey(key)
        value = bytearray(raw.get(rk))
        if how == "flip":
            value[VALUE_HEADER_BYTES + 17] ^= 0x01
        elif how == "truncate":
            del value[VALUE_HEADER_BYTES + CHUNK // 2:]
        elif how == "foreign":
            value = ValueCodec(OTHER_NS, None).encode(key, bytes(value[VALUE_HEADER_BYTES:]))
        raw.set(rk, bytes(value))

    @contextlib.contextmanager
    def stall(tier: Tier, key: ChunkKey) -> Iterator[None]:
        assert isinstance(tier, redis_tier.RedisTier)
        node = node_of(tier.rkey(key))
        node.pause()
        try:
            yield
        finally:
            node.resume()

    return TierHarness("redis", make, tamper, stall, capacity_chunks=None, deadline_s=4.0, recoded=recoded)


def redis_harness(request: pytest.FixtureRequest, _tmp: Path) -> TierHarness:
    server = request.getfixturevalue("redis_server")
    return _redis_harness("redis", server.url, server.client(), lambda _rk: server)


def redis_mac_harness(request: pytest.FixtureRequest, _tmp: Path) -> TierHarness:
    server = request.getfixturevalue("redis_server")
    return _redis_harness("redis", server.url, server.client(), lambda _rk: server,
                          shared_secret="conformance-secret-0123456789")


def redis_aes_harness(request: pytest.FixtureRequest, tmp: Path) -> TierHarness:
    server = request.getfixturevalue("redis_server")
    return _redis_harness("redis", server.url, server.client(), lambda _rk: server, recoded=True,
                          **encrypted_settings(tmp, "redis"))


def redis_zstd_aes_harness(request: pytest.FixtureRequest, tmp: Path) -> TierHarness:
    server = request.getfixturevalue("redis_server")
    return _redis_harness("redis", server.url, server.client(), lambda _rk: server, recoded=True,
                          **encrypted_settings(tmp, "redis", compressed=True))


def redis_cluster_harness(request: pytest.FixtureRequest, _tmp: Path) -> TierHarness:
    from redis.cluster import RedisCluster

    cluster = request.getfixturevalue("redis_cluster")
    raw = RedisCluster.from_url(cluster.url)
    return _redis_harness("redis", cluster.url, raw, cluster.node_of, redis_cluster=True)


def s3_credentials_file(directory: Path, server: Any) -> Path:
    """An AWS shared-credentials file holding ``server``'s keys (how the harness passes credentials)."""
    path = directory / "s3-credentials"
    path.write_text(f"[default]\naws_access_key_id = {server.access_key}\n"
                    f"aws_secret_access_key = {server.secret_key}\n", encoding="utf-8")
    return path


def make_s3_tier(server: Any, bucket: str, ns: bytes, credentials: Path, **settings: Any) -> Tier:
    """An s3 tier on ``server``'s ``bucket`` built the way the store builds it (from a config: the
    bare tier behind GuardedTier); ``server`` is an ``S3Server`` or a ``ConditionalPutProxy`` in
    front of one (its ``url`` is the endpoint; the keys are the same)."""
    from kvtier.core.tiers.s3 import factory as s3_factory

    # deadlines a loaded 2-core test machine meets; the fault tests use tight ones
    config = KVTierConfig.from_dict({"s3_endpoint_url": server.url, "s3_bucket": bucket, "s3_allow_http": True,
                                     "s3_credentials_file": str(credentials), "shared_deadline_s": 2.0,
                                     "shared_transfer_deadline_s": 2.0, **settings})
    tier = s3_factory.from_config(TierContext(config, ns, CHUNK, 1, CollectorRegistry()))
    assert tier is not None
    return tier


def _s3_harness(request: pytest.FixtureRequest, tmp: Path, conditional_front: bool = False,
                **settings: Any) -> TierHarness:
    """``conditional_front``: the tier talks to rclone through a ``ConditionalPutProxy`` (a server
    that answers ``412`` to a conditional ``PUT`` on an existing key, where rclone replaces it)."""
    import obstore

    from kvtier.core.tiers.s3 import tier as s3_tier
    from tests.s3_servers import ConditionalPutProxy

    server = request.getfixturevalue("s3_server")
    bucket = server.make_bucket()
    raw = server.client(bucket)
    credentials = s3_credentials_file(tmp, server)
    endpoint = server
    if conditional_front:
        endpoint = ConditionalPutProxy(server)
        request.addfinalizer(endpoint.close)

    def make(ns: bytes) -> Tier:
        return make_s3_tier(endpoint, bucket, ns, credentials, **settings)

    def tamper(tier: Tier, key: ChunkKey, how: str) -> None:
        assert isinstance(tier, s3_tier.S3Tier)
        path = tier.object_key(key)
        value = bytearray(bytes(obstore.get(raw, path).bytes()))
        if how == "flip":
            value[VALUE_HEADER_BYTES + 17] ^= 0x01
        elif how == "truncate":
            del value[VALUE_HEADER_BYTES + CHUNK // 2:]
        elif how == "foreign":
            value = ValueCodec(OTHER_NS, None).encode(key, bytes(value[VALUE_HEADER_BYTES:]))
        obstore.put(raw, path, bytes(value), use_multipart=False)

    @contextlib.contextmanager
    def stall(tier: Tier, key: ChunkKey) -> Iterator[None]:
        server.pause()
        try:
            yield
        finally:
            server.resume()

    return TierHarness("s3", make, tamper, stall, capacity_chunks=None, deadline_s=4.0,
                       recoded="codecs" in settings)


def s3_harness(request: pytest.FixtureRequest, tmp: Path) -> TierHarness:
    return _s3_harness(request, tmp)


def s3_mac_harness(request: pytest.FixtureRequest, tmp: Path) -> TierHarness:
    return _s3_harness(request, tmp, shared_secret="conformance-secret-0123456789")


def s3_aes_harness(request: pytest.FixtureRequest, tmp: Path) -> TierHarness:
    return _s3_harness(request, tmp, **encrypted_settings(tmp, "s3"))


def s3_zstd_aes_harness(request: pytest.FixtureRequest, tmp: Path) -> TierHarness:
    return _s3_harness(request, tmp, **encrypted_settings(tmp, "s3", compressed=True))


def s3_conditional_harness(request: pytest.FixtureRequest, tmp: Path) -> TierHarness:
    return _s3_harness(request, tmp, conditional_front=True)


def dict_harness(_request: pytest.FixtureRequest, _tmp: Path) -> TierHarness:
    """The toy tier from outside kvtier (tests/dict_tier.py): a plug-in's one conformance fixture.
    Its values are envelopes kvtier writes for it (EnvelopeTier), so they can be tampered with as
    a disk file or a Redis value can; two tiers made here share one area (per namespace)."""
    from tests.dict_tier import DictTier

    area: dict[bytes, dict[ChunkKey, Any]] = {}

    def make(ns: bytes) -> Tier:
        return DictTier(CAPACITY_CHUNKS * (CHUNK + VALUE_HEADER_BYTES), ns, area.setdefault(ns, {}))

    def tamper(tier: Tier, key: ChunkKey, how: str) -> None:
        assert isinstance(tier, DictTier)
        held = area[tier.namespace][key]
        value = bytearray(held.data)
        if how == "flip":
            value[VALUE_HEADER_BYTES + 17] ^= 0x01
        elif how == "truncate":
            del value[VALUE_HEADER_BYTES + CHUNK // 2:]
        elif how == "foreign":
            value = ValueCodec(OTHER_NS, None).encode(key, bytes(value[VALUE_HEADER_BYTES:]))
        held.data = bytes(value)

    return TierHarness("dict", make, tamper)


def node_harness(request: pytest.FixtureRequest, _tmp: Path, shared_secret: str | None = None) -> TierHarness:
    """The node tier on a real owner (``kvtier node serve``, one for the session: the pool is emptied
    of both namespaces in both key spaces when a test's harness is made, so each test starts from an
    empty pool), built as the store builds it (the plug-in: GuardedTier over NodeTier), with
    ``shared_secret`` or none (a MAC, and the secret's key space); tampering writes into the shared
    pages of the pool, stalling SIGSTOPs the owner."""
    from kvtier.core.tiers.node import protocol
    from kvtier.core.tiers.node.tier import NodeTier
    from kvtier.core.tiers.wrappers import unwrap

    server = request.getfixturevalue("node_owner")
    settings = {"node_socket": server.socket, "shared_deadline_s": 2.0, "shared_transfer_deadline_s": 2.0}
    secrets = [None, "conformance-secret-0123456789"]
    configs = {s: KVTierConfig.from_dict({**settings, **({"shared_secret": s} if s else {})}) for s in secrets}

    def make(ns: bytes, secret: str | None = shared_secret) -> Tier:
        tier = builtin.NODE.build(TierContext(configs[secret], ns, CHUNK, 1, CollectorRegistry()))
        assert tier is not None
        return tier

    for ns in (NS, OTHER_NS):  # what earlier tests left (their writers gone: counted by the next writer)
        for secret in secrets:  # a clear takes one key space
            cleaner = make(ns, secret)
            try:
                assert cleaner.clear().ok
            finally:
                cleaner.close()
    assert server.stats().num_values == 0

    def tamper(tier: Tier, key: ChunkKey, how: str) -> None:
        inner = unwrap(tier)
        assert isinstance(inner, NodeTier)
        reply, pool, serial = inner.client.call(protocol.Pin(inner.namespace, [inner.sealed_key(key)], []))
        assert isinstance(reply, protocol.Pinned) and reply.leases[0] is not None
        lease, page, nbytes, _gen = reply.leases[0]
        value = pool.value(page, nbytes)
        if how == "flip":
            value[VALUE_HEADER_BYTES + 17] ^= 0x01
        elif how == "truncate":  # a value's length is the owner's: its tail is lost (zeroed) instead
            value[VALUE_HEADER_BYTES + CHUNK // 2:] = bytes(nbytes - VALUE_HEADER_BYTES - CHUNK // 2)
        elif how == "foreign":
            value[:] = ValueCodec(OTHER_NS, None).encode(key, bytes(value[VALUE_HEADER_BYTES:]))
        inner.client.release_later(serial, [lease])

    @contextlib.contextmanager
    def stall(tier: Tier, key: ChunkKey) -> Iterator[None]:
        server.pause()
        try:
            yield
        finally:
            server.resume()

    return TierHarness("node", make, tamper, stall, capacity_chunks=None, deadline_s=4.0)


HARNESSES: dict[str, Callable[[pytest.FixtureRequest, Path], TierHarness]] = {
    "cpu": cpu_harness,
    "dict": dict_harness,
    "disk-buffered": disk_harness,
    "disk-direct": lambda request, tmp: disk_harness(request, tmp, "direct"),
    "disk-aes": lambda request, tmp: disk_harness(request, tmp, encrypted=True),
    "node": node_harness,
    "node-mac": lambda request, tmp: node_harness(request, tmp, "conformance-secret-0123456789"),
    "redis": redis_harness,
    "redis-aes": redis_aes_harness,
    "redis-zstd-aes": redis_zstd_aes_harness,
    "redis-mac": redis_mac_harness,
    "redis-cluster": redis_cluster_harness,
    "s3": s3_harness,
    "s3-mac": s3_mac_harness,
    "s3-aes": s3_aes_harness,
    "s3-zstd-aes": s3_zstd_aes_harness,
    "s3-412": s3_conditional_harness,
}
"""Harness variant name -> builder (a tier may have several variants, e.g. redis standalone and Cluster)."""
