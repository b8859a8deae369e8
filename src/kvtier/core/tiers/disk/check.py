"""Filesystem checks of the disk tier's directory, run where the tier is about to be used: by the
disk tier's factory (:func:`kvtier.core.tiers.disk.factory.from_config`, in each worker) and by its
preflight (:func:`kvtier.core.tiers.disk.factory.check`: ``kvtier check`` and the vLLM plugin, before the
model loads).  The configuration itself never looks at the disk (:mod:`kvtier.core.config`).

Each problem is one sentence naming ``disk_path`` or ``disk_gib`` and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

GiB = 1 << 30

PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore",
    "bpf", "configfs", "fusectl", "mqueue", "binfmt_misc", "autofs", "efivarfs", "nsfs", "rpc_pipefs",
})
"""Kernel interfaces that look like directories but hold no files (proc(5), sysfs(5))."""


KERNEL_TREES = ("/proc", "/sys", "/dev")
"""Where every Linux host mounts kernel interfaces (proc, sysfs, devtmpfs): judged from the path
alone, for a config that will run on another host (``kvtier audit``).  ``/dev/shm`` is tmpfs: not one."""


def static_disk_path_problem(path: str) -> str | None:
    """The sentence when ``path`` lies under a :data:`KERNEL_TREES` directory (not ``/dev/shm``), else
    None: what :func:`disk_path_problem` finds on the serving host, from the path alone."""
    norm = os.path.normpath(path)
    tree = next((t for t in KERNEL_TREES if norm == t or norm.startswith(t + "/")), None)
    if tree is None or norm == "/dev/shm" or norm.startswith("/dev/shm/"):
        return None
    return (f"disk_path {path!r} is under {tree}, where every Linux host mounts a kernel interface that cannot hold "
            "chunk files; point it at a directory on a local disk (e.g. NVMe) (a static check of the path: the "
            "serving host's filesystems were not inspected)")


NAMESPACE_DIR = re.compile(r"[0-9a-f]{32}")
"""The name of a namespace directory the disk tier makes under ``disk_path`` (a digest: 32 hex digits)."""
SHARD_DIR = re.compile(r"[0-9a-f]{2}")
"""The name of a shard directory inside a namespace directory (``00`` .. ``ff``)."""


def namespace_directory(path: Path) -> bool:
    """Whether ``path`` (an existing directory) is one namespace directory of a disk tier: its name 32
    hex digits and a shard directory inside (among its first 300 entries: 256 shards and dot files)."""
    if not NAMESPACE_DIR.fullmatch(path.name):
        return False
    try:
        with os.scandir(path) as entries:
            return any(SHARD_DIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
                       for _, e in zip(range(300), entries))
    except OSError:
        return False


def namespace_not_a_directory(where: Path) -> str:
    """The sentence refusing a file where a namespace directory goes (the check's and the tier's)."""
    return (f"disk_path holds a file {str(where)!r} where the disk tier keeps a model's chunks (a namespace "
            "directory: 32 hex digits); move or remove it")


def namespace_entries_problem(path: Path, max_entries: int = 4096) -> str | None:
    """What makes an entry of ``path`` (an existing disk_path) named as a namespace directory unusable
    by the tier of that model: a file in its place, or it (or one of its shard directories) not
    writable by this process, e.g. read-only mounted; None when none is (at most ``max_entries`` looked at)."""
    try:
        with os.scandir(path) as entries:
            named = [e for _, e in zip(range(max_entries), entries) if NAMESPACE_DIR.fullmatch(e.name)]
    except OSError:
        return None
    for entry in named:
        where = Path(entry.path)
        if not entry.is_dir():
            return namespace_not_a_directory(where)
        for directory in [where, *(where / f"{i:02x}" for i in range(256))]:
            if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
                return (f"disk tier directory {str(directory)!r} is not writable by this process (read-only or "
                        "another owner); fix its permissions or mount, or choose another disk_path")
    return None


def size_words(num_bytes: float) -> str:
    """``num_bytes`` in GiB, or in MiB under 1 GiB (an 8 MiB tmpfs is not "0.0 GiB")."""
    return f"{num_bytes / GiB:.1f} GiB" if num_bytes >= GiB else f"{num_bytes / (1 << 20):.1f} MiB"


def disk_path_problem(path: Path, disk_gib: float) -> tuple[str, str] | None:
    """``(key, sentence)`` of what makes ``path`` unfit to hold ``disk_gib`` GiB of chunk files
    (a file or under one, one namespace directory of a disk tier, a kernel pseudo filesystem, not writable,
    too little free space), or None.
    Creates nothing: a directory that does not exist is judged by its nearest existing parent (the
    tier creates it at start-up); one that exists gets a write probe, removed at once.

    The free space counts what the directory holds already: it is the tier's to evict.
    """
    if path.exists() and not path.is_dir():
        return "disk_path", f"disk_path {str(path)!r} is a file, not a directory; point it at a directory"
    if path.is_dir() and namespace_directory(path):  # copied from `ls`: the tier would nest its own inside
        return "disk_path", (f"disk_path {str(path)!r} is one namespace directory of a disk tier, not a disk_path: "
                             "the tier would make its own namespace directory inside it and never see or evict the "
                             f"chunk files there; point disk_path at {str(path.parent)!r}")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():  # e.g. /etc/hostname/kv: nothing can be created under a file
        return "disk_path", (f"disk_path {str(path)!r} lies under {str(existing)!r}, which is a file, not a directory; "
                             "point it at a directory")
    pseudo = pseudo_filesystem(existing)
    if pseudo is not None:
        fstype, mount_point = pseudo
        return "disk_path", (f"disk_path {str(path)!r} is on the {fstype} filesystem mounted at {mount_point}, a "
                             "kernel interface that cannot hold chunk files; point it at a directory on a local disk "
                             "(e.g. NVMe)")
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return "disk_path", f"disk_path {str(path)!r} is not writable; point it at a writable directory"
    free = shutil.disk_usage(existing).free
    used = dir_bytes(path) if path.exists() else 0
    if disk_gib * GiB > free + used:
        if path.exists():
            return "disk_gib", (f"disk_gib={disk_gib} exceeds the {size_words(free + used)} free on "
                                f"{str(path)!r}; lower disk_gib or free space")
        # a path that does not exist is named as such: the free space is its nearest existing parent's,
        # typically the root disk because the volume meant for the tier is not mounted
        return "disk_path", (f"disk_path {str(path)!r} does not exist, and disk_gib={disk_gib} exceeds the "
                             f"{size_words(free)} free on {str(existing)!r}, its nearest existing parent, where it "
                             "would be created; mount the disk meant for the tier there (e.g. the NVMe volume), or "
                             "lower disk_gib")
    if not path.exists():  # a check creates nothing: the tier creates it at start-up (DiskTier)
        return None
    probe = path / f".kvtier-write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        if exc.errno == errno.ENOSPC and used:  # full of kvtier's own chunk files, which the tier evicts to make room
            with contextlib.suppress(OSError):
                probe.unlink()
            return None
        return "disk_path", (f"disk_path {str(path)!r} is not writable ({exc.strerror}); "
                             "point it at a writable directory")
    problem = namespace_entries_problem(path)
    return ("disk_path", problem) if problem is not None else None


def foreign_files_problem(path: Path, disk_gib: float, namespaces: Sequence[bytes]) -> str | None:
    """The sentence when ``disk_gib`` GiB (the engine's total) does not fit in the free space of ``path``
    plus what the namespace directories of ``namespaces`` (every tensor-parallel rank's of one engine) hold,
    or None.

    :func:`disk_path_problem` counts every file under ``path`` as room, since a check that knows no model
    cannot tell whose they are; but a tier evicts only its own namespace's files, so the chunk files of
    another model, tensor-parallel size or ``chunk_tokens`` left there (or written by another engine) are
    room it never gets back: every write past the free space would fail.  Called where the namespace is
    known (the disk tier's factory, in each worker, before the tier is made); walks only the engine's own
    directories unless the size does not fit.
    """
    if not path.is_dir():
        return None
    own = sum(dir_bytes(path / ns.hex()) for ns in set(namespaces) if (path / ns.hex()).is_dir())
    free = shutil.disk_usage(path).free
    if disk_gib * GiB <= free + own:
        return None
    others = max(dir_bytes(path) - own, 0)
    return (f"disk_gib={disk_gib} exceeds the {size_words(free)} free on {str(path)!r} plus the "
            f"{size_words(own)} this engine's own chunk files hold there; the other {size_words(others)} under it "
            "are not its own (other models', tensor-parallel sizes' or chunk_tokens' namespace directories, or "
            "other files) and it never evicts them; remove those no engine uses (`kvtier purge --disk-path "
            f"{path} --all --dry-run` lists them by namespace, `--namespace HEX` removes one), give this engine "
            "its own disk_path, or lower disk_gib")


def mount_of(path: Path, mounts: str = "/proc/self/mounts") -> tuple[str, str] | None:
    """``(fstype, mount point)`` of the filesystem holding ``path`` (an existing path), or None.

    Reads the longest matching mount point of ``mounts`` (proc(5) ``/proc/self/mounts``); None on a
    host without that file (not Linux).
    """
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    resolved = str(path.resolve())
    best: tuple[str, str] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[1])):
            best = (fields[2], point)
    return best


def pseudo_filesystem(path: Path) -> tuple[str, str] | None:
    """``(fstype, mount point)`` when ``path`` (an existing path) lies on a kernel pseudo filesystem."""
    mount = mount_of(path)
    return mount if mount is not None and mount[0] in PSEUDO_FILESYSTEMS else None


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (recursively); files that vanish meanwhile count 0."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
