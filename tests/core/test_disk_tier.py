"""Disk tier: crash-safe files, restart recovery, and corruption as a counted miss, each in
buffered and O_DIRECT mode (the ``disk_io`` fixture of tests/core/conftest.py)."""

import errno
import itertools
import os
import struct
import time

import numpy as np
import pytest
import xxhash

from kvtier.core import envelope, tenant
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import DiskTier, GetResult, PutResult
from kvtier.core.tiers.disk import chunkfile, iomode
from kvtier.core.tiers.disk import tier as disk_tier
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.core.tiers.disk.chunkio import O_DIRECT, aligned_buffer
from kvtier.core.tiers.disk.directory import STALE_TMP_S

CHUNK = 8192
NS = b"n" * 16


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def data(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


@pytest.fixture
def where(disk_io):
    """(mode, directory) of the tier under test."""
    return disk_io


def make(where, namespace=NS, **kwargs):
    mode, root = where
    tier = DiskTier(root, namespace, capacity_bytes=100 * CHUNK, io=mode, **kwargs)
    assert tier.io_mode == mode
    return tier


@pytest.fixture
def disk(where):
    tier = make(where)
    for i in range(3):
        assert tier.put(key(i), data(i)) is PutResult.STORED
    yield tier
    tier.close()


def read(tier, i, records=None):
    out = bytearray(CHUNK)
    return bytes(out) if tier.get_into(key(i), memoryview(out), records) is GetResult.HIT else None


def test_restart_rebuilds_index(disk, where):
    again = make(where)
    assert again.usage().num_chunks == 3
    assert again.usage().used_bytes == 3 * (CHUNK + HEADER_BYTES)
    assert read(again, 1) == data(1)


def test_stale_temp_files_removed_on_restart_fresh_ones_kept(disk, where):
    stale = disk.path(key(7)).with_name("x.kvc.123.456.tmp")
    stale.write_bytes(b"partial")
    old = time.time() - STALE_TMP_S - 10
    os.utime(stale, (old, old))
    fresh = disk.path(key(8)).with_name("y.kvc.123.456.tmp")  # another live process is writing it
    fresh.write_bytes(b"partial")
    make(where)
    assert not stale.exists() and fresh.exists()


def corrupt_cases():
    def flip(path):
        raw = bytearray(path.read_bytes())
        raw[HEADER_BYTES + 100] ^= 0xFF
        path.write_bytes(bytes(raw))

    def flip_header(path):
        raw = bytearray(path.read_bytes())
        raw[45] ^= 0x01  # inside the length field
        path.write_bytes(bytes(raw))

    def truncate(path):
        os.truncate(path, HEADER_BYTES + CHUNK // 2)

    def truncate_header(path):
        os.truncate(path, 20)

    def garbage(path):
        path.write_bytes(b"\0" * (CHUNK + HEADER_BYTES))

    def extra(path):
        with open(path, "ab") as f:
            f.write(b"tail")

    return [flip, flip_header, truncate, truncate_header, garbage, extra]


@pytest.mark.parametrize("damage", corrupt_cases(), ids=lambda f: f.__name__)
def test_corrupt_file_is_a_counted_miss_never_wrong_bytes(disk, damage, caplog):
    damage(disk.path(key(1)))
    assert read(disk, 1) is None
    assert disk.corrupt == 1
    assert not disk.contains(key(1)) and not disk.path(key(1)).exists()
    assert "unusable" in caplog.text
    assert read(disk, 0) == data(0) and read(disk, 2) == data(2)
    disk.check()


def test_foreign_namespace_file_is_a_miss(disk, where):
    other = make(where, b"o" * 16)
    other.put(key(9), data(9))
    # an operator copies a file between namespaces: it must not be served
    target = disk.path(key(9))
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(other.path(key(9)).read_bytes())
    assert read(disk, 9) is None and disk.corrupt == 1


def test_file_renamed_to_another_key_is_a_miss(disk):
    src, dst = disk.path(key(0)), disk.path(key(5))
    dst.parent.mkdir(exist_ok=True)
    dst.write_bytes(src.read_bytes())
    assert read(disk, 5) is None and disk.corrupt == 1


def test_files_from_another_process_are_adopted_by_a_rescan_only(where):
    """``contains`` has no side effect: another process's file is unknown (and uncounted) until
    an explicit rescan indexes it, counted in usage; one it deletes is then a plain miss."""
    a, b = make(where), make(where)
    a.put(key(4), data(4))
    assert not b.contains(key(4)) and not b.contains(key(4))  # asking twice changes nothing
    assert b.usage().num_chunks == 0 and b.usage_exact() == 0
    assert b.rescan().adopted == [key(4)]
    assert b.contains(key(4)) and read(b, 4) == data(4)
    assert b.usage_exact() == CHUNK + HEADER_BYTES
    a.delete(key(4))
    assert read(b, 4) is None and not b.contains(key(4))  # deleted elsewhere: a plain miss, forgotten
    assert b.usage_exact() == 0
    b.check()


def test_fifo_at_a_chunk_path_is_a_miss_not_a_hang(disk):
    path = disk.path(key(1))
    path.unlink()
    os.mkfifo(path)
    assert read(disk, 1) is None and disk.corrupt == 1


def test_unremovable_entry_is_counted_and_logged_once(disk, caplog):
    path = disk.path(key(1))
    path.unlink()
    path.mkdir()
    (path / "inside").write_text("x")  # a non-empty directory cannot be unlinked
    for _ in range(3):
        assert read(disk, 1) is None
    assert disk.corrupt == 1 and caplog.text.count("unusable") == 1


def test_failed_writes_are_counted_and_logged_once_per_interval(disk, caplog, monkeypatch):
    """A full disk fails every write; one warning line per interval, not one per chunk (breaker F10:
    123 lines in a second), and the next line says how many failed in between."""
    import shutil

    monkeypatch.setattr(disk._write_warnings, "interval_s", 1.0)
    shard = disk.path(key(100)).parent  # keys 0..255 share shard 00
    shutil.rmtree(shard)
    shard.write_text("a file where the shard directory was")  # every write below fails (ENOTDIR)
    for i in range(100, 150):
        assert disk.put(key(i), data(i)) == PutResult.FAILED
    assert disk.write_errors == 50
    assert caplog.text.count("chunk not stored") == 1 and "more chunk writes failed" not in caplog.text
    time.sleep(1.1)
    assert disk.put(key(150), data(150)) == PutResult.FAILED
    assert disk.write_errors == 51 and caplog.text.count("chunk not stored") == 2
    assert "49 more chunk writes failed since the last such line" in caplog.text
    assert not list(disk.dir.rglob("*.tmp")) and read(disk, 100) is None


def test_a_new_write_failure_cause_is_logged_at_once(disk, caplog):
    """The rate limit is per cause: a shard directory removed fails writes with ENOENT, then a file
    in its place with ENOTDIR; both causes reach the log within the 10 s interval, each once."""
    import shutil

    shard = disk.path(key(100)).parent  # keys 0..255 share shard 00
    shutil.rmtree(shard)
    for i in range(100, 110):
        assert disk.put(key(i), data(i)) == PutResult.FAILED
    assert disk.last_write_error == os.strerror(errno.ENOENT)
    shard.write_text("a file where the shard directory was")
    for i in range(110, 120):
        assert disk.put(key(i), data(i)) == PutResult.FAILED
    assert disk.write_errors == 20 and disk.last_write_error == os.strerror(errno.ENOTDIR)
    lines = [r.getMessage() for r in caplog.records if "chunk not stored" in r.getMessage()]
    assert len(lines) == 2, lines
    assert f"({os.strerror(errno.ENOENT)})" in lines[0] and f"({os.strerror(errno.ENOTDIR)})" in lines[1]


def test_files_outside_their_shard_are_not_indexed(disk, where):
    src = disk.path(key(0))
    wrong = disk.dir / "zz"
    wrong.mkdir()
    (wrong / src.name).write_bytes(src.read_bytes())
    again = make(where)
    assert again.usage().num_chunks == 3
    again.check()


def test_reserved_header_bytes_are_checked(disk):
    path = disk.path(key(2))
    raw = bytearray(path.read_bytes())
    raw[250] = 1  # in the envelope's zero padding (128..4095), which a reader checks
    path.write_bytes(bytes(raw))
    assert read(disk, 2) is None and disk.corrupt == 1


def test_a_changed_tenant_record_fails_the_envelope_digest(disk):
    """The envelope's digest covers its tenant record (kvtier.core.envelope), as the shared tiers'
    always did: a changed record makes the chunk a counted miss, never served under a wrong tenant."""
    path = disk.path(key(2))
    raw = bytearray(path.read_bytes())
    raw[envelope.RECORD_OFFSET + 3] ^= 1
    path.write_bytes(bytes(raw))
    assert read(disk, 2) is None and disk.corrupt == 1


def test_files_of_the_release_before_the_envelope_are_indexed_at_restart_and_read(disk, where):
    """An upgraded engine finds the version-2 chunk files its predecessor left (same directory:
    the namespace does not change) and serves them bit for bit, tenant record included; what it
    writes itself is an envelope."""
    path = disk.path(key(7))
    payload = data(7)
    record = tenant.record(disk.namespace, tenant.TenantId.of("B", "sql"))
    path.write_bytes(chunkfile.encode_header(disk.namespace, key(7), len(payload), chunkfile.payload_digest(payload),
                                             record) + payload)
    again = make(where)
    try:
        assert again.contains(key(7)) and again.usage().num_chunks == 4
        records: tenant.TenantRecords = {}
        assert read(again, 7, records) == payload and again.corrupt == 0
        assert records[key(7)].raw == record
        torn = bytearray(path.read_bytes())
        torn[-1] ^= 1  # the legacy payload checksum still guards it
        path.write_bytes(bytes(torn))
        assert read(again, 7) is None and again.corrupt == 1
        assert again.put(key(8), data(8)) is PutResult.STORED
        assert envelope.decode_header(again.path(key(8)).read_bytes()[:HEADER_BYTES]).format == envelope.FORMAT
    finally:
        again.close()


def test_a_legacy_file_with_a_damaged_tenant_record_stays_readable(disk):
    """A version-2 chunk file (before the envelope) kept its record outside its checksums: a bad one
    makes the tenant unknown and leaves the chunk readable, as that release read it."""
    path = disk.path(key(2))
    payload = data(2)
    record = bytearray(tenant.record(disk.namespace, tenant.TenantId.of("B", None)))
    record[3] ^= 1
    header = chunkfile.encode_header(disk.namespace, key(2), len(payload), chunkfile.payload_digest(payload),
                                     bytes(record))
    path.write_bytes(header + payload)
    records: tenant.TenantRecords = {}
    assert read(disk, 2, records) == payload and disk.corrupt == 0
    assert records == {}  # the damaged record is not kept: the tenant is unknown


# ---- sizes, slices, alignment and formats (both modes) -----------------------------------------
def odd_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


STRATEGIES = ["default", "overlapped", "split"]


def sliced(where, strategy, monkeypatch):
    """A tier with 8 KiB slices; ``overlapped``: every read pipelined and every write hashed on a
    helper; ``split``: every buffered read split over two threads (disk_tier.ReadChooser)."""
    if strategy == "split" and where[0] != "buffered":
        pytest.skip("split reads are a buffered-mode strategy")
    tier = DiskTier(where[1], NS, capacity_bytes=1 << 20, io=where[0], slice_bytes=8192)
    if strategy == "overlapped":
        tier._io.pipeline, tier._io.overlap_min_bytes = True, 0
    monkeypatch.setattr(disk_tier.CHOOSER, "force", "split" if strategy == "split" else "serial")
    return tier


@pytest.mark.parametrize("length", [0, 1, 4095, 4096, 8192 * 3 + 17, 8192 * 4, 100_003])
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_roundtrip_any_length_and_buffer_alignment(where, length, misaligned, strategy, monkeypatch):
    tier = sliced(where, strategy, monkeypatch)
    src_store = aligned_buffer(length + 8)
    src = src_store[1:length + 1] if misaligned else src_store[:length]
    src[:] = odd_bytes(length, length)
    assert tier.put(key(length), src) is PutResult.STORED
    assert os.path.getsize(tier.path(key(length))) == HEADER_BYTES + length
    dst_store = aligned_buffer(length + 8)
    dst = dst_store[3:length + 3] if misaligned else dst_store[:length]
    assert tier.get_into(key(length), dst) is GetResult.HIT
    assert bytes(dst) == bytes(src) and tier.corrupt == 0
    tier.close()


def sliced_damage():
    def flip_last_slice(path):
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0x01
        path.write_bytes(bytes(raw))

    def flip_first_slice(path):
        raw = bytearray(path.read_bytes())
        raw[HEADER_BYTES] ^= 0x80
        path.write_bytes(bytes(raw))

    def truncate_mid_slices(path):
        os.truncate(path, HEADER_BYTES + 8192 * 2 + 5)

    def zero_length_header(path):  # a valid-looking file whose header claims fewer bytes
        raw = bytearray(path.read_bytes())
        path.write_bytes(bytes(raw[:HEADER_BYTES + 4096]))

    return [flip_last_slice, flip_first_slice, truncate_mid_slices, zero_length_header]


@pytest.mark.parametrize("damage", sliced_damage(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_damage_in_a_sliced_read_is_a_counted_miss(where, damage, strategy, monkeypatch):
    tier = sliced(where, strategy, monkeypatch)
    payload = odd_bytes(8192 * 5 + 100, 5)
    assert tier.put(key(1), payload) is PutResult.STORED
    damage(tier.path(key(1)))
    out = bytearray(len(payload))
    assert tier.get_into(key(1), memoryview(out)) is not GetResult.HIT
    assert tier.corrupt == 1 and not tier.path(key(1)).exists()
    tier.close()


def test_version_1_file_is_a_counted_miss_not_an_error(disk):
    """A chunk file of format version 1 (80-byte header, PR before the 4096-byte header block)."""
    head = struct.pack("<4sHH16s16sQ16s", b"KVTC", 1, 80, NS, bytes(key(1)), CHUNK,
                       xxhash.xxh3_128_digest(data(1)))
    disk.path(key(1)).write_bytes(head + xxhash.xxh3_64_digest(head) + bytes(8) + data(1))
    assert read(disk, 1) is None and disk.corrupt == 1
    assert not disk.path(key(1)).exists() and read(disk, 0) == data(0)


def test_parallel_batches_with_io_threads(where):
    tier = make(where, io_threads=4)
    keys = [key(i) for i in range(40, 56)]
    assert tier.put_many(keys, [data(i) for i in range(40, 56)]) == [PutResult.STORED] * 16
    outs = [bytearray(CHUNK) for _ in keys]
    assert tier.get_many(keys, [memoryview(o) for o in outs]) == [GetResult.HIT] * 16
    assert [bytes(o) for o in outs] == [data(i) for i in range(40, 56)]
    tier.close()
    out = bytearray(CHUNK)  # still usable after close, on the calling thread
    assert tier.get_many(keys[:2], [memoryview(out), memoryview(bytearray(CHUNK))]) == [GetResult.HIT, GetResult.HIT]
    assert bytes(out) == data(40)


# ---- choosing the mode --------------------------------------------------------------------------
def refuse_direct(monkeypatch):
    """Make open(2) refuse O_DIRECT the way a filesystem without it does (EINVAL).  Fault
    injection: this machine's tmpfs accepts O_DIRECT (Linux >= 6.6), so no local filesystem refuses it."""
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(iomode, "_measured", {})


def test_direct_refused_at_start_falls_back_to_buffered(tmp_path, monkeypatch):
    refuse_direct(monkeypatch)
    for mode in ("direct", "auto"):
        tier = DiskTier(tmp_path / mode, NS, capacity_bytes=100 * CHUNK, io=mode)
        assert tier.io_mode == "buffered" and "refuses O_DIRECT" in tier.io_reason
        assert tier.put(key(1), data(1)) is PutResult.STORED and read(tier, 1) == data(1)


def test_direct_refused_at_run_time_falls_back_without_a_miss(direct_dir, monkeypatch):
    tier = make(("direct", direct_dir))
    assert tier.put(key(1), data(1)) is PutResult.STORED
    refuse_direct(monkeypatch)
    assert read(tier, 1) == data(1) and tier.io_mode == "buffered" and tier.corrupt == 0
    assert tier.put(key(2), data(2)) is PutResult.STORED and read(tier, 2) == data(2)


def test_auto_mode_measures_and_says_why(where):
    """``disk_io: auto`` on a real directory: the mode chosen is the one the rule gives for the
    probe times the reason reports (direct unless O_DIRECT took over 1.5x buffered's time in every
    round), and a filesystem that enforces O_DIRECT is never reported as refusing it."""
    import re

    mode, root = where
    tier = DiskTier(root, NS, capacity_bytes=100 * CHUNK, io="auto")
    assert tier.io_reason.startswith("auto: "), tier.io_reason
    if "refuses O_DIRECT" in tier.io_reason:
        assert mode == "buffered", "the direct fixture's directory enforces O_DIRECT: it cannot refuse it"
        assert tier.io_mode == "buffered"
    else:
        times = re.search(r"buffered/O_DIRECT ms ((?:\d+/\d+(?:, )?)+);", tier.io_reason)
        assert times, tier.io_reason
        rounds = [tuple(int(x) for x in pair.split("/")) for pair in times.group(1).split(", ")]
        assert len(rounds) == iomode.PROBE_ROUNDS
        slower = all(d > iomode.CLEARLY_SLOWER * b for b, d in rounds)
        near = any(abs(d - iomode.CLEARLY_SLOWER * b) <= 2 for b, d in rounds)  # whole ms in the text
        if not near:
            assert tier.io_mode == ("buffered" if slower else "direct"), tier.io_reason
        assert tier.io_reason.endswith(tier.io_mode)
    assert tier.put(key(1), data(1)) is PutResult.STORED and read(tier, 1) == data(1)


def test_unknown_io_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="auto, buffered, direct"):
        DiskTier(tmp_path, NS, capacity_bytes=CHUNK, io="mmap")


def test_payload_of_another_length_is_a_counted_miss(tmp_path):
    """A well-formed chunk file whose payload is not the expected chunk size (written under
    another chunk size or geometry) is never served, not even as a partial fill."""
    tier = DiskTier(tmp_path, NS, capacity_bytes=100 * CHUNK)
    assert tier.put(key(7), data(7)[:CHUNK - 8]) is PutResult.STORED
    assert read(tier, 7) is None
    assert tier.corrupt == 1 and not tier.contains(key(7))


# ---- buffered reads: serial or split, as measured (disk_tier.ReadChooser) --------------------------
def _choose(chooser, length, reads, split_s, serial_s):
    """Run ``reads`` reads through ``chooser``; split ones take ``split_s``, serial ones ``serial_s``."""
    picks = []
    for _ in range(reads):
        cls, split = chooser.begin(length)
        picks.append(split)
        chooser.end(cls, split, length, split_s if split else serial_s)
    return picks


def test_read_chooser_uses_the_faster_way_and_keeps_measuring_the_other():
    chooser = disk_tier.ReadChooser(cpus=4)
    length = 4 << 20
    picks = _choose(chooser, length, 2 * chooser.warmup, 0.001, 0.002)  # split twice as fast
    assert picks.count(True) == picks.count(False) == chooser.warmup  # warm-up alternates
    later = _choose(chooser, length, 4 * chooser.explore_every, 0.001, 0.002)
    # serial only on exploring reads; each loses, so the gap doubles: reads 8 and 8 + 16
    assert [i + 1 for i, split in enumerate(later) if not split] == [8, 24]
    _choose(chooser, length, 1, 0.1, 0.002)  # one read preempted by another process: 100x slower
    after = _choose(chooser, length, 7, 0.001, 0.002)
    assert after.count(True) == 7  # the median shrugs it off
    busy = _choose(chooser, length, 8 * chooser.explore_every, 0.004, 0.002)  # split now twice as slow
    assert busy[8:].count(True) <= 2  # the split median follows within the window; split only explores
    final = _choose(chooser, length, 2 * chooser.explore_every, 0.004, 0.002)
    assert final.count(True) <= 1 and chooser.running == 0


def test_read_chooser_backs_off_exploring_a_losing_way_and_resumes_when_it_wins():
    chooser = disk_tier.ReadChooser(cpus=4)
    length = 32 << 20
    _choose(chooser, length, 2 * chooser.warmup, 0.004, 0.002)  # split loses (no free core)
    picks = _choose(chooser, length, 2000, 0.004, 0.002)
    explored = [i + 1 for i, split in enumerate(picks) if split]
    # the gap doubles after each losing exploration, 8 -> 256, then stays at 256
    assert explored[:7] == [8, 24, 56, 120, 248, 504, 760]
    assert [b - a for a, b in itertools.pairwise(explored[6:])] == [chooser.explore_max] * (len(explored) - 7)
    assert len(explored) == 11  # 0.55 % of the reads, against 12.5 % at a fixed 1 in 8
    # a core frees up: split now twice as fast; found at the next exploring read, then used
    freed = _choose(chooser, length, chooser.explore_max + 6 * chooser.explore_every, 0.001, 0.002)
    first = freed.index(True)
    assert first < chooser.explore_max
    assert freed[-chooser.explore_every:].count(True) >= chooser.explore_every - 1


def test_read_chooser_never_splits_small_reads_two_cpus_or_a_busy_process():
    assert not disk_tier.ReadChooser(cpus=1).begin(32 << 20)[1]
    two = disk_tier.ReadChooser(cpus=2)  # no core left over for the rest of the host
    picks = _choose(two, 32 << 20, 100, 0.001, 0.002)
    assert not any(picks) and two.serials == 100
    chooser = disk_tier.ReadChooser(cpus=4)
    assert not chooser.begin(disk_tier.SPLIT_MIN_BYTES - 1)[1]
    chooser.begin(32 << 20)
    chooser.begin(32 << 20)
    assert not chooser.begin(32 << 20)[1]  # a third read at once on 4 CPUs: no core to spare


@pytest.mark.parametrize(("times_ms", "direct"), [
    ([(50, 60), (50, 40), (50, 55)], True),      # close: direct
    ([(50, 120), (50, 40), (50, 130)], True),    # slower twice, not every round: direct (stable under noise)
    ([(50, 70), (50, 72), (50, 74)], True),      # slower, but not clearly (< 1.5x): direct
    ([(50, 120), (50, 110), (50, 130)], False),  # clearly slower in every round: buffered
])
def test_auto_keeps_direct_unless_clearly_slower_in_every_round(tmp_path, monkeypatch, times_ms, direct):
    """The ``disk_io: auto`` rule (iomode.measure_direct) on scripted probe times (buffered, direct)."""
    script = iter(t / 1e3 for pair in times_ms for t in pair)
    monkeypatch.setattr(iomode, "_probe", lambda directory, block, flags: next(script))
    monkeypatch.setattr(iomode, "_measured", {})
    if not iomode.direct_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    chosen, why = iomode.measure_direct(tmp_path)
    assert chosen is direct and why.endswith("direct" if direct else "buffered")
    assert "50/" in why and next(script, None) is None  # every round ran and is reported


# ---- a full or read-only filesystem (a tier sized to the free space fills it by design) -----------
@pytest.fixture
def small_filesystem(tmp_path):
    """A fresh 8 MiB tmpfs, unmounted after the test."""
    import subprocess

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=False, capture_output=True,
                             text=True, timeout=30)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}); run as root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=30)


