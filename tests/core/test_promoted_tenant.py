"""A chunk promoted from a shared tier keeps its writer's tenant (issue 22): loaded from the real
redis tier (tests/redis_servers.py) or s3 tier (``rclone serve s3``, tests/s3_servers.py) into
the cpu tier of a store with a disk tier, then written down to the disk tier (write-back
eviction, or the graceful stop's ``flush_dirty``), the disk file carries the same tenant record
the writer put in the shared value, so ``kvtier purge --salt`` on the disk finds it.  Only a
verified value gives its record: a value whose record fails its own check (digest intact) is
promoted as of an unknown tenant, and one whose digest fails is never promoted at all."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvtier.core import envelope, tenant
from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.purge import PurgeSelector, purge
from kvtier.core.quota import NO_SALT_LABEL
from kvtier.core.store import TieredStore
from kvtier.core.tenant import TenantId
from kvtier.core.tiers import sharedvalue
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES as DISK_HEADER_BYTES
from kvtier.core.tiers.disk.chunkfile import TENANT_OFFSET
from kvtier.core.tiers.sharedvalue import ValueCodec

from .helpers import CHUNK_BYTES, chain_of, make_store, payload, shared_prefix
from .tier_harness import s3_credentials_file

DEADLINES = {"shared_deadline_s": 5.0, "shared_transfer_deadline_s": 5.0}
CPU_CHUNKS = 4


@dataclass
class Shared:
    """One shared tier on a real server: its name, the store's keys for it, a raw writer past it."""

    name: str
    settings: dict[str, Any]
    put_raw: Any  # (store, key, value bytes) -> None


@pytest.fixture(params=["redis_server", "s3_server"])
def shared(request, key_prefix, tmp_path) -> Iterator[Shared]:
    server = request.getfixturevalue(request.param)
    if request.param == "s3_server":
        import obstore

        bucket = server.make_bucket()
        creds = s3_credentials_file(tmp_path, server)
        raw_s3 = server.client(bucket)

        def put_s3(store: TieredStore, key: ChunkKey, value: bytes) -> None:
            obstore.put(raw_s3, store.tier("s3").object_key(key), value)

        yield Shared("s3", {"s3_endpoint_url": server.url, "s3_bucket": bucket, "s3_allow_http": True,
                            "s3_credentials_file": str(creds)}, put_s3)
        return
    import redis

    client = redis.Redis.from_url(server.url)

    def put_redis(store: TieredStore, key: ChunkKey, value: bytes) -> None:
        client.set(store.tier("redis").rkey(key), value, ex=86400)

    try:
        yield Shared("redis", {"redis_url": server.url, "redis_key_prefix": key_prefix, "redis_timeout_s": 5.0},
                     put_redis)
    finally:
        client.close()


def writer_store(shared: Shared) -> TieredStore:
    """Another engine: cpu + the shared tier only, saving with its requests' tenants."""
    return make_store(None, cpu_chunks=64, **shared.settings, **DEADLINES)


def reader_store(shared: Shared, disk: Path, **overrides: Any) -> TieredStore:
    """This engine: a small cpu tier, a disk tier (write-back) and the shared tier."""
    return make_store(disk, cpu_chunks=CPU_CHUNKS, disk_chunks=64, **shared.settings, **DEADLINES, **overrides)


def load(store: TieredStore, chain: list[ChunkKey]) -> list[bytes]:
    """What ``store`` loads of ``chain`` (the shared tier asked, chunks promoted into cpu pages)."""
    n = shared_prefix(store, chain)
    handle = store.prepare_load(chain, max_chunks=n)
    out = [buf.tobytes() for buf in handle.buffers]
    store.complete_load(handle, True)
    return out


def disk_purge(disk: Path, selector: PurgeSelector) -> tuple[int, int, int]:
    """``(chunks, unknown_tenant, damaged_tenant)`` a dry-run purge of the disk tier alone reports."""
    config = KVTierConfig.from_dict({"disk_path": str(disk / "disk")})
    results = purge(config, selector, dry_run=True, keys={"disk_path"})
    assert results and all(not r.problems for r in results), [r.problems for r in results]
    return (sum(r.chunks for r in results), sum(r.unknown_tenant for r in results),
            sum(r.damaged_tenant for r in results))


