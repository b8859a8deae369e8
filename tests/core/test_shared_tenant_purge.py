"""``kvtier purge --salt``/``--lora`` on the shared tiers (issue 22 item 3): values written through
the real redis tier (standalone and Cluster) and s3 tier by a real store that knows its tenant
carry the tenant record in their header; a purge of one tenant removes exactly its values, the
other tenant's stay readable bit for bit, a value written before records (format version 1) stays
readable and is counted as of an unknown tenant, a damaged record is never trusted, and a dry run
removes nothing.  Real servers: redis-server (tests/redis_servers.py) and ``rclone serve s3``
(tests/s3_servers.py)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import xxhash
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.purge import PurgeSelector, purge
from kvtier.core.store import TieredStore
from kvtier.core.tenant import TenantId
from kvtier.core.tiers import sharedvalue
from kvtier.core.tiers.sharedvalue import HEADER_BYTES, V1_HEADER_BYTES, ValueCodec

from .helpers import CHUNK_BYTES, chain_of, make_store, payload, shared_prefix
from .tier_harness import s3_credentials_file

DEADLINES = {"shared_deadline_s": 5.0, "shared_transfer_deadline_s": 5.0}


def v1_value(namespace: bytes, key: bytes, data: bytes) -> bytes:
    """A value as kvtier wrote it before the tenant record (format version 1, 64-byte header,
    XXH3-128 over the first 48 bytes and the payload), built from its documented layout."""
    fields = struct.pack("<4sHBB16s16sQ", b"KVTR", 1, 0, 0, namespace, key, len(data))
    digest = xxhash.xxh3_128(fields)
    digest.update(data)
    return fields + digest.digest() + data


@dataclass
class Target:
    """One shared tier on a real server: how a store, the purge and a raw client reach it."""

    name: str  # the tier's registry name
    settings: dict[str, Any]  # the store's and the purge's configuration keys
    cli: list[str]  # the same target as kvtier purge flags
    raw: Any  # a client past the tier: redis-py or an obstore store

    def store(self) -> TieredStore:
        return make_store(None, cpu_chunks=64, **self.settings, **DEADLINES)

    def config(self) -> KVTierConfig:
        return KVTierConfig.from_dict(self.settings)

    def path(self, store: TieredStore, key: bytes) -> Any:
        tier = store.tier(self.name)
        return tier.rkey(ChunkKey(key)) if self.name == "redis" else tier.object_key(ChunkKey(key))

    def put_raw(self, path: Any, value: bytes) -> None:
        if self.name == "redis":
            self.raw.set(path, value, ex=86400)
        else:
            import obstore

            obstore.put(self.raw, path, value)

    def get_raw(self, path: Any) -> bytes | None:
        if self.name == "redis":
            got = self.raw.get(path)
            return None if got is None else bytes(got)
        import obstore

        try:
            return bytes(obstore.get(self.raw, path).bytes())
        except FileNotFoundError:
            return None


@pytest.fixture(params=["redis_server", "redis_cluster", "s3_server"])
def target(request, key_prefix, tmp_path) -> Iterator[Target]:
    server = request.getfixturevalue(request.param)
    if request.param == "s3_server":
        bucket = server.make_bucket()
        creds = s3_credentials_file(tmp_path, server)
        settings = {"s3_endpoint_url": server.url, "s3_bucket": bucket, "s3_allow_http": True,
                    "s3_credentials_file": str(creds)}
        cli = ["--s3-bucket", bucket, "--s3-endpoint-url", server.url, "--s3-allow-http", "--s3-credentials-file",
               str(creds)]
        yield Target("s3", settings, cli, server.client(bucket))
        return
    cluster = request.param == "redis_cluster"
    settings = {"redis_url": server.url, "redis_key_prefix": key_prefix, "redis_cluster": cluster,
                "redis_timeout_s": 5.0}
    cli = ["--redis-url", server.url, "--redis-key-prefix", key_prefix, *(["--redis-cluster"] if cluster else [])]
    client = redis.RedisCluster.from_url(server.url) if cluster else redis.Redis.from_url(server.url)
    try:
        yield Target("redis", settings, cli, client)
    finally:
        client.close()


@dataclass
class Filled:
    namespace: bytes
    chains: dict[str, list[ChunkKey]]
    old: bytes  # the path of a version-1 value (no record)
    old_value: bytes
    damaged: bytes  # the path of a version-2 value whose tenant record fails its check


@pytest.fixture
def filled(target) -> Iterator[Filled]:
    """Through a real store: salt A's chunks, salt B's (two prompts, one with a LoRA adapter), and a
    request without a salt; past the tier: one version-1 value and one with a damaged record."""
    store = target.store()
    chains = {"A": chain_of(1, 3, "A"), "B": chain_of(2, 4, "B"), "B-sql": chain_of(3, 2, "B"),
              "none": chain_of(4, 2)}
    tenants = {"A": TenantId.of("A", None), "B": TenantId.of("B", None), "B-sql": TenantId.of("B", "sql"),
               "none": TenantId.of(None, None)}
    try:
        for name, chain in chains.items():
            assert store.put(chain, [payload(k) for k in chain], tenant=tenants[name]) == len(chain)
        assert store.flush(20)
        namespace = store.tier(target.name).codec.namespace
        old_key, damaged_key = chain_of(5, 1, "B")[0], chain_of(6, 1, "B")[0]
        old = target.path(store, old_key)
        old_value = v1_value(namespace, old_key, payload(old_key))
        target.put_raw(old, old_value)
        damaged = bytearray(ValueCodec(namespace, None).encode(damaged_key, payload(damaged_key),
                                                               writer=TenantId.of("B", None)))
        damaged[sharedvalue.RECORD_OFFSET + 10] ^= 0x01  # inside the record's keyed salt digest
        target.put_raw(target.path(store, damaged_key), bytes(damaged))
        stored = {name: [target.path(store, k) for k in chain] for name, chain in chains.items()}
        for name, paths in stored.items():  # each value carries its writer's record, in the header
            for path, key in zip(paths, chains[name], strict=True):
                value = target.get_raw(path)
                assert value is not None and len(value) == HEADER_BYTES + CHUNK_BYTES
                assert sharedvalue.peek(value[:HEADER_BYTES]).record == \
                    ValueCodec(namespace, None).header(key, payload(key), tenants[name])[
                        sharedvalue.RECORD_OFFSET:sharedvalue.RECORD_OFFSET + 48]
    finally:
        store.close()
    yield Filled(namespace, chains, old, old_value, target.path(store, damaged_key))


def read_back(target: Target, chain: list[ChunkKey]) -> list[bytes]:
    """What a fresh store (an empty cpu tier) loads of ``chain`` from the shared tier."""
    store = target.store()
    try:
        n = shared_prefix(store, chain)
        handle = store.prepare_load(chain, max_chunks=n)
        out = [buf.tobytes() for buf in handle.buffers]
        store.complete_load(handle, True)
        return out
    finally:
        store.close()


def test_salt_purge_removes_exactly_one_tenant_and_the_rest_stays_readable(target, filled):
    config = target.config()
    before = {name: read_back(target, chain) for name, chain in filled.chains.items()}
    assert before == {name: [payload(k) for k in chain] for name, chain in filled.chains.items()}

    dry = purge(config, PurgeSelector(cache_salt="B"), dry_run=True)
    (result,) = [r for r in dry if r.namespace == filled.namespace]
    b_chunks = len(filled.chains["B"]) + len(filled.chains["B-sql"])
    assert (result.tier, result.chunks, result.bytes) == (target.name, b_chunks, b_chunks * (HEADER_BYTES + CHUNK_BYTES))
    assert (result.unknown_tenant, result.damaged_tenant) == (1, 1)  # the version-1 value; the damaged record
    assert len(result.problems) == 1 and "tenant record fails its checksum; kept" in result.problems[0]
    assert read_back(target, filled.chains["B"]) == [payload(k) for k in filled.chains["B"]]  # nothing removed

    done = purge(config, PurgeSelector(cache_salt="B"), dry_run=False)
    assert [(r.namespace, r.chunks, r.bytes, r.unknown_tenant, r.damaged_tenant) for r in done] == \
        [(r.namespace, r.chunks, r.bytes, r.unknown_tenant, r.damaged_tenant) for r in dry]
    assert read_back(target, filled.chains["B"]) == []
    assert read_back(target, filled.chains["B-sql"]) == []
    for name in ("A", "none"):  # the other tenant and the request without a salt: bit for bit
        assert read_back(target, filled.chains[name]) == [payload(k) for k in filled.chains[name]]
    assert target.get_raw(filled.old) == filled.old_value  # an old value: kept, untouched
    assert target.get_raw(filled.damaged) is not None
    again = purge(config, PurgeSelector(cache_salt="B"), dry_run=True)
    assert sum(r.chunks for r in again) == 0 and sum(r.unknown_tenant for r in again) == 1


def test_an_old_value_without_a_record_stays_readable_by_the_tier(target, filled):
    old_key = chain_of(5, 1, "B")[0]
    assert read_back(target, [old_key]) == [payload(old_key)]
    assert sharedvalue.peek(filled.old_value[:HEADER_BYTES]).record is None
    assert len(filled.old_value) == V1_HEADER_BYTES + CHUNK_BYTES


def test_lora_selector_and_a_salt_no_one_used(target, filled):
    config = target.config()
    lora = purge(config, PurgeSelector(lora_name="sql"), dry_run=True)
    assert sum(r.chunks for r in lora) == len(filled.chains["B-sql"])
    both = purge(config, PurgeSelector(cache_salt="A", lora_name="sql"), dry_run=True)
    assert sum(r.chunks for r in both) == 0
    nobody = purge(config, PurgeSelector(cache_salt="C"), dry_run=False)
    assert sum(r.chunks for r in nobody) == 0
    done = purge(config, PurgeSelector(cache_salt="B", lora_name="sql"), dry_run=False)
    assert sum(r.chunks for r in done) == len(filled.chains["B-sql"])
    assert read_back(target, filled.chains["B-sql"]) == []
    assert read_back(target, filled.chains["B"]) == [payload(k) for k in filled.chains["B"]]


def test_cli_salt_purge_json_dry_run_then_purge(target, filled):
    args = ["purge", *target.cli, "--salt", "B", "--json"]
    dry = CliRunner().invoke(app, [*args, "--dry-run"])
    assert dry.exit_code == 1, dry.output  # the damaged record is a problem: exit 1
    report = json.loads(dry.stdout)
    b_chunks = len(filled.chains["B"]) + len(filled.chains["B-sql"])
    assert report["total"] == {"chunks": b_chunks, "bytes": b_chunks * (HEADER_BYTES + CHUNK_BYTES),
                               "unknown_tenant": 1, "damaged_tenant": 1}
    (row,) = [r for r in report["namespaces"] if r["namespace"] == filled.namespace.hex()]
    assert row["tier"] == target.name and row["chunks"] == b_chunks
    assert read_back(target, filled.chains["B"]) == [payload(k) for k in filled.chains["B"]]
    done = CliRunner().invoke(app, args)
    assert json.loads(done.stdout)["total"] == report["total"]
    assert read_back(target, filled.chains["B"]) == []
    assert read_back(target, filled.chains["A"]) == [payload(k) for k in filled.chains["A"]]
    table = CliRunner().invoke(app, ["purge", *target.cli, "--salt", "A", "--dry-run"])
    text = " ".join(table.output.split())  # the footnotes, as rich wrapped them
    assert table.exit_code == 1 and "Kept 1 chunks whose tenant is unknown" in text
    assert "Kept 1 chunks whose tenant record fails its check" in text