def fill(directory, leave_bytes):
    """Write a file into ``directory`` until at most ``leave_bytes`` of its filesystem are free."""
    path = directory / f"filler-{leave_bytes}"
    with open(path, "wb") as f:
        while True:
            free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
            if free <= leave_bytes:
                return path
            try:
                f.write(b"\0" * min(free - leave_bytes, 1 << 20))
                f.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                return path


def test_a_full_filesystem_never_stops_the_tier_from_starting(small_filesystem, monkeypatch):
    monkeypatch.setattr(iomode, "_measured", {})
    filler = fill(small_filesystem, 1 << 20)  # room for chunks, not for the 16 MiB timing probe
    tier = DiskTier(small_filesystem / "a", NS, capacity_bytes=100 * CHUNK, io="auto")
    assert "could not write (No space left on device)" in tier.io_reason or "refuses O_DIRECT" in tier.io_reason
    assert tier.put(key(1), data(1)) is PutResult.STORED and read(tier, 1) == data(1)
    iomode._measured.clear()
    rest = fill(small_filesystem, 0)  # not one free block: even the 4 KiB O_DIRECT test fails
    full = DiskTier(small_filesystem / "b", NS, capacity_bytes=100 * CHUNK, io="auto")
    assert full.io_mode == "buffered" and "could not write (No space left on device)" in full.io_reason
    assert full.put(key(2), data(2)) == PutResult.FAILED and full.write_errors == 1
    filler.unlink()
    rest.unlink()
    assert full.put(key(2), data(2)) == PutResult.STORED and read(full, 2) == data(2)
    tier.close()
    full.close()


