"""Pinned test vectors for the formats that outlive a process: the chunk-key derivation
(``kvtier.core.keys``), and the value formats the release before the envelope wrote, the chunk-file
header version 2 and the shared value headers versions 1 and 2 (``kvtier.core.legacyformats``),
now read-compatibility tests: no tier writes them, every tier still reads them.  The envelope's
own vectors are in test_envelope.py.

Chunk files written today are read by tomorrow's process, possibly another kvtier version; if a
key or a header changed silently, old files would be misread or (worse) served under the wrong
key.  These vectors were computed once and written down by hand.  A test here fails when the
bytes change: a deliberate format change must bump ``KEY_FORMAT_VERSION`` / ``VERSION`` and add
the new vectors under the new version number.
"""

import pytest

from kvtier.core.errors import ChunkFormatError
from kvtier.core.keys import KEY_FORMAT_VERSION, Namespace, chunk_keys, request_root
from kvtier.core.tiers.disk import chunkfile

NS = Namespace(model="m", kv_dtype="bfloat16", num_layers=32, num_kv_heads=8, head_size=128, layout="L",
               chunk_tokens=4, extra=(("block_size", "16"),))

KEY_VECTORS = {
    1: {
        "namespace": "da68396a28c604d4407bfa3f6921c144",
        "root": "2efc4225c805bbd753e350f499c886c8",
        "root_salt_lora_mm": "da8de1ec4e42df460193cc3f835aef96",
        "chunks_of_range_10": ["abc95f3b7f8c3c6da6288ed7c03da51c", "c387b99a930ad560d686b3e7adaab949"],
    },
}

PAYLOAD = b"kvtier chunk payload"
HEADER_VECTORS = {
    1: bytes.fromhex(
        "4b565443" "0100" "5000"                       # magic KVTC, version 1, header size 80
        "000102030405060708090a0b0c0d0e0f"             # namespace digest
        "101112131415161718191a1b1c1d1e1f"             # chunk key
        "1400000000000000"                             # payload length 20
        "0343a33cded7a4aa294106bf7c67d3b1"             # XXH3-128 of the payload
        "810d167561b9fe57"                             # XXH3-64 of bytes 0..63
        "0000000000000000"),                           # reserved
    2: bytes.fromhex(
        "4b565443" "0200" "0010"                       # magic KVTC, version 2, header block 4096
        "000102030405060708090a0b0c0d0e0f"             # namespace digest
        "101112131415161718191a1b1c1d1e1f"             # chunk key
        "1400000000000000"                             # payload length 20
        "0343a33cded7a4aa294106bf7c67d3b1"             # XXH3-128 of the payload
        "1ca12611fa0805a6"                             # XXH3-64 of bytes 0..63
        "0000000000000000") + bytes(4096 - 80),        # reserved, to the 4096-byte payload offset
}


def test_key_format_version_has_pinned_vectors():
    assert KEY_FORMAT_VERSION in KEY_VECTORS, (
        f"KEY_FORMAT_VERSION {KEY_FORMAT_VERSION} has no pinned vectors: add them to KEY_VECTORS")


def test_chunk_keys_match_the_pinned_vectors():
    want = KEY_VECTORS[KEY_FORMAT_VERSION]
    root = request_root(NS)
    assert NS.digest().hex() == want["namespace"]
    assert root.hex() == want["root"]
    assert request_root(NS, cache_salt="s", lora="a", mm_hashes=["x", "y"]).hex() == want["root_salt_lora_mm"]
    assert [k.hex() for k in chunk_keys(root, list(range(10)), 4)] == want["chunks_of_range_10"]


def test_chunk_header_matches_the_pinned_bytes():
    assert chunkfile.VERSION in HEADER_VECTORS, (
        f"chunk format VERSION {chunkfile.VERSION} has no pinned header: add it to HEADER_VECTORS")
    pinned = HEADER_VECTORS[chunkfile.VERSION]
    assert len(pinned) == chunkfile.HEADER_BYTES == 4096
    header = chunkfile.encode_header(bytes(range(16)), bytes(range(16, 32)), len(PAYLOAD),
                                     chunkfile.payload_digest(PAYLOAD))
    assert header == pinned


