"""The node tier's fused copy-and-digest (:mod:`kvtier.core.tiers.node.readcopy`, issue 38): a
value's payload copied out of the pool a block at a time, each block hashed right after it is
copied. The digest it computes equals the one-shot digest of the whole payload (the writer's) at
any length and block size, for both digest kinds; a changed byte in any block is refused; and
through the real tier (a ``kvtier node serve`` owner) a value with a changed byte in its first,
a middle or its last block is a counted miss while the rest of the batch is served exactly."""

from __future__ import annotations

import blake3
import numpy as np
import pytest
import xxhash
from prometheus_client import CollectorRegistry

from kvtier.core import envelope, tenant
from kvtier.core.config import KVTierConfig
from kvtier.core.envelopedigest import DIGEST_BYTES, mac_key
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import GetResult, PutResult, TierContext, builtin
from kvtier.core.tiers.node import protocol
from kvtier.core.tiers.node.pool import create_pool
from kvtier.core.tiers.node.readcopy import COPY_BLOCK_BYTES, Verifier, copy_hashed, settle
from kvtier.core.tiers.node.tier import NodeTier
from kvtier.core.tiers.wrappers import unwrap

NS = bytes(range(16))
SECRET = b"s" * 32
BLOCK = 1000  # small blocks, so a few KiB span many of them
SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7]


def payload(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def one_shot(secret: bytes | None, fields: bytes, body: bytes) -> bytes:
    """The digest of ``fields + body`` in one call, straight from the library (not the envelope's hasher)."""
    if secret is None:
        return xxhash.xxh3_128_digest(fields + body)
    return blake3.blake3(fields + body, key=mac_key(secret)).digest(DIGEST_BYTES)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["xxh3", "mac"])
@pytest.mark.parametrize("block_bytes", [1, 7, BLOCK, COPY_BLOCK_BYTES])
def test_the_fused_digest_is_the_one_shot_digest_of_the_copy_at_any_length(secret, block_bytes):
    """0 bytes, 1 byte, one short of a block, a block, one past and several blocks plus a tail: the
    copy is the payload and its digest is the one-shot digest of the header fields and payload,
    the one the writer put in the header."""
    env = envelope.Envelope(NS, secret)
    for nbytes in SIZES:
        body = payload(nbytes, nbytes)
        head = env.header(bytes(16), body)
        fields = head[:envelope.DIGEST_OFFSET]
        out = bytearray(b"\xee" * nbytes)
        digest = copy_hashed(env.hasher(fields), memoryview(body), memoryview(out), block_bytes)
        assert bytes(out) == body, nbytes
        assert digest == one_shot(secret, fields, body) == head[envelope.DIGEST_OFFSET:envelope.FIXED_BYTES], nbytes


def test_a_copy_into_a_buffer_of_another_length_is_refused():
    env = envelope.Envelope(NS)
    with pytest.raises(ValueError, match="cannot copy 5 bytes into 4"):
        copy_hashed(env.hasher(b""), memoryview(b"12345"), memoryview(bytearray(4)))
    with pytest.raises(ValueError, match="in blocks of 0"):
        copy_hashed(env.hasher(b""), memoryview(b"1"), memoryview(bytearray(1)), 0)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["xxh3", "mac"])
