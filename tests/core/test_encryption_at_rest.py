"""Encryption at rest of the lower tiers (issue 36): chunks written through a real store with
``codecs: {<tier>: [aes-256-gcm]}`` to real files, a real redis-server and a real ``rclone serve
s3`` bucket are searched byte for byte in the raw storage; a store with another master key serves
nothing and counts each value as a decrypt failure; one tenant's data key does not open another's
value; ``kvtier purge --salt`` needs no key and ``kvtier purge --key-id`` removes what an old key
sealed.  Identity (no encryption) runs the same search as the control: there the payloads are found.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import xxhash
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core import encryption, envelope
from kvtier.core.codecs import CodecContext, DecryptError
from kvtier.core.codecstats import codec_numbers
from kvtier.core.keys import ChunkKey
from kvtier.core.store import TieredStore
from kvtier.core.tenant import TenantId, record

from .helpers import CHUNK_BYTES, NS, chain_of, make_store, payload, shared_prefix
from .tier_harness import s3_credentials_file

WINDOW = 64
KEY_A = "first-master-key-0123456789abcdef0123456789"
KEY_B = "second-master-key-0123456789abcdef0123456789"


@dataclass
class Target:
    """One lower tier on real storage: the store's settings, the same target as purge flags, and
    every stored value read past the tier."""

    name: str
    settings: dict[str, Any]
    cli: list[str]
    raw_values: Any  # () -> list[bytes]

    def store(self, key_file: Path | None, **extra: Any) -> TieredStore:
        keys: dict[str, Any] = {}
        if key_file is not None:
            keys = {"codecs": {self.name: ["aes-256-gcm"]}, "encryption": {"master_key_file": str(key_file)}}
        return make_store(None, cpu_chunks=32, write_mode="write-through", shared_deadline_s=5.0,
                          shared_transfer_deadline_s=5.0, **self.settings, **keys, **extra)


@pytest.fixture(params=["disk", "redis_server", "s3_server"])
def target(request, tmp_path, key_prefix) -> Iterator[Target]:
    if request.param == "disk":
        root = tmp_path / "disk"
        yield Target("disk", {"disk_path": str(root), "disk_gib": 0.01}, ["--disk-path", str(root)],
                     lambda: [p.read_bytes() for p in root.rglob("*.kvc")])
        return
    server = request.getfixturevalue(request.param)
    if request.param == "s3_server":
        import obstore

        bucket = server.make_bucket()
        creds = s3_credentials_file(tmp_path, server)
        raw = server.client(bucket)

        def objects() -> list[bytes]:
            return [bytes(obstore.get(raw, meta["path"]).bytes()) for batch in obstore.list(raw) for meta in batch]
        yield Target("s3", {"s3_endpoint_url": server.url, "s3_bucket": bucket, "s3_allow_http": True,
                            "s3_credentials_file": str(creds)},
                     ["--s3-bucket", bucket, "--s3-endpoint-url", server.url, "--s3-allow-http",
                      "--s3-credentials-file", str(creds)], objects)
        return
    client = redis.Redis.from_url(server.url)
    try:
        yield Target("redis", {"redis_url": server.url, "redis_key_prefix": key_prefix, "redis_timeout_s": 5.0},
                     ["--redis-url", server.url, "--redis-key-prefix", key_prefix],
                     lambda: [bytes(client.get(k)) for k in client.scan_iter(match=f"{key_prefix}*")])
    finally:
        client.close()


def key_file(tmp_path: Path, text: str, name: str = "master-key") -> Path:
    path = tmp_path / name
    path.write_text(text + "\n", encoding="utf-8")
    return path


TENANTS = {"A": TenantId.of("tenant-a", None), "B": TenantId.of("tenant-b", None)}


def fill(target: Target, key: Path | None, prompt: int = 1) -> dict[str, list[ChunkKey]]:
    """Two tenants' chunks written through a real store down to ``target`` (write-through, flushed)."""
    store = target.store(key)
    chains = {name: chain_of(prompt + i, 3, name) for i, name in enumerate(TENANTS)}
    try:
        for name, chain in chains.items():
            assert store.put(chain, [payload(k) for k in chain], tenant=TENANTS[name]) == len(chain)
        assert store.flush(30)
    finally:
        store.close()
    return chains


