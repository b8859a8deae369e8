"""Pinned vectors of the codecs of issue 36 (ids are forever: ``aes-256-gcm`` 16,
``blosc2-zstd-shuffle2`` 32, ``blosc2-zstd-shuffle4`` 33).  Computed once and written down: a
test here fails when a stored value of today would no longer open tomorrow (a changed key id or
data key derivation, another associated data, a decoder that reads the frame otherwise).  A
deliberate change takes new codec ids and new vectors, never these."""

from kvtier.core import codecs, compression, encryption, envelope, tenant

MASTER = encryption.MasterKey.of(b"kvtier test vector master key 0123456789")
NS, KEY = bytes(range(16)), bytes(range(16, 32))
PAYLOAD = b"kvtier chunk payload" * 4
RECORD = tenant.record(NS, tenant.TenantId.of("salt-a", None))
KEY_ID = "a600f9e7"
DATA_KEY = "215779891cb43728d3c898588c25411f8954dbecafd2be4ed401b1ba8ee964cd"
SEALED = bytes.fromhex(
    "4b56544501008000000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f7000000000000000"
    "500000000000000000000110000000004b56544e01010000b3dd8616b813de96ab18ffb29193f2aa0000000000000000"
    "000000000000000051e26f92573e55e812781c7b285364f05c7027aa6531cabda600f9e76465666768696a6b6c6d6e6f"
    "2faa503ea44d316e4e63f6b2cdb742cfab6d21dbb3ccb46970a2dc1676641ae159f34c5aed2da1cdb91f619e4e18df74"
    "f4871f0b55c64d925e1d5a27f882c941a1a901940d6cca14d62db181708300a32a20d55f1edfe9d4fb27fa3d864a1851")
"""An envelope (chain: 16) whose payload is key id | nonce 100..111 | AES-256-GCM of PAYLOAD."""
FRAME = bytes.fromhex(
    "0501850250000000500000005e00000001000000000005000000000000000000240000001900000028b52ffd2028850000"
    "506b746520686e20616c610100150b121900000028b52ffd20288500005076697263756b70796f640100150b12")
"""blosc2 4.15's frame of PAYLOAD under blosc2-zstd-shuffle2."""


def test_the_codec_ids_are_the_pinned_ones():
    assert codecs.chain_of(["aes-256-gcm"]).ids == (16,)
    assert codecs.chain_of(["blosc2-zstd-shuffle2", "aes-256-gcm"]).ids == (32, 16)
    assert codecs.chain_of(["blosc2-zstd-shuffle4"]).ids == (33,)


def test_key_id_and_data_key_derivation_are_pinned():
    assert MASTER.hex_id == KEY_ID
    assert encryption.data_key(MASTER, NS, RECORD).hex() == DATA_KEY


def test_the_pinned_sealed_value_opens_and_any_change_does_not():
    env = envelope.Envelope(NS, chain=("aes-256-gcm",), keyring=encryption.KeyRing(MASTER))
    out = memoryview(bytearray(len(PAYLOAD)))
    assert env.open_into(KEY, SEALED, out) == RECORD and out.tobytes() == PAYLOAD
    head = envelope.decode_header(SEALED)
    assert (head.codecs, head.stored_bytes, head.original_bytes) == ((16,), len(PAYLOAD) + 32, len(PAYLOAD))


def test_the_pinned_blosc2_frame_decodes():
    back = compression.BLOSC2_ZSTD_2.decode(memoryview(FRAME), len(PAYLOAD))
    assert back.tobytes() == PAYLOAD
    again = compression.BLOSC2_ZSTD_2.encode(memoryview(PAYLOAD))
    assert compression.BLOSC2_ZSTD_2.decode(again, len(PAYLOAD)).tobytes() == PAYLOAD
