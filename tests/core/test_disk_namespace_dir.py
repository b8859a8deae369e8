"""The disk tier's namespace directory (``disk_path/<32 hex digits>``, one per model) in the states a
fault-injection tester put it in: a file in its place at start-up (the engine died in
``FileExistsError`` tracebacks while ``kvtier check`` said ok), mounted read-only at start-up (the
tier's sentence buried in worker tracebacks, check ok), and replaced by a file while serving (every
save dropped with no write error counted, two log lines per chunk, doctor advising a bigger cpu tier)."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import DiskTier, GetResult, PutResult
from kvtier.core.tiers.disk import factory as disk

NS = b"n" * 16
CHUNK = 8192


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def data(i: int) -> bytes:
    return bytes([i % 251]) * CHUNK


def _check(root: Path) -> list[tuple[str, str]]:
    return disk.check(KVTierConfig.from_dict({"disk_path": str(root), "disk_gib": 0.01}))


def test_a_file_where_the_namespace_directory_goes_is_refused_in_one_sentence(tmp_path: Path) -> None:
    (tmp_path / NS.hex()).write_text("junk")
    ((_, refused),) = _check(tmp_path)
    assert refused.removeprefix("kvtier config: ") == (f"disk_path holds a file {str(tmp_path / NS.hex())!r} where the disk tier keeps a model's "
                       "chunks (a namespace directory: 32 hex digits); move or remove it")
    with pytest.raises(ConfigError) as err:
        DiskTier(tmp_path, NS, capacity_bytes=10 * CHUNK)
    assert str(err.value) == refused.removeprefix("kvtier config: ")
    (tmp_path / "notes.txt").write_text("an operator's file of another name is not the tier's business")
    (tmp_path / NS.hex()).unlink()
    assert _check(tmp_path) == []


@pytest.fixture
def read_only_namespace(tmp_path: Path):
    """``tmp_path/<NS hex>``: a read-only tmpfs (as a read-only bind mount is: EROFS, root included)."""
    where = tmp_path / NS.hex()
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(where)], check=False,
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); run as root")
    yield tmp_path
    subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True, timeout=30)


def test_a_read_only_namespace_directory_is_refused_by_check_and_by_the_tier_in_one_sentence(
        read_only_namespace: Path) -> None:
    ((_, refused),) = _check(read_only_namespace)
    assert refused.removeprefix("kvtier config: ").startswith(f"disk tier directory {str(read_only_namespace / NS.hex())!r} is not writable by this "
                              "process (read-only or another owner)")
    with pytest.raises(ConfigError, match=r"disk tier directory .*/00' cannot be made \(Read-only file system\)"):
        DiskTier(read_only_namespace, NS, capacity_bytes=10 * CHUNK)


def test_a_file_put_in_place_of_the_directory_while_serving_fails_writes_counted_with_bounded_lines(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = DiskTier(tmp_path, NS, capacity_bytes=100 * CHUNK)
    assert tier.put(key(1), data(1)) is PutResult.STORED
    subprocess.run(["rm", "-rf", str(tier.dir)], check=True, timeout=30)
    tier.dir.write_text("junk")
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for i in range(2, 42):
            assert tier.put(key(i), data(i)) is PutResult.FAILED
    assert tier.write_errors == 40 and tier.last_write_error == "a file is in its place"
    assert caplog.text.count("vanished; recreating it") == 1
    assert caplog.text.count("cannot recreate") == 1 and "(a file is in its place)" in caplog.text
    assert caplog.text.count("chunk not stored") == 1  # the write errors' own line, throttled
    tier.dir.unlink()  # the operator removes it: the next write makes the directory again and lands
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert tier.put(key(50), data(50)) in (PutResult.FAILED, PutResult.STORED)
        assert tier.put(key(51), data(51)) is PutResult.STORED
    assert f"directory {tier.dir} made again after a file is in its place" in caplog.text
    tier.close()


@pytest.fixture
def read_only_bind():
    """Mounts a directory read-only over itself (a bind mount: its files stay on the underlying disk, and
    come back writable when it is unmounted), as an operator's or a kubelet's read-only mount does."""
    mounted: list[Path] = []

    def mount(where: Path) -> None:
        for args in (["--bind", str(where), str(where)], ["-o", "remount,ro,bind", str(where)]):
            done = subprocess.run(["mount", *args], check=False, capture_output=True, text=True, timeout=30)
            if done.returncode:
                pytest.skip(f"cannot bind-mount read-only here ({done.stderr.strip()}); run as root")
            mounted.append(where)

    yield mount
    for where in dict.fromkeys(reversed(mounted)):
        subprocess.run(["umount", str(where)], check=False, capture_output=True, timeout=30)


@pytest.mark.parametrize("read_only", ["shard", "namespace"])
def test_a_reset_that_cannot_be_applied_at_start_keeps_its_marker_and_serves_nothing_from_before(
        tmp_path: Path, read_only_bind, read_only: str) -> None:
    """A reset was acknowledged (its marker written) and the engine died before its workers applied it; the
    restart found a shard (or the whole namespace directory) mounted read-only. The start removed the marker
    although the chunk file stayed, so once the mount was fixed the next start served the chunk from before
    the reset (the shard case); with the namespace directory read-only it died in an ``OSError`` traceback."""
    from kvtier.core.tiers.disk.reset import RESET_MARKER, mark_reset

    tier = DiskTier(tmp_path, NS, capacity_bytes=100 * CHUNK, io="buffered")
    assert tier.put(key(1), data(1)) is PutResult.STORED
    tier.close()
    mark_reset(tier.dir)
    read_only_bind(tier.path(key(1)).parent if read_only == "shard" else tier.dir)
    with pytest.raises(ConfigError) as err:
        DiskTier(tmp_path, NS, capacity_bytes=100 * CHUNK, io="buffered")
    assert str(err.value) == (f"disk tier directory {str(tier.dir)!r} holds chunk files a reset acknowledged before "
                              f"this start dropped, and the reset cannot be applied: cannot remove {tier.path(key(1))} "
                              "(Read-only file system); fix the permissions or mount of its directory and restart "
                              "(until then none of its chunks is served)")
    subprocess.run(["umount", str(tier.path(key(1)).parent if read_only == "shard" else tier.dir)], check=True,
                   timeout=30)
    assert (tier.dir / RESET_MARKER).exists() and tier.path(key(1)).exists()

    fixed = DiskTier(tmp_path, NS, capacity_bytes=100 * CHUNK, io="buffered")
    out = bytearray(CHUNK)
    assert fixed.get_into(key(1), memoryview(out)) is GetResult.MISS
    assert not tier.path(key(1)).exists() and not (tier.dir / RESET_MARKER).exists()
    assert fixed.put(key(2), data(2)) is PutResult.STORED
    fixed.close()