def read_each(store: TieredStore, target: Target, chain: list[ChunkKey]) -> list[bytes | None]:
    """Each chunk of ``chain`` loaded on its own (a failed one cuts only itself): its bytes or ``None``."""
    out: list[bytes | None] = []
    for key in chain:
        n = shared_prefix(store, [key]) if target.name != "disk" else store.lookup([key])
        handle = store.prepare_load([key], max_chunks=max(n, 0))
        out.append(handle.buffers[0].tobytes() if handle.num_chunks else None)
        store.complete_load(handle, True)
    return out


def windows(data: bytes) -> set[bytes]:
    return {data[i:i + WINDOW] for i in range(len(data) - WINDOW + 1)}


@pytest.mark.parametrize("encrypted", [True, False], ids=["aes", "identity-control"])
def test_no_64_byte_sequence_of_a_payload_is_in_the_raw_storage(target, tmp_path, encrypted):
    chains = fill(target, key_file(tmp_path, KEY_A) if encrypted else None)
    stored = target.raw_values()
    assert len(stored) == sum(len(c) for c in chains.values())
    plain: set[bytes] = set()
    for chain in chains.values():
        for k in chain:
            plain |= windows(payload(k))
    found = sum(1 for value in stored for i in range(len(value) - WINDOW + 1) if value[i:i + WINDOW] in plain)
    if encrypted:
        assert found == 0
        header = envelope.DISK_HEADER_BYTES if target.name == "disk" else envelope.FIXED_BYTES
        assert {len(v) - header for v in stored} == {CHUNK_BYTES + encryption.OVERHEAD_BYTES}
    else:  # the control: the search finds plaintext where there is some
        assert found >= len(stored) * (CHUNK_BYTES - WINDOW)


def test_reads_back_exactly_and_a_store_with_another_key_serves_nothing(target, tmp_path):
    chains = fill(target, key_file(tmp_path, KEY_A))
    every = [k for chain in chains.values() for k in chain]
    right = target.store(key_file(tmp_path, KEY_A))
    try:
        assert read_each(right, target, every) == [payload(k) for k in every]
        numbers = codec_numbers(right.tier(target.name))
        assert numbers is not None and numbers.decrypt_failures == 0 and numbers.decoded_bytes >= len(every) * CHUNK_BYTES
    finally:
        right.close()
    if target.name != "disk":  # the cpu tier of the store above is gone; the values stay on the server
        assert len(target.raw_values()) == len(every)
    wrong = target.store(key_file(tmp_path, KEY_B, "other-key"))
    try:
        assert read_each(wrong, target, every) == [None] * len(every)
        numbers = codec_numbers(wrong.tier(target.name))
        assert numbers is not None and numbers.decrypt_failures == len(every)
        assert wrong.metrics.registry.get_sample_value(
            "kvtier_codec_failures_total", {"tier": target.name, "kind": "decrypt"}) == len(every)
        assert wrong.stats().tier(target.name).corrupt_chunks == 0  # not damaged: another engine's key
    finally:
        wrong.close()
    assert len(target.raw_values()) == len(every)  # left in place for the engines that hold the key
    again = target.store(key_file(tmp_path, KEY_A))
    try:
        assert read_each(again, target, every) == [payload(k) for k in every]
    finally:
        again.close()


def test_a_store_with_another_key_offers_none_of_the_values_and_counts_each_once(target, tmp_path):
    """A lookup never offers a value sealed under a key the store's ring lacks (the disk tier does
    not index it; the redis and s3 lookups read each value's header and key id), however often it
    is asked; each value is counted once as a decrypt failure, none as corrupt, and left in place;
    the store with the key that sealed them offers and opens them all."""
    chains = fill(target, key_file(tmp_path, KEY_A))
    every = [k for chain in chains.values() for k in chain]
    wrong = target.store(key_file(tmp_path, KEY_B, "other-key"))
    try:
        for _round in range(3):
            assert [shared_prefix(wrong, chain) for chain in chains.values()] == [0] * len(chains)
        numbers = codec_numbers(wrong.tier(target.name))
        assert numbers is not None and numbers.decrypt_failures == len(every)
        assert wrong.stats().tier(target.name).corrupt_chunks == 0
    finally:
        wrong.close()
    assert len(target.raw_values()) == len(every)
    right = target.store(key_file(tmp_path, KEY_A))
    try:
        assert [shared_prefix(right, chain) for chain in chains.values()] == [len(c) for c in chains.values()]
        assert read_each(right, target, every) == [payload(k) for k in every]
        assert codec_numbers(right.tier(target.name)).decrypt_failures == 0
    finally:
        right.close()


