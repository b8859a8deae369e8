"""Fixtures of the core tests: disk tier directories for buffered and O_DIRECT I/O."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.tiers.disk.chunkio import O_DIRECT, aligned_buffer
from kvtier.core.tiers.disk.iomode import direct_supported

MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "hugetlbfs"}


def filesystem_type(path: Path) -> str:
    """Type of the filesystem holding ``path`` (from /proc/self/mountinfo; "" if unknown)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        left, _, right = line.partition(" - ")
        mount_point = left.split()[4].replace("\\040", " ")
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, kind = mount_point, right.split()[0]
    return kind


def enforces_direct(directory: Path) -> bool:
    """Whether ``directory`` is on a block filesystem where O_DIRECT is real: aligned I/O works
    and a misaligned write is refused (tmpfs since Linux 6.6 accepts both, so it proves nothing)."""
    if filesystem_type(directory) in MEMORY_FILESYSTEMS or not direct_supported(directory):
        return False
    path = directory / ".misaligned-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | O_DIRECT, 0o600)
    try:
        os.pwrite(fd, aligned_buffer(8192)[1:4097], 0)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)
        path.unlink()


def direct_root(tmp_path: Path) -> Path | None:
    """A fresh directory on a filesystem that enforces O_DIRECT: pytest's ``tmp_path`` if it is
    one, else one under /var/tmp or the repository's ``.kvtier`` folder (removed by the caller)."""
    if enforces_direct(tmp_path):
        return tmp_path
    repo = Path(__file__).resolve().parents[2] / ".kvtier"
    for base in (Path("/var/tmp"), repo):
        try:
            base.mkdir(exist_ok=True)
            candidate = Path(tempfile.mkdtemp(prefix="kvtier-direct-", dir=base))
        except OSError:
            continue
        if enforces_direct(candidate):
            return candidate
        shutil.rmtree(candidate, ignore_errors=True)
    return None


@pytest.fixture(params=["buffered", "direct"])
def disk_io(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(I/O mode, directory) for a disk tier: buffered in ``tmp_path``, direct on a real disk."""
    if request.param == "buffered":
        yield "buffered", tmp_path
        return
    root = direct_root(tmp_path)
    if root is None:
        pytest.skip("no directory on a filesystem that enforces O_DIRECT (tmp, /var/tmp, .kvtier)")
    yield "direct", root
    if root != tmp_path:
        _discard(root, tmp_path)


@pytest.fixture
def direct_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a filesystem that enforces O_DIRECT (skips where there is none)."""
    root = direct_root(tmp_path)
    if root is None:
        pytest.skip("no directory on a filesystem that enforces O_DIRECT (tmp, /var/tmp, .kvtier)")
    yield root
    if root != tmp_path:
        _discard(root, tmp_path)


def _discard(root: Path, tmp_path: Path) -> None:
    """Move ``root`` into the test's ``tmp_path`` (left in place like every ``tmp_path``), or remove it
    where it lies on another filesystem: removing a disk tier's 256 shard directories costs about
    0.7 s on the CI machine kind (ext4 mounted with ``discard``), a rename nothing."""
    try:
        root.rename(tmp_path / root.name)
    except OSError:
        shutil.rmtree(root, ignore_errors=True)