def test_pinned_header_decodes_to_its_fields():
    header = chunkfile.decode_header(HEADER_VECTORS[chunkfile.VERSION])
    assert header == chunkfile.ChunkHeader(2, bytes(range(16)), bytes(range(16, 32)), len(PAYLOAD),
                                           chunkfile.payload_digest(PAYLOAD))


def test_version_1_header_is_refused_as_an_older_format():
    """Version 1 files are no longer read; the disk tier turns this error into a counted miss."""
    with pytest.raises(ChunkFormatError, match="unsupported chunk format version 1"):
        chunkfile.decode_header(HEADER_VECTORS[1])


@pytest.mark.parametrize("offset", [4, 64, 250, 4095])  # version; header checksum; reserved bytes
def test_a_changed_pinned_header_is_refused(offset):
    raw = bytearray(HEADER_VECTORS[chunkfile.VERSION])
    raw[offset] ^= 0x01
    with pytest.raises(ChunkFormatError):
        chunkfile.decode_header(bytes(raw))


def test_a_changed_tenant_record_is_unknown_not_a_refused_header():
    """Bytes 72..199 hold the tenant record (kvtier.core.tenant), which has its own checksum: a flipped
    bit there makes the record unknown (never matched by kvtier purge --salt) and leaves the chunk readable."""
    from kvtier.core import envelope, tenant

    ns = bytes(range(16))
    rec = tenant.record(ns, tenant.TenantId.of("B", None))
    header = chunkfile.encode_header(ns, bytes(range(16, 32)), len(PAYLOAD), chunkfile.payload_digest(PAYLOAD), rec)
    decoded = envelope.decode_record(chunkfile.decode_header(header).tenant)
    assert decoded is not None and tenant.matches(decoded, ns, "B", None)
    assert not tenant.matches(decoded, ns, "A", None)
    raw = bytearray(header)
    raw[chunkfile.TENANT_OFFSET + 10] ^= 0x01
    assert envelope.decode_record(chunkfile.decode_header(bytes(raw)).tenant) is None


# ---- shared values (the redis and s3 tiers: kvtier.core.tiers.sharedvalue) ----------------------
SHARED_NS, SHARED_KEY = bytes(range(16)), bytes(range(16, 32))
SHARED_HEADER_VECTORS = {
    # version 1: before the tenant record (64 bytes); still read, never written
    1: "4b56545201000000000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f14000000000000"
       "0087bbcb0e441672711c762ad8ed7d29c8",
    # version 2: salt "B", LoRA "sql", XXH3-128 (112 bytes; the record at 48..95)
    2: "4b56545202000000000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f14000000000000"
       "004b56544e01030000e47ca3fd7eb127e97d8d5ed5d84a2a29d09edfb43ad3431c74d17d914d32ea4b5fcaf9380658"
       "c09e538c23c5c7257248c6d503dd3a911a9d",
}
SHARED_MAC_UNKNOWN_TENANT = (
    "4b56545202000100000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f1400000000000000"
    "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
    "e1a213781cb13cfcfb60d1725c467fbb")