def test_the_verifier_serves_every_length_and_refuses_a_changed_byte_in_any_block(secret):
    """A stored value (header and payload, as the pool holds it) read through the inline way with
    :data:`BLOCK`-byte blocks: served exactly at every length; with one byte changed in the first,
    a middle or the last block (the short tail), refused (``EnvelopeError``: the tier's miss)."""
    env = envelope.Envelope(NS, secret)
    verifier = Verifier(env)
    verifier.block_bytes = BLOCK
    key = ChunkKey(bytes(range(100, 116)))
    for nbytes in SIZES:
        body = payload(nbytes, 50 + nbytes)
        value = bytearray(env.header(bytes(key), body, writer=None) + body)
        dst = bytearray(nbytes)
        assert settle(verifier.copy(key, memoryview(value), memoryview(dst), False)) == env.record(None)
        assert bytes(dst) == body
        for at in sorted({0, nbytes // 2, nbytes - 1}) if nbytes else []:
            changed = bytearray(value)
            changed[envelope.FIXED_BYTES + at] ^= 0x10
            with pytest.raises(envelope.EnvelopeError, match="digest mismatch"):
                settle(verifier.copy(key, memoryview(changed), memoryview(bytearray(nbytes)), False))
    verifier.close()


def test_a_changed_byte_in_the_first_a_middle_or_the_last_block_of_a_pooled_value_is_a_miss(node_server):
    """Through the tier as an engine builds it (GuardedTier over NodeTier, a real owner): values of
    2.5 blocks (:data:`COPY_BLOCK_BYTES`), one byte changed in the pool in the first block of one,
    a middle block of another and the tail of a third: those three are counted misses (deleted),
    the other three are served exactly, inline and overlapped alike."""
    chunk = COPY_BLOCK_BYTES * 5 // 2
    config = KVTierConfig.from_dict({"node_socket": node_server.socket, "shared_deadline_s": 5.0,
                                     "shared_transfer_deadline_s": 5.0, "node_timeout_s": 5.0})
    tier = builtin.NODE.build(TierContext(config, NS, chunk, 1, CollectorRegistry()))
    assert tier is not None
    inner = unwrap(tier)
    assert isinstance(inner, NodeTier)
    try:
        for overlap in (False, True):
            inner.verifier.overlap = overlap
            keys = [ChunkKey(bytes([overlap, i]) * 8) for i in range(6)]
            datas = [payload(chunk, 10 * overlap + i) for i in range(6)]
            assert tier.put_many(keys, datas) == [PutResult.STORED] * 6
            where = {1: 0, 3: COPY_BLOCK_BYTES + 12345, 5: chunk - 1}  # value index -> payload byte changed
            reply, pool, serial = inner.client.call(protocol.Pin(NS, [bytes(keys[i]) for i in where], []))
            for (lease, page, nbytes, _gen), at in zip(reply.leases, where.values(), strict=True):
                pool.value(page, nbytes)[envelope.FIXED_BYTES + at] ^= 0x01
            inner.client.release_later(serial, [pin[0] for pin in reply.leases])
            outs = [bytearray(chunk) for _ in keys]
            got = tier.get_many(keys, [memoryview(o) for o in outs])
            assert got == [GetResult.CORRUPT if i in where else GetResult.HIT for i in range(6)], overlap
            assert [bytes(outs[i]) for i in (0, 2, 4)] == [datas[i] for i in (0, 2, 4)]
            assert tier.get_many(keys, [memoryview(bytearray(chunk)) for _ in keys]) == \
                [GetResult.MISS if i in where else GetResult.HIT for i in range(6)]  # deleted, not served
    finally:
        tier.close()


def test_a_header_this_envelope_did_not_write_for_this_key_and_length_is_checked_field_by_field():
    """The whole-header comparison (no decoding) serves only what the field-by-field path accepts:
    a value of this envelope, with a tenant record, gives that record back; values of another key,
    namespace, length or digest kind are refused with the general path's reasons; a value with a
    padded header (the disk tier's 4096 bytes) is still served, through the general path."""
    env = envelope.Envelope(NS)
    verifier = Verifier(env)
    key = ChunkKey(bytes(range(100, 116)))
    body = payload(3000, 7)
    writer = tenant.TenantId(b"s" * 16, b"l" * 16)
    value = env.header(bytes(key), body, writer=writer) + body
    dst = bytearray(3000)
    assert settle(verifier.copy(key, memoryview(value), memoryview(dst), False)) == env.record(writer)
    assert bytes(dst) == body and env.record(writer) != env.record(None)
    refused = {
        "another namespace or key": (env.header(bytes(16), body) + body, 3000),
        "different shared_secret": (envelope.Envelope(NS, SECRET).header(bytes(key), body) + body, 3000),
        "is not the expected 2999": (value, 2999),
    }
    other_ns = envelope.Envelope(bytes(16))
    refused["another namespace or key "] = (other_ns.header(bytes(key), body) + body, 3000)
    for reason, (stored, length) in refused.items():
        with pytest.raises(envelope.EnvelopeError, match=reason.strip()):
            settle(verifier.copy(key, memoryview(stored), memoryview(bytearray(length)), False))
    padded = envelope.Envelope(NS, header_bytes=envelope.DISK_HEADER_BYTES)
    dst = bytearray(3000)
    assert settle(verifier.copy(key, memoryview(padded.header(bytes(key), body) + body), memoryview(dst), False)) \
        == env.record(None)
    assert bytes(dst) == body
    verifier.close()


def test_the_batch_generation_check_agrees_with_the_check_of_each_value(tmp_path):
    """:meth:`Pool.same_generations` over a batch of values of 1 to 5 pages, in any order, with a
    page of some of them stamped with another generation (its first, a middle or its last page)
    and one reaching past the pool's end: the same answers as :meth:`Pool.same_generation` of
    each value alone (past the end: ``False``)."""
    page_bytes = 4096
    pool = create_pool(tmp_path / "pool", 4096 + 64 * 4096 + (4 << 20), page_bytes)
    try:
        rng = np.random.default_rng(3)
        pool.gens[:] = rng.integers(1, 1000, pool.num_pages)
        pins = []
        page = 0
        for n, size in enumerate([1, 4096, 4097, 3 * 4096, 5 * 4096 - 1, 200, 2 * 4096 + 1]):
            npages = pool.pages_of(size)
            pool.gens[page:page + npages] = 5000 + n
            pins.append((n, page, size, 5000 + n))
            page += npages
        pool.gens[pins[2][1] + 1] += 1  # the last page of a 2-page value
        pool.gens[pins[3][1] + 1] += 1  # a middle page
        pool.gens[pins[4][1]] += 1  # the first page of a 5-page value
        pins.append((99, pool.num_pages - 1, 2 * page_bytes, int(pool.gens[-1])))  # past the end
        order = [pins[i] for i in rng.permutation(len(pins))]
        each = [pool.same_generation(p[1], p[2], p[3]) and p[1] + pool.pages_of(p[2]) <= pool.num_pages
                for p in order]
        assert pool.same_generations(order) == each
        assert {p[0] for p, same in zip(order, each) if same} == {0, 1, 5, 6}
        assert [pool.same_generations([p]) for p in order] == [[e] for e in each]
    finally:
        pool.close()


def test_a_batch_with_a_corrupt_and_a_reused_value_serves_the_rest_and_releases_every_lease(node_server):
    """One batch through the tier as an engine builds it: one value with a changed payload byte
    (a counted miss, deleted), one whose page was stamped with a newer generation after its pin
    (a page reused under an expired pin: a miss, not counted as corrupt, though its bytes were
    changed too), the other four served exactly; afterwards no lease of the batch is left."""
    config = KVTierConfig.from_dict({"node_socket": node_server.socket, "shared_deadline_s": 5.0,
                                     "shared_transfer_deadline_s": 5.0, "node_timeout_s": 5.0})
    chunk = 3 * 4096 + 5
    tier = builtin.NODE.build(TierContext(config, NS, chunk, 1, CollectorRegistry()))
    assert tier is not None
    inner = unwrap(tier)
    assert isinstance(inner, NodeTier)
    try:
        keys = [ChunkKey(bytes([7, i]) * 8) for i in range(6)]
        datas = [payload(chunk, 30 + i) for i in range(6)]
        assert tier.put_many(keys, datas) == [PutResult.STORED] * 6
        corrupt_before = tier.wire_stats().corrupt_values
        fetched = inner.fetch_many(keys)  # the wire half of the read, then the pool changed under it
        pins, pool, _serial, _early = fetched
        assert all(pin is not None for pin in pins)
        _lease, page, nbytes, gen = pins[1]
        pool.value(page, nbytes)[envelope.FIXED_BYTES + 100] ^= 0x01
        _lease, page, nbytes, gen = pins[4]
        pool.value(page, nbytes)[nbytes - 1] ^= 0x01
        pool.gens[page + pool.pages_of(nbytes) - 1] = gen + 10_000  # its last page granted again
        outs = [bytearray(chunk) for _ in keys]
        got = inner.finish_get(keys, fetched, [memoryview(o) for o in outs])
        assert got == [GetResult.HIT, GetResult.CORRUPT, GetResult.HIT, GetResult.HIT, GetResult.MISS, GetResult.HIT]
        assert [bytes(outs[i]) for i in (0, 2, 3, 5)] == [datas[i] for i in (0, 2, 3, 5)]
        assert tier.wire_stats().corrupt_values == corrupt_before + 1
        inner.client.flush()  # the batch's six releases, queued by finish_get
        assert node_server.stats().leases == 0
    finally:
        tier.close()