def test_a_read_only_filesystem_fails_writes_with_one_throttled_line(small_filesystem, caplog):
    import subprocess

    tier = DiskTier(small_filesystem / "a", NS, capacity_bytes=100 * CHUNK, io="buffered")
    assert tier.put(key(1), data(1)) is PutResult.STORED
    subprocess.run(["mount", "-o", "remount,ro", str(small_filesystem)], check=True, timeout=30)
    try:
        for i in range(2, 12):
            assert tier.put(key(i), data(i)) == PutResult.FAILED
        assert tier.write_errors == 10 and read(tier, 1) == data(1)
        assert caplog.text.count("chunk not stored") == 1 and "cannot remove" not in caplog.text
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_filesystem)], check=True, timeout=30)
    tier.close()


def test_a_config_on_a_filesystem_full_of_its_own_chunk_files_is_accepted(small_filesystem):
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.disk import factory as disk

    ours = small_filesystem / "kv"
    ours.mkdir()
    fill(ours, 0)  # what the directory holds is the tier's to evict
    assert disk.check(KVTierConfig.from_dict({"disk_path": str(ours), "disk_gib": 0.007})) == []
    assert not [p for p in ours.iterdir() if p.name.startswith(".kvtier-write-probe")]
    ((_key, refused),) = disk.check(KVTierConfig.from_dict({"disk_path": str(small_filesystem / "other"),
                                                            "disk_gib": 0.007}))
    assert "exceeds the 0.0 MiB free" in refused