def test_legacy_shared_values_of_both_versions_are_still_read():
    """Values the release before the envelope wrote (versions 1 and 2, never written any more)
    are read and verified: their payload comes back bit for bit, a version-2 value's tenant record
    with it, and a purge still names them by their header alone."""
    from kvtier.core import envelope, tenant
    from kvtier.core.tiers.sharedvalue import (
        HEADER_BYTES,
        V1_HEADER_BYTES,
        V2_HEADER_BYTES,
        SharedValueError,
        ValueCodec,
        peek,
    )

    codec = ValueCodec(SHARED_NS, None)
    for version, header_bytes in ((1, V1_HEADER_BYTES), (2, V2_HEADER_BYTES)):
        value = bytes.fromhex(SHARED_HEADER_VECTORS[version]) + PAYLOAD
        assert len(value) == header_bytes + len(PAYLOAD)
        assert codec.decode(SHARED_KEY, value, len(PAYLOAD)) == (header_bytes, len(PAYLOAD))
        out = bytearray(len(PAYLOAD))
        record = codec.open_into(SHARED_KEY, value, memoryview(out))
        assert bytes(out) == PAYLOAD
        assert (record is None) == (version == 1)
        assert peek(value[:HEADER_BYTES]).key == SHARED_KEY  # a purge's ranged read of the new header size
    assert peek(bytes.fromhex(SHARED_HEADER_VECTORS[1]) + PAYLOAD).record is None  # no record: unknown tenant
    v2 = bytes.fromhex(SHARED_HEADER_VECTORS[2]) + PAYLOAD
    record = envelope.read_record(peek(v2).record)
    assert record is not None and tenant.matches(record, SHARED_NS, "B", "sql")
    mac = bytes.fromhex(SHARED_MAC_UNKNOWN_TENANT) + PAYLOAD
    out = bytearray(len(PAYLOAD))
    assert ValueCodec(SHARED_NS, b"0123456789abcdef-secret").open_into(SHARED_KEY, mac, memoryview(out)) == \
        bytes(envelope.RECORD_BYTES)
    assert bytes(out) == PAYLOAD
    with pytest.raises(SharedValueError, match="shared_secret"):
        codec.open_into(SHARED_KEY, mac, memoryview(out))
    changed = bytearray(v2)
    changed[60] ^= 0x01  # inside the record: the value's digest covers it, so a read refuses the value
    with pytest.raises(SharedValueError, match="digest mismatch"):
        codec.decode(SHARED_KEY, bytes(changed), len(PAYLOAD))
    with pytest.raises(envelope.DamagedRecord):  # and the purge, which reads the header alone, never trusts it
        envelope.read_record(peek(bytes(changed)).record)


def test_the_blob_verbs_read_the_formats_of_the_release_before(tmp_path, redis_server):
    """A legacy chunk file (version 2) in a disk tier and legacy shared values (versions 1 and 2,
    64- and 112-byte headers) on a real Redis come back through the blob verbs: whole reads verified
    bit for bit, ranged reads at the payload offset the old header names (on Redis a second
    ``GETRANGE``: the first assumes the envelope's 128-byte header)."""
    from kvtier.core.keys import ChunkKey
    from kvtier.core.tiers.disk.tier import DiskTier
    from kvtier.core.tiers.wrappers import unwrap

    from .tier_harness import make_redis_tier

    key = ChunkKey(SHARED_KEY)
    shard = tmp_path / SHARED_NS.hex() / SHARED_KEY.hex()[:2]
    shard.mkdir(parents=True)
    (shard / f"{SHARED_KEY.hex()}.kvc").write_bytes(HEADER_VECTORS[2] + PAYLOAD)
    disk = DiskTier(tmp_path, SHARED_NS, capacity_bytes=1 << 20)
    try:
        assert disk.get(key) == PAYLOAD and disk.get_range(key, 3, 5) == PAYLOAD[3:8]
        assert disk.get_range(key, 18, 10) == PAYLOAD[18:] and disk.corrupt == 0
    finally:
        disk.close()
    redis = make_redis_tier(redis_server.url, SHARED_NS, "legacy-blobs:")
    raw = redis_server.client()
    try:
        for version in (1, 2):
            raw.set(unwrap(redis).rkey(key), bytes.fromhex(SHARED_HEADER_VECTORS[version]) + PAYLOAD)
            assert redis.get_range(key, 3, 5) == PAYLOAD[3:8]
            assert redis.get_range(key, 0, 100) == PAYLOAD and redis.get_range(key, 20, 1) == b""
            out = bytearray(64)
            assert redis.read_into(key, memoryview(out)) == len(PAYLOAD) and bytes(out[:20]) == PAYLOAD
            raw.delete(unwrap(redis).rkey(key))
        assert redis.corrupt == 0
    finally:
        redis.close()
