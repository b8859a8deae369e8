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

from kvtier.core import envelope
from kvtier.core.config import KVTierConfig
from kvtier.core.envelopedigest import DIGEST_BYTES, mac_key
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import GetResult, PutResult, TierContext, builtin
from kvtier.core.tiers.node import protocol
from kvtier.core.tiers.node.readcopy import COPY_BLOCK_BYTES, Verifier, copy_hashed
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
        assert verifier.copy(key, memoryview(value), memoryview(dst), False).result() == env.record(None)
        assert bytes(dst) == body
        for at in sorted({0, nbytes // 2, nbytes - 1}) if nbytes else []:
            changed = bytearray(value)
            changed[envelope.FIXED_BYTES + at] ^= 0x10
            with pytest.raises(envelope.EnvelopeError, match="digest mismatch"):
                verifier.copy(key, memoryview(changed), memoryview(bytearray(nbytes)), False).result()
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