def test_a_store_without_keys_serves_nothing_of_encrypted_values(target, tmp_path):
    chains = fill(target, key_file(tmp_path, KEY_A))
    every = [k for chain in chains.values() for k in chain]
    plain = target.store(None)
    try:
        assert read_each(plain, target, every) == [None] * len(every)
        numbers = codec_numbers(plain.tier(target.name))
        assert numbers is not None and numbers.decrypt_failures == len(every)
    finally:
        plain.close()
    assert len(target.raw_values()) == len(every)


def test_purge_by_salt_needs_no_key_and_purge_by_key_id_removes_what_the_old_key_sealed(target, tmp_path):
    old = key_file(tmp_path, KEY_A, "old-key")
    chains = fill(target, old)
    new = key_file(tmp_path, KEY_B, "new-key")
    rotated = target.store(None, codecs={target.name: ["aes-256-gcm"]},
                           encryption={"master_key_file": str(new), "previous_key_files": [str(old)]})
    later = chain_of(7, 2, "A")
    try:  # after the rotation: old values still open, new ones are sealed under the new key
        assert read_each(rotated, target, chains["A"]) == [payload(k) for k in chains["A"]]
        assert rotated.put(later, [payload(k) for k in later], tenant=TENANTS["A"]) == 2
        assert rotated.flush(30)
    finally:
        rotated.close()
    runner = CliRunner()
    old_id = encryption.key_id_of(KEY_A.encode()).hex()
    dry = runner.invoke(app, ["purge", *target.cli, "--key-id", old_id, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["total"]["chunks"] == 6  # both tenants' old values; not the 2 new ones
    by_salt = runner.invoke(app, ["purge", *target.cli, "--salt", "tenant-b", "--json"])  # no key given
    assert by_salt.exit_code == 0, by_salt.output
    assert json.loads(by_salt.output)["total"]["chunks"] == 3
    done = runner.invoke(app, ["purge", *target.cli, "--key-id", old_id, "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["total"]["chunks"] == 3  # tenant A's old values (B's went with its salt)
    left = target.raw_values()
    assert len(left) == 2
    reader = target.store(None, codecs={target.name: ["aes-256-gcm"]}, encryption={"master_key_file": str(new)})
    try:
        assert read_each(reader, target, later) == [payload(k) for k in later]
    finally:
        reader.close()
    bad = runner.invoke(app, ["purge", *target.cli, "--key-id", "xyz"])
    assert bad.exit_code == 2 and "8 hex digits" in bad.output


# ---- the codec itself, on values in memory ----------------------------------------------------------
NSD = NS.digest()
RING = encryption.KeyRing(encryption.MasterKey.of(KEY_A.encode()))
KEY = ChunkKey(bytes(range(16)))
OTHER_KEY = ChunkKey(bytes(range(1, 17)))


def sealed(writer: TenantId, data: bytes, key: ChunkKey = KEY) -> bytes:
    env = envelope.Envelope(NSD, chain=("aes-256-gcm",), keyring=RING)
    head, body = env.seal(key, data, writer)
    return head + body.tobytes()


def reseal_header(value: bytes, writer: TenantId) -> bytes:
    """``value`` with its header's tenant record replaced by ``writer``'s and its XXH3 digest made
    valid again (what someone with write access to the storage can do without any key)."""
    raw = bytearray(value)
    raw[envelope.RECORD_OFFSET:envelope.DIGEST_OFFSET] = record(NSD, writer)
    h = xxhash.xxh3_128(bytes(raw[:envelope.DIGEST_OFFSET]))
    h.update(bytes(raw[envelope.FIXED_BYTES:]))
    raw[envelope.DIGEST_OFFSET:envelope.FIXED_BYTES] = h.digest()
    return bytes(raw)


def test_one_tenants_key_does_not_open_another_tenants_value():
    data = payload(KEY)
    value_b = sealed(TENANTS["B"], data)
    env = envelope.Envelope(NSD, chain=("aes-256-gcm",), keyring=RING)
    out = memoryview(bytearray(len(data)))
    env.open_into(KEY, value_b, out)
    assert out.tobytes() == data
    moved = reseal_header(value_b, TENANTS["A"])  # B's ciphertext under A's record: opened with A's data key
    with pytest.raises(envelope.EnvelopeError, match="authentication failed"):
        env.open_into(KEY, moved, memoryview(bytearray(len(data))))
    assert env.stats.snapshot().decrypt_failures == 1
    key_a = encryption.data_key(RING.current, NSD, record(NSD, TENANTS["A"]))
    key_b = encryption.data_key(RING.current, NSD, record(NSD, TENANTS["B"]))
    assert key_a != key_b and len(key_a) == 32
    ctx = CodecContext(NSD, record(NSD, TENANTS["A"]), RING, lambda _n: value_b[:envelope.DIGEST_OFFSET])
    with pytest.raises(DecryptError):  # A's data key on B's payload, B's own header as associated data
        encryption.AES_GCM.unseal(memoryview(value_b)[envelope.FIXED_BYTES:], ctx, None)


def test_a_header_swapped_between_values_and_a_flipped_bit_fail():
    data = payload(KEY)
    env = envelope.Envelope(NSD, chain=("aes-256-gcm",), keyring=RING)
    one, two = sealed(TENANTS["A"], data), sealed(TENANTS["A"], data[::-1], OTHER_KEY)
    swapped = bytearray(two[:envelope.FIXED_BYTES] + one[envelope.FIXED_BYTES:])  # KEY's payload, OTHER_KEY's header
    fixed = reseal_header(bytes(swapped), TENANTS["A"])  # digest made valid: only the tag can tell
    with pytest.raises(envelope.EnvelopeError, match="authentication failed"):
        env.open_into(OTHER_KEY, fixed, memoryview(bytearray(len(data))))
    flipped = bytearray(one)
    flipped[envelope.FIXED_BYTES + 40] ^= 0x04
    with pytest.raises(envelope.EnvelopeError):
        env.open_into(KEY, reseal_header(bytes(flipped), TENANTS["A"]), memoryview(bytearray(len(data))))
    assert env.stats.snapshot().decrypt_failures == 2


def test_a_disk_tier_reads_values_of_every_chain_after_config_changes(tmp_path):
    """Real KV-like bytes (bf16 values of a smooth tensor) written under identity, then
    blosc2 + aes-256-gcm, then aes-256-gcm alone, into one directory: a tier under any of the
    chains (with the keys) reads all of them exactly; the compressed file is smaller."""
    from kvtier.core.tiers.disk.tier import DiskTier

    rng = np.random.default_rng(0)
    kv = (rng.standard_normal(CHUNK_BYTES * 8) * 0.05).astype(np.float32)
    bf16 = (kv.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # exponents alike, mantissas noisy
    chains = [("identity",), ("blosc2-zstd-shuffle2", "aes-256-gcm"), ("aes-256-gcm",)]
    keys = [ChunkKey(bytes([i]) * 16) for i in range(len(chains))]
    sizes = []
    for chain, key in zip(chains, keys, strict=True):
        tier = DiskTier(tmp_path, NSD, 1 << 30, codec_args={"chain": chain, "keyring": RING})
        assert tier.put(key, bf16, TENANTS["A"]).name == "STORED"
        sizes.append(tier.path(key).stat().st_size)
        tier.close()
    assert sizes[1] < 0.9 * sizes[0] < sizes[2]  # compressed, then sealed; sealed alone adds 32 bytes
    for chain in chains:
        reader = DiskTier(tmp_path, NSD, 1 << 30, codec_args={"chain": chain, "keyring": RING})
        out = memoryview(bytearray(len(bf16)))
        for key in keys:
            assert reader.get_into(key, out).name == "HIT" and out.tobytes() == bf16
            assert reader.get(key) == bf16
        assert reader.corrupt == 0
        reader.close()


# ---- values sealed under a key this process does not hold: never adopted, never offered ----------
RING_B = encryption.KeyRing(encryption.MasterKey.of(KEY_B.encode()))


def _disk(root: Path, ring: encryption.KeyRing | None) -> Any:
    from kvtier.core.tiers.disk.tier import DiskTier

    return DiskTier(root, NSD, 1 << 30, codec_args={"chain": ("aes-256-gcm",) if ring is not None else ("identity",),
                                                    "keyring": ring})


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.rglob("*.kvc")}


def test_a_disk_tier_with_another_key_adopts_none_of_the_values_counts_each_once_and_leaves_them(tmp_path):
    """Issue 36's done-when on the disk tier itself: a tier opened on A's files with key B indexes
    none of them (so a lookup offers none: ``contains`` and ``keys``), counts each file once as a
    decrypt failure at start-up (again on none of the later rescans, reads or writes of those keys),
    never replaces one (a write of such a key is refused: another engine's value), and leaves every
    file as it was; files A writes while B runs are found by B's rescan and treated the same way;
    the tier with key A afterwards opens them all."""
    keys = [ChunkKey(bytes([i]) * 16) for i in range(5)]
    writer = _disk(tmp_path, RING)
    for key in keys[:3]:
        assert writer.put(key, payload(key), TENANTS["A"]).name == "STORED"
    before = _files(tmp_path)
    assert len(before) == 3
    wrong = _disk(tmp_path, RING_B)
    try:
        assert not any(wrong.contains(k) for k in keys) and wrong.keys() == [] and wrong.usage()[::3] == (0, 0)
        assert codec_numbers(wrong).decrypt_failures == 3  # each file once, at start-up
        for key in keys[3:]:  # written by A while B runs: B's rescan finds them and adopts none
            assert writer.put(key, payload(key), TENANTS["A"]).name == "STORED"
        found = wrong.rescan()
        assert found.adopted == [] and found.corrupt == 0 and {k for k, _id in found.sealed_away} == set(keys[3:])
        assert {kid for _k, kid in found.sealed_away} == {RING.current.key_id}
        assert wrong.rescan().sealed_away == []  # remembered: not read again
        for key in keys:  # every way in: a miss, nothing counted twice, nothing written over
            assert wrong.get_into(key, memoryview(bytearray(CHUNK_BYTES))).name == "MISS"
            assert wrong.get(key) is None and wrong.get_range(key, 0, 16) is None
            assert wrong.put(key, payload(key)[::-1], TENANTS["A"]).name == "FAILED"
        assert not any(wrong.contains(k) for k in keys) and wrong.keys() == []
        numbers = codec_numbers(wrong)
        assert numbers.decrypt_failures == len(keys) and wrong.corrupt == 0
        wrong.check()
    finally:
        wrong.close()
    assert len(_files(tmp_path)) == len(keys)  # every file still there
    assert {n: v for n, v in _files(tmp_path).items() if n in before} == before  # not one byte changed
    writer.close()
    gone = keys[0]  # once its file is removed (kvtier purge --key-id), the key is written as any other
    wrong = _disk(tmp_path, RING_B)
    try:
        wrong.path(gone).unlink()
        assert wrong.put(gone, payload(gone), TENANTS["A"]).name == "STORED" and wrong.contains(gone)
        assert wrong.get(gone) == payload(gone) and codec_numbers(wrong).decrypt_failures == len(keys)
        wrong.delete(gone)
    finally:
        wrong.close()
    restore = _disk(tmp_path, RING)  # A writes it again
    assert restore.put(gone, payload(gone), TENANTS["A"]).name == "STORED"
    restore.close()
    again = _disk(tmp_path, RING)  # the key that sealed them: every value opens
    try:
        assert sorted(again.keys()) == sorted(keys) and codec_numbers(again).decrypt_failures == 0
        out = memoryview(bytearray(CHUNK_BYTES))
        for key in keys:
            assert again.get_into(key, out).name == "HIT" and out.tobytes() == payload(key)
    finally:
        again.close()


def test_a_disk_tier_without_keys_stops_offering_an_encrypted_file_after_its_first_read(tmp_path):
    """Without a key ring the start-up stays a listing (no header is read), so the files are
    indexed; the first read of each is a miss counted as a decrypt failure, and from then on the
    key is neither contained nor counted again, and the file stays."""
    keys = [ChunkKey(bytes([i]) * 16) for i in range(3)]
    writer = _disk(tmp_path, RING)
    for key in keys:
        assert writer.put(key, payload(key), TENANTS["A"]).name == "STORED"
    writer.close()
    before = _files(tmp_path)
    plain = _disk(tmp_path, None)
    try:
        assert all(plain.contains(k) for k in keys)
        out = memoryview(bytearray(CHUNK_BYTES))
        for _round in range(2):
            assert [plain.get_into(k, out).name for k in keys] == ["MISS"] * len(keys)
        assert not any(plain.contains(k) for k in keys) and plain.keys() == []
        assert codec_numbers(plain).decrypt_failures == len(keys) and plain.corrupt == 0
        assert plain.rescan().adopted == []
    finally:
        plain.close()
    assert _files(tmp_path) == before


def test_the_shared_lookups_memory_of_unopenable_values_is_bounded():
    """:class:`~kvtier.core.tiers.sealedaway.SealedAway` answers from the header it is given (no
    memory needed for the answer) and remembers the last ``max_keys`` keys only to count each
    value once: a key it forgot is counted again when met again."""
    from kvtier.core.codecstats import CodecStats
    from kvtier.core.tiers.sealedaway import LOOKUP_HEAD_BYTES, SealedAway

    keys = [ChunkKey(bytes([i]) * 16) for i in range(3)]
    heads = [sealed(TENANTS["A"], payload(k), k)[:LOOKUP_HEAD_BYTES] for k in keys]
    stats = CodecStats()
    lookups = SealedAway(RING_B, stats, max_keys=2)
    assert lookups.openable(keys, heads) == [False] * 3 and stats.snapshot().decrypt_failures == 3
    assert lookups.openable(keys[1:], heads[1:]) == [False] * 2 and stats.snapshot().decrypt_failures == 3
    assert len(lookups) == 2
    assert lookups.openable(keys[:1], heads[:1]) == [False] and stats.snapshot().decrypt_failures == 4  # forgotten
    held = SealedAway(RING, CodecStats())  # the ring that sealed them: present; absent stays absent
    assert held.openable(keys + keys[:1], [*heads, b""]) == [True, True, True, False]
    plain = SealedAway(None, CodecStats())
    assert not plain.reads_heads and plain.openable(keys[:1], heads[:1]) == [False]


def test_a_disk_tier_warns_when_files_sealed_under_another_key_leave_too_little_room(tmp_path, caplog):
    """A master key replaced without ``previous_key_files``: A's files stay in the directory, never
    evicted by the tier with key B, and take room on the filesystem; where that leaves less than B's
    capacity, every write past the free space fails (ENOSPC; an outside probe: 22 of 30 writes on an
    8 MiB tmpfs) while the tier shows its size free.  B's start-up says so, with the sizes and what to
    do; a capacity that still fits says nothing.  (A's file is made 1 TiB long, sparse, so the sizes
    hold whatever else the host's filesystem does meanwhile.)"""
    import logging
    import shutil

    from kvtier.core.tiers.disk.tier import DiskTier

    key = ChunkKey(bytes([7]) * 16)
    writer = _disk(tmp_path, RING)
    assert writer.put(key, payload(key), TENANTS["A"]).name == "STORED"
    with open(writer.path(key), "r+b") as f:  # its header and payload stay; its size grows, no blocks written
        f.truncate(1 << 40)
    writer.close()
    free = shutil.disk_usage(tmp_path).free

    def start(capacity: int) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            tier = DiskTier(tmp_path, NSD, capacity, codec_args={"chain": ("aes-256-gcm",), "keyring": RING_B})
            tier.close()
        return [r.getMessage() for r in caplog.records if "can hold" in r.getMessage()]

    (line,) = start(free + (1 << 39))
    assert "take 1,048,576.0 MiB" in line and "encryption.previous_key_files" in line and "kvtier purge --key-id" in line
    assert start(free // 2) == []