def disk_record(store: TieredStore, key: ChunkKey) -> bytes:
    """The tenant record in the header of ``key``'s chunk file (read from the file itself)."""
    header = Path(store.tier("disk").path(key)).read_bytes()[:DISK_HEADER_BYTES]
    return header[TENANT_OFFSET:TENANT_OFFSET + envelope.RECORD_BYTES]


def test_promoted_chunks_written_down_by_eviction_keep_the_writers_tenant(shared, tmp_path):
    b_chain, none_chain = chain_of(1, CPU_CHUNKS, "B"), chain_of(2, 2)
    writer = writer_store(shared)
    try:
        assert writer.put(b_chain, [payload(k) for k in b_chain], tenant=TenantId.of("B", None)) == len(b_chain)
        assert writer.put(none_chain, [payload(k) for k in none_chain], tenant=TenantId.of(None, None)) == 2
        assert writer.flush(20)
    finally:
        writer.close()

    reader = reader_store(shared, tmp_path)
    try:
        assert load(reader, b_chain) == [payload(k) for k in b_chain]  # promoted from the shared tier
        assert not any(reader.tier("disk").indexed(k) for k in b_chain)
        # this engine's own saves need the pages: B's promoted chunks are evicted, written back to disk
        a_chain = chain_of(3, CPU_CHUNKS, "A")
        assert reader.put(a_chain, [payload(k) for k in a_chain], tenant=TenantId.of("A", None)) == CPU_CHUNKS
        assert reader.flush(20)
        assert all(reader.tier("disk").indexed(k) for k in b_chain)
        namespace = reader.tier(shared.name).codec.namespace
        want = tenant.record(namespace, TenantId.of("B", None))
        assert [disk_record(reader, k) for k in b_chain] == [want] * CPU_CHUNKS
    finally:
        reader.close()

    assert disk_purge(tmp_path, PurgeSelector(cache_salt="B"))[0] == CPU_CHUNKS
    assert disk_purge(tmp_path, PurgeSelector(cache_salt="C"))[0] == 0  # a salt no one used matches nothing


def test_flush_dirty_writes_a_promoted_chunk_with_its_tenant_and_quotas_know_the_no_salt_tenant(shared, tmp_path):
    b_chain, none_chain = chain_of(1, 2, "B"), chain_of(2, 2)
    writer = writer_store(shared)
    try:
        writer.put(b_chain, [payload(k) for k in b_chain], tenant=TenantId.of("B", "sql"))
        writer.put(none_chain, [payload(k) for k in none_chain], tenant=TenantId.of(None, None))
        assert writer.flush(20)
    finally:
        writer.close()

    reader = reader_store(shared, tmp_path, tenant_quotas={"no_salt_share": 0.5})
    try:
        assert load(reader, b_chain) + load(reader, none_chain) == [payload(k) for k in b_chain + none_chain]
        cpu = reader.stats().tiers[reader.cpu.name]
        # the no-salt record gives the quotas its tenant; a salted record's digest is keyed: unknown to them
        assert cpu.tenant_used_bytes.get(NO_SALT_LABEL) == 2 * CHUNK_BYTES
        assert reader.flush_dirty(20) == (4, 0)
    finally:
        reader.close()

    assert disk_purge(tmp_path, PurgeSelector(cache_salt="B", lora_name="sql")) == (2, 0, 0)
    assert disk_purge(tmp_path, PurgeSelector(lora_name="sql")) == (2, 0, 0)
    assert disk_purge(tmp_path, PurgeSelector(cache_salt="B", lora_name="other"))[0] == 0


