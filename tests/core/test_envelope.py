"""Pinned test vectors and rules of the value envelope (``kvtier.core.envelope``), the one format
the disk, redis and s3 tiers write (issue 33 item 3).  The vectors were computed once and written
down by hand from the layout in the module docstring; a test here fails when the bytes change: a
deliberate format change must bump ``envelope.VERSION`` and add new vectors (the old ones then move
to read-compatibility tests, as the chunk file's and shared value's did in test_format_vectors.py).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest

from kvtier.core import codecs, envelope, tenant
from kvtier.core.errors import ChunkFormatError
from kvtier.core.tiers import sharedvalue
from kvtier.core.tiers.disk import chunkfile

NS, KEY = bytes(range(16)), bytes(range(16, 32))
PAYLOAD = b"kvtier chunk payload"
SALT_B_LORA_SQL = ("4b56544e01030000e47ca3fd7eb127e97d8d5ed5d84a2a29"
                   "d09edfb43ad3431c74d17d914d32ea4b5fcaf9380658c09e")  # tenant record (kvtier.core.tenant)
ENVELOPE_VECTORS = {
    # XXH3-128, the shared tiers' 128-byte header, salt "B" and LoRA "sql"
    "checksum": bytes.fromhex(
        "4b565445" "01" "00" "8000"                    # magic KVTE, version 1, digest kind 0, header bytes 128
        "000102030405060708090a0b0c0d0e0f"             # namespace digest
        "101112131415161718191a1b1c1d1e1f"             # chunk key
        "1400000000000000"                             # stored payload length 20
        "1400000000000000"                             # original payload length 20
        "0000" "01" "0100000000"                       # layout 0, one codec: identity (1)
        + SALT_B_LORA_SQL +                            # tenant record
        "09230ba1981b666a0274243b3b1670a4"),           # XXH3-128 of bytes 0..111 and the payload
    # keyed BLAKE3 MAC (shared_secret), unknown tenant
    "mac": bytes.fromhex(
        "4b565445" "01" "01" "8000"
        "000102030405060708090a0b0c0d0e0f" "101112131415161718191a1b1c1d1e1f"
        "1400000000000000" "1400000000000000" "0000" "01" "0100000000"
        + "00" * 48 +
        "fa7178f988fd05a28ee06f883194cd02"),
    # the disk tier's: header bytes 4096, zero padding after the 128 bytes
    "disk": bytes.fromhex(
        "4b565445" "01" "00" "0010"
        "000102030405060708090a0b0c0d0e0f" "101112131415161718191a1b1c1d1e1f"
        "1400000000000000" "1400000000000000" "0000" "01" "0100000000"
        + "00" * 48 +
        "9daffaef6c8fc7242898b76e9984a982") + bytes(4096 - 128),
}
SECRET = b"0123456789abcdef-secret"


def test_envelope_headers_match_the_pinned_bytes():
    assert envelope.VERSION == 1, "a new envelope VERSION needs new pinned vectors here"
    assert envelope.Envelope(NS).header(KEY, PAYLOAD, writer=tenant.TenantId.of("B", "sql")) == \
        ENVELOPE_VECTORS["checksum"]
    assert envelope.Envelope(NS, SECRET).header(KEY, PAYLOAD) == ENVELOPE_VECTORS["mac"]
    assert envelope.Envelope(NS, header_bytes=envelope.DISK_HEADER_BYTES).header(KEY, PAYLOAD) == \
        ENVELOPE_VECTORS["disk"]
    assert len(ENVELOPE_VECTORS["checksum"]) == sharedvalue.HEADER_BYTES == 128
    assert len(ENVELOPE_VECTORS["disk"]) == chunkfile.HEADER_BYTES == 4096


@pytest.mark.parametrize("name", sorted(ENVELOPE_VECTORS))
def test_pinned_envelopes_decode_and_open(name):
    head = envelope.decode_header(ENVELOPE_VECTORS[name])
    assert (head.format, head.namespace, head.key, head.stored_bytes, head.original_bytes, head.layout,
            head.codecs) == (envelope.FORMAT, NS, KEY, 20, 20, 0, (1,))
    assert head.header_bytes == len(ENVELOPE_VECTORS[name])
    assert head.kind == (envelope.KIND_MAC if name == "mac" else envelope.KIND_CHECKSUM)
    env = envelope.Envelope(NS, SECRET if name == "mac" else None, header_bytes=head.header_bytes)
    out = bytearray(len(PAYLOAD))
    record = env.open_into(KEY, ENVELOPE_VECTORS[name] + PAYLOAD, memoryview(out))
    assert bytes(out) == PAYLOAD
    if name == "checksum":
        rec = envelope.read_record(record)
        assert rec is not None and tenant.matches(rec, NS, "B", "sql") and not tenant.matches(rec, NS, "A", None)
    else:
        assert envelope.read_record(record) is None  # all zero: unknown


@pytest.mark.parametrize("offset", [0, 4, 5, 7, 8, 24, 40, 48, 56, 58, 59, 64, 100, 112, 127, 128 + 19])
def test_every_changed_byte_of_a_value_is_refused(offset):
    """Header fields, the tenant record, the digest and the payload are all covered (the record
    too: a value is never served under a tenant it was not written for)."""
    value = bytearray(ENVELOPE_VECTORS["checksum"] + PAYLOAD)
    value[offset] ^= 0x01
    with pytest.raises(ChunkFormatError):
        envelope.Envelope(NS).open_into(KEY, bytes(value), memoryview(bytearray(len(PAYLOAD))))


def test_a_value_is_refused_under_another_key_namespace_secret_or_length():
    value = ENVELOPE_VECTORS["checksum"] + PAYLOAD
    out = memoryview(bytearray(len(PAYLOAD)))
    with pytest.raises(envelope.EnvelopeError, match="another namespace or key"):
        envelope.Envelope(NS).open_into(bytes(16), value, out)
    with pytest.raises(envelope.EnvelopeError, match="another namespace or key"):
        envelope.Envelope(bytes(16)).open_into(KEY, value, out)
    with pytest.raises(envelope.EnvelopeError, match="shared_secret"):
        envelope.Envelope(NS, SECRET).open_into(KEY, value, out)
    with pytest.raises(envelope.EnvelopeError, match="not the expected 19"):
        envelope.Envelope(NS).open_into(KEY, value, memoryview(bytearray(19)))
    with pytest.raises(envelope.EnvelopeError, match="its 128-byte header says 20 payload bytes follow, but 19 do"):
        envelope.Envelope(NS).open_into(KEY, value[:-1], out)


def test_a_newer_version_an_unknown_codec_or_layout_is_refused_not_misread():
    """A value a later kvtier wrote is a miss here (decode_header still names it for a purge when
    only the version's rules are unknown), never bytes read under rules this release does not know."""
    newer = bytearray(ENVELOPE_VECTORS["checksum"])
    newer[4] = 2
    with pytest.raises(envelope.EnvelopeError, match="envelope version 2"):
        envelope.decode_header(bytes(newer))
    env = envelope.Envelope(NS)
    head = envelope.decode_header(ENVELOPE_VECTORS["checksum"])
    with pytest.raises(envelope.EnvelopeError, match="codec"):
        env.check(head._replace(codecs=(1, 77)), KEY, 20)
    with pytest.raises(envelope.EnvelopeError, match="layout id 3"):
        env.check(head._replace(layout=3), KEY, 20)
    padded = bytearray(ENVELOPE_VECTORS["disk"])
    padded[4000] = 1
    with pytest.raises(envelope.EnvelopeError, match="padding"):
        envelope.decode_header(bytes(padded))


def test_header_and_body_are_separate_so_the_payload_is_never_copied():
    """The redis tier sends (header, payload) as two pieces: the body of a passthrough chain is the
    caller's memory itself, and the two pieces are the same bytes as the one-buffer encoding."""
    payload = bytearray(PAYLOAD)
    sealed = envelope.Envelope(NS).seal(KEY, payload)
    assert sealed.body.obj is payload
    codec = sharedvalue.ValueCodec(NS, None)
    assert bytes(codec.encode(KEY, payload)) == sealed.header + PAYLOAD


def test_decode_header_reads_the_fields_of_both_legacy_formats():
    """``kvtier purge`` and the disk tier's rescan read headers without payloads, any format."""
    legacy_file = chunkfile.encode_header(NS, KEY, 20, chunkfile.payload_digest(PAYLOAD),
                                          bytes.fromhex(SALT_B_LORA_SQL))
    head = envelope.decode_header(legacy_file)
    assert (head.format, head.header_bytes, head.stored_bytes, head.record) == \
        (envelope.FORMAT_CHUNK_FILE, 4096, 20, bytes.fromhex(SALT_B_LORA_SQL))
    env = envelope.Envelope(NS, header_bytes=4096)
    out = bytearray(20)
    assert env.open_into(KEY, legacy_file + PAYLOAD, memoryview(out)) == bytes.fromhex(SALT_B_LORA_SQL)
    assert bytes(out) == PAYLOAD
    with pytest.raises(ChunkFormatError, match="bad magic"):
        envelope.decode_header(b"XXXX" + bytes(200))


# ---- the codec chain -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Deflate:
    """A length-changing codec for this test only (kvtier registers identity alone today)."""

    id: int = 250
    name: str = "test-deflate"
    passthrough: bool = False

    def encode(self, data: memoryview) -> memoryview:
        return memoryview(zlib.compress(data))

    def decode(self, data: memoryview, original_bytes: int) -> memoryview:
        try:
            return memoryview(zlib.decompress(data))
        except zlib.error as exc:
            raise codecs.CodecError(f"deflate: {exc}") from None


@dataclass(frozen=True)
class Flip:
    """A byte-changing, length-keeping codec for this test only: order in a chain matters."""

    id: int = 251
    name: str = "test-flip"
    passthrough: bool = False

    def encode(self, data: memoryview) -> memoryview:
        return memoryview(bytes(b ^ 0x5A for b in data))

    def decode(self, data: memoryview, original_bytes: int) -> memoryview:
        return self.encode(data)


codecs.register(Deflate())
codecs.register(Flip())


def test_codecs_compose_in_a_chain_and_a_reader_undoes_them_in_reverse():
    payload = bytes(4000)  # compressible: the stored length differs from the original
    env = envelope.Envelope(NS, chain=("identity", "test-flip", "test-deflate"))
    sealed = env.seal(KEY, payload, tenant.TenantId.of("B", None))
    head = envelope.decode_header(sealed.header)
    assert head.codecs == (1, 251, 250) and head.original_bytes == 4000
    assert head.stored_bytes == sealed.body.nbytes < 4000
    assert bytes(sealed.body) == zlib.compress(bytes(b ^ 0x5A for b in payload))  # flip first, then deflate
    out = bytearray(4000)
    reader = envelope.Envelope(NS)  # a reader reads any known chain, whatever it writes itself
    record = reader.open_into(KEY, sealed.header + bytes(sealed.body), memoryview(out))
    assert bytes(out) == payload and envelope.read_record(record) is not None
    assert sharedvalue.ValueCodec(NS, None, ("test-deflate",)).encode(KEY, payload)[:4] == b"KVTE"


def test_a_codec_that_fails_is_a_refused_value_and_unknown_names_are_refused():
    env = envelope.Envelope(NS, chain=("test-deflate",))
    sealed = env.seal(KEY, bytes(100))
    garbage = bytes(sealed.body.nbytes)
    header = env.header(KEY, garbage, 100)  # a valid digest over bytes that do not inflate
    with pytest.raises(envelope.EnvelopeError, match="deflate"):
        env.open_into(KEY, header + garbage, memoryview(bytearray(100)))
    with pytest.raises(codecs.CodecError, match="not one this kvtier knows"):
        envelope.Envelope(NS, chain=("lz5",))
    with pytest.raises(ValueError, match="clashes"):
        codecs.register(Deflate(name="another"))


# ---- variable-length and ranged reads (kvtier.core.tiers.valueread), issue 33 item 5 -------------
def test_open_value_reads_any_length_into_a_buffer_at_least_as_long():
    from kvtier.core.tiers.valueread import BufferTooSmall, open_bytes, open_value

    env = envelope.Envelope(NS)
    writer = tenant.TenantId.of("B", "sql")
    for payload in (b"", b"x", PAYLOAD, bytes(range(256)) * 17):
        value = b"".join(env.seal(KEY, payload, writer))
        out = bytearray(b"\xee" * (len(payload) + 3))
        opened = open_value(env, KEY, value, out)
        assert bytes(opened.payload) == payload and out[len(payload):] == b"\xee" * 3
        assert opened.record == tenant.record(NS, writer)
        assert open_bytes(env, KEY, value) == (payload, tenant.record(NS, writer))
        assert bytes(open_value(env, KEY, value).payload) == payload  # a new buffer
        if payload:
            short = bytearray(len(payload) - 1)
            with pytest.raises(BufferTooSmall) as raised:
                open_value(env, KEY, value, short)
            assert raised.value.value_bytes == len(payload) and short == bytes(len(payload) - 1)
    flipped = bytearray(b"".join(env.seal(KEY, PAYLOAD)))
    flipped[envelope.FIXED_BYTES + 3] ^= 0x01
    for read in (lambda: open_value(env, KEY, bytes(flipped)), lambda: open_bytes(env, KEY, bytes(flipped))):
        with pytest.raises(envelope.EnvelopeError, match="digest mismatch"):
            read()
    with pytest.raises(envelope.EnvelopeError, match="another namespace or key"):
        open_bytes(env, bytes(16), b"".join(env.seal(KEY, PAYLOAD)))


def test_payload_range_clips_at_the_end_and_names_no_range_of_an_encoded_payload():
    from kvtier.core.tiers.valueread import payload_range

    env = envelope.Envelope(NS)
    head = envelope.decode_header(env.seal(KEY, PAYLOAD).header)
    base = envelope.FIXED_BYTES
    assert payload_range(env, head, KEY, 0, 4) == (base, base + 4)
    assert payload_range(env, head, KEY, 18, 10) == (base + 18, base + 20)
    assert payload_range(env, head, KEY, 25, 3) == (base + 20, base + 20)
    with pytest.raises(ValueError):
        payload_range(env, head, KEY, -1, 3)
    with pytest.raises(envelope.EnvelopeError):
        payload_range(env, head, bytes(16), 0, 3)  # another key's header
    deflated = envelope.Envelope(NS, chain=("test-deflate",))
    assert payload_range(env, envelope.decode_header(deflated.seal(KEY, bytes(4000)).header), KEY, 0, 3) is None


def test_a_toy_envelope_tier_with_a_compressing_chain_reads_any_length_and_ranges_verified():
    """A tier defined here over a plain dict (kvtier.core.tiers.envelopetier): with a chain that
    changes the payload, whole reads decode it and a ranged read is a whole verified read, sliced,
    so a flipped stored byte is a counted miss there too (and the value removed)."""
    from kvtier.core.keys import ChunkKey
    from kvtier.core.tiers.base import PutResult, TierUsage
    from kvtier.core.tiers.envelopetier import EnvelopeTier

    class Toy(EnvelopeTier):
        name = "toy"

        def __init__(self) -> None:
            super().__init__(NS, chain=("test-deflate",))
            self.values: dict[ChunkKey, bytes] = {}

        def load(self, key):
            return self.values.get(key)

        def store(self, key, value):
            return PutResult.PRESENT if self.values.setdefault(key, value) is not value else PutResult.STORED

        def contains(self, key):
            return key in self.values

        def delete(self, key):
            return self.values.pop(key, None) is not None

        def keys(self):
            return list(self.values)

        def usage(self):
            used = sum(map(len, self.values.values()))
            return TierUsage(used, 0, used, len(self.values))

        def check(self):
            pass

    toy, k = Toy(), ChunkKey(KEY)
    payload = bytes(5000) + PAYLOAD
    assert toy.put(k, payload) is PutResult.STORED and len(toy.values[k]) < len(payload)  # stored compressed
    assert toy.get(k) == payload and toy.get_range(k, 4990, 15) == payload[4990:5005]
    out = bytearray(6000)
    assert toy.read_into(k, memoryview(out)) == len(payload) and bytes(out[:len(payload)]) == payload
    damaged = bytearray(toy.values[k])
    damaged[envelope.FIXED_BYTES + 5] ^= 0x01
    toy.values[k] = bytes(damaged)
    assert toy.get_range(k, 0, 4) is None and toy.corrupt == 1 and not toy.contains(k)