def test_free_space_under_one_gib_is_said_in_mib(small_filesystem):
    """An 8 MiB tmpfs was reported as 'exceeds the 0.0 GiB free'."""
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.disk import factory as disk

    free = os.statvfs(small_filesystem).f_bavail * os.statvfs(small_filesystem).f_frsize
    ((_key, refused),) = disk.check(KVTierConfig.from_dict({"disk_path": str(small_filesystem / "kv"), "disk_gib": 1}))
    assert f"exceeds the {free / 2**20:.1f} MiB free on {str(small_filesystem)!r}" in refused and free > 2**20, refused


@pytest.mark.parametrize(("size", "said"), [
    (2560, "value is 2,560 bytes, shorter than its 4,096-byte header"),
    (HEADER_BYTES + CHUNK // 2, ("value is 8,192 bytes: its 4,096-byte header says 8,192 payload bytes follow, but "
                                "4,096 do")),
    (HEADER_BYTES + CHUNK + 4, ("value is 12,292 bytes: its 4,096-byte header says 8,192 payload bytes follow, but "
                               "8,196 do"))])
def test_a_chunk_file_of_the_wrong_length_is_logged_in_true_numbers(disk, size, said, caplog):
    """A chunk file cut to 2,560 bytes was logged "payload is -1536 bytes, header says 8192"."""
    path = disk.path(key(1))
    with open(path, "r+b") as handle:
        handle.truncate(size)
    assert read(disk, 1) is None and disk.corrupt == 1
    assert said in caplog.text, caplog.text
    assert "-1" not in caplog.text.replace(str(path), "")