def test_only_a_verified_value_gives_its_record(shared, tmp_path):
    good, bad_record, bad_digest = chain_of(5, 1, "B")[0], chain_of(6, 1, "B")[0], chain_of(7, 1, "B")[0]
    reader = reader_store(shared, tmp_path)
    try:
        namespace = reader.tier(shared.name).codec.namespace
        codec = ValueCodec(namespace, None)
        shared.put_raw(reader, good, bytes(codec.encode(good, payload(good), writer=TenantId.of("B", None))))
        # a record that fails its own check under a digest that covers it (a writer that put garbage there)
        fields = bytearray(codec.header(bad_record, payload(bad_record), TenantId.of("B", None))[:envelope.DIGEST_OFFSET])
        fields[sharedvalue.RECORD_OFFSET + 10] ^= 0x01
        digest = codec.envelope.hasher(bytes(fields))
        digest.update(payload(bad_record))
        value = bytes(fields) + digest.digest() + payload(bad_record)
        shared.put_raw(reader, bad_record, value)
        # a record changed on the server: the value's digest fails, so it is a miss and never promoted
        tampered = bytearray(codec.encode(bad_digest, payload(bad_digest), writer=TenantId.of("A", None)))
        tampered[sharedvalue.RECORD_OFFSET + 10] ^= 0x01
        shared.put_raw(reader, bad_digest, bytes(tampered))

        assert load(reader, [good]) == [payload(good)]
        assert load(reader, [bad_record]) == [payload(bad_record)]
        assert load(reader, [bad_digest]) == []
        assert reader.flush_dirty(20) == (2, 0)
        assert disk_record(reader, good) == tenant.record(namespace, TenantId.of("B", None))
        assert not reader.tier("disk").indexed(bad_digest)
    finally:
        reader.close()

    # the damaged record was not carried: the disk file's tenant is unknown, never a wrong or damaged one
    assert disk_purge(tmp_path, PurgeSelector(cache_salt="B")) == (1, 1, 0)
    assert disk_purge(tmp_path, PurgeSelector(cache_salt="A")) == (0, 1, 0)


def legacy_v2_value(namespace: bytes, key: bytes, data: bytes, record: bytes) -> bytes:
    """A value as the release before the envelope wrote it (shared value format version 2: 112-byte
    header, XXH3-128 over the first 96 bytes and the payload), built from its documented layout
    (kvtier.core.legacyformats)."""
    fields = struct.pack("<4sHBB16s16sQ", b"KVTR", 2, 0, 0, namespace, key, len(data)) + record
    digest = xxhash.xxh3_128(fields)
    digest.update(data)
    return fields + digest.digest() + data


def test_a_value_of_the_release_before_is_read_and_its_record_written_down(shared, tmp_path):
    """A shared value of format version 2, left on the server by the release before the envelope, is
    read bit for bit, its tenant record travels with it, and the disk tier writes both as an envelope."""
    old = chain_of(8, 1, "B")[0]
    reader = reader_store(shared, tmp_path)
    try:
        namespace = reader.tier(shared.name).codec.namespace
        record = tenant.record(namespace, TenantId.of("B", None))
        shared.put_raw(reader, old, legacy_v2_value(namespace, old, payload(old), record))
        assert load(reader, [old]) == [payload(old)]
        assert reader.flush_dirty(20) == (1, 0)
        assert disk_record(reader, old) == record
        header = Path(reader.tier("disk").path(old)).read_bytes()[:DISK_HEADER_BYTES]
        assert envelope.decode_header(header).format == envelope.FORMAT
    finally:
        reader.close()
    assert disk_purge(tmp_path, PurgeSelector(cache_salt="B")) == (1, 0, 0)


def test_a_chunk_promoted_from_disk_and_written_back_keeps_its_record(tmp_path):
    """The disk tier's own record travels the same way: a chunk read from its file into the cpu
    tier, then written to the disk again (here: the disk tier alone was reset, as vLLM's reset with
    a scope does, and the chunk is then evicted from the cpu tier, write-back), gets the record its
    file had, not an unknown one."""
    chain = chain_of(8, 3, "B")
    store = make_store(tmp_path, cpu_chunks=CPU_CHUNKS, disk_chunks=64, io_threads=2)
    try:
        assert store.put(chain, [payload(k) for k in chain], tenant=TenantId.of("B", None)) == 3
        assert store.flush_dirty(20) == (3, 0)
        want = tenant.record(store.tier("disk").namespace, TenantId.of("B", None))
        assert [disk_record(store, k) for k in chain] == [want] * 3
        store.clear([store.cpu.name])
        assert store.get(chain) == [payload(k) for k in chain]  # promoted from the disk files (2 helper threads)
        store.clear(["disk"])
        assert not any(store.tier("disk").indexed(k) for k in chain)
        other = chain_of(9, CPU_CHUNKS, "A")  # this engine's next saves need every page: B's go down again
        assert store.put(other, [payload(k) for k in other], tenant=TenantId.of("A", None)) == CPU_CHUNKS
        assert store.flush(20)
        assert [disk_record(store, k) for k in chain] == [want] * 3
    finally:
        store.close()
    assert disk_purge(tmp_path, PurgeSelector(cache_salt="B")) == (3, 0, 0)
