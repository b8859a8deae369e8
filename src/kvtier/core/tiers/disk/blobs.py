"""The disk tier's directory as a blob store (:mod:`kvtier.core.tiers.blobs`): what ``kvtier purge``,
a reset from outside the stores and the probe run over (:mod:`kvtier.core.purge`).

The directory holds one sub-directory per namespace (``<disk_path>/<namespace hex>/``, its 256
shard directories ``00`` … ``ff`` holding ``<key hex>.kvc`` files: :mod:`kvtier.core.tiers.disk.scan`).
A chunk file's written time is its modification time (files are written once, into a temporary
file renamed into place); its header (:func:`~kvtier.core.tiers.disk.chunkfile.decode_header`, the one
place this module reads a value's header) carries its namespace and tenant record
(:mod:`kvtier.core.tenant`).  A file whose header cannot be read or checked is named as a problem
(a live engine removes a bad header as corrupt when it reads it).

Removing a file a live engine is reading is safe: an open file stays readable to the reader that
opened it (POSIX ``unlink(2)``), which then serves a verified chunk it had begun to read; a read
that opens it afterwards finds no file, a miss.  Temporary files of writers in flight are left
alone (they are not chunks yet, and become chunks only by a rename the writing store checks
against its reset epoch), as are the reset marker and the writers' lock files.

A reset (:func:`kvtier.core.purge.reset_outside`) writes the reset marker first
(:meth:`DiskBlobs.before_reset`, :mod:`kvtier.core.tiers.disk.reset`), then removes the files.
"""

from __future__ import annotations

import builtins
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.core.encryption import KEY_ID_BYTES
from kvtier.core.errors import ChunkFormatError, UserError
from kvtier.core.keyids import key_id_of
from kvtier.core.keys import KEY_BYTES
from kvtier.core.tiers.blobs import LIST_BATCH, BlobRef, BlobStat, ValueHeader
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES, decode_header
from kvtier.core.tiers.disk.reset import RESET_MARKER, mark_reset
from kvtier.core.tiers.disk.scan import SUFFIX, chunk_entries

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.probe import ProbeState

_NAMESPACE_DIR = re.compile(r"[0-9a-f]{32}")


def open_blobs(config: KVTierConfig) -> DiskBlobs | None:
    """The blob store of ``config.disk_path``; ``None`` without one.

    Raises:
        UserError: ``disk_path`` is not a directory that can be listed, or is plainly not the disk
            tier's directory but next to it (so that a purge given the wrong directory does not
            report "removed 0 chunks" and exit 0).
    """
    if not config.disk_path:
        return None
    root = Path(config.disk_path)
    return DiskBlobs(root)


class DiskBlobs:
    """The chunk files under one ``disk_path``, every namespace (see the module docstring)."""

    verifies_values = False
    space = ""
    auth_fix = "fix the directory's permissions or run as its owner"
    address_key = "disk_path"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = str(root)
        self._problems: list[tuple[bytes, str]] = []

    def namespaces(self) -> builtins.list[bytes]:
        """The namespace directories under the root, by name.

        Raises:
            UserError: see :func:`open_blobs`.
        """
        root = self.root
        if not root.exists():
            raise UserError(f"--disk-path {root} does not exist; give the disk tier's disk_path (the directory the "
                            "engines write their chunks under)")
        if not root.is_dir():
            raise UserError(f"--disk-path {root} is not a directory; give the disk tier's disk_path")
        try:
            names = sorted(entry.name for entry in os.scandir(root) if entry.is_dir(follow_symlinks=False)
                           and _NAMESPACE_DIR.fullmatch(entry.name))
        except OSError as exc:
            raise UserError(f"cannot list --disk-path {root} ({exc.strerror}); fix its permissions or run as its "
                            "owner") from None
        if not names:
            _refuse_a_neighbouring_directory(root)
        return [bytes.fromhex(name) for name in names]

    def list(self, namespaces: frozenset[bytes]) -> Iterator[builtins.list[BlobRef]]:
        wanted = sorted(namespaces) if namespaces else self.namespaces()
        for namespace in wanted:
            directory = self.root / namespace.hex()
            if not directory.is_dir():
                continue
            batch: list[BlobRef] = []
            def problem(text: str, ns: bytes = namespace) -> None:
                self._problems.append((ns, text))

            for entry in chunk_entries(directory, KEY_BYTES, problem):
                try:
                    key = bytes.fromhex(entry.name[:-len(SUFFIX)])
                except ValueError:
                    continue
                batch.append(BlobRef(namespace, key, entry.path))
                if len(batch) >= LIST_BATCH:
                    yield batch
                    batch = []
            if batch:
                yield batch

    def listing_problems(self) -> builtins.list[tuple[bytes, str]]:
        out, self._problems = self._problems, []
        return out

    def stat(self, refs: Sequence[BlobRef], header: bool) -> builtins.list[BlobStat | None]:
        return [self._stat(ref, header) for ref in refs]

    def _stat(self, ref: BlobRef, header: bool) -> BlobStat | None:
        try:
            st = os.stat(ref.name, follow_symlinks=False)
        except FileNotFoundError:  # removed meanwhile (an engine's eviction)
            return None
        except OSError as exc:
            return BlobStat(0, None, problem=f"cannot stat {ref.name} ({exc.strerror})")
        if not header:
            return BlobStat(st.st_size, st.st_mtime)
        try:
            fd = os.open(ref.name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            return BlobStat(st.st_size, st.st_mtime, problem=f"cannot read {ref.name} ({exc.strerror})")
        try:
            raw = os.pread(fd, HEADER_BYTES + KEY_ID_BYTES, 0)  # and an encrypted payload's key id
            head = decode_header(raw)
        except ChunkFormatError as exc:
            return BlobStat(st.st_size, st.st_mtime, problem=f"{ref.name}: {exc}")
        except OSError as exc:
            return BlobStat(st.st_size, st.st_mtime, problem=f"cannot read {ref.name} ({exc.strerror})")
        finally:
            os.close(fd)
        if head.namespace != ref.namespace:
            return BlobStat(st.st_size, st.st_mtime, problem=f"{ref.name}: chunk belongs to another namespace")
        return BlobStat(st.st_size, st.st_mtime, ValueHeader(head.namespace, None, bytes(head.tenant), key_id_of(raw)))

    def delete(self, refs: Sequence[BlobRef]) -> builtins.list[bool | str]:
        out: list[bool | str] = []
        for ref in refs:
            try:
                os.unlink(ref.name)
                out.append(True)
            except FileNotFoundError:
                out.append(False)
            except OSError as exc:
                out.append(f"cannot remove {ref.name} ({exc.strerror})")
        return out

    def before_reset(self, namespace: bytes) -> str | None:
        """Write the reset marker in the namespace's directory (none yet: nothing to mark)."""
        directory = self.root / namespace.hex()
        if not directory.is_dir():
            return None
        try:
            mark_reset(directory)
        except OSError as exc:
            return f"cannot write {directory / RESET_MARKER} ({exc.strerror})"
        return None

    def ping(self) -> str:
        """List the root (its first entry)."""
        with os.scandir(self.root) as entries:
            next(entries, None)
        return "LIST"

    def failure(self, exc: BaseException, left_s: float) -> tuple[ProbeState, str]:
        if isinstance(exc, PermissionError):
            return "auth failed", f"cannot list {self.root} ({exc.strerror})"
        return "unreachable", f"cannot list {self.root} ({getattr(exc, 'strerror', None) or exc})"

    def close(self) -> None:
        """Nothing to release."""


_SHARD_DIR = re.compile(r"[0-9a-f]{2}")
_LOOK_AT_MOST = 1000
"""Entries of a directory without namespace directories looked at for the disk tier's own (bounded)."""


def _namespace_dirs(directory: Path) -> bool:
    """Whether ``directory`` holds a namespace directory (among its first entries)."""
    try:
        with os.scandir(directory) as entries:
            for n, entry in enumerate(entries):
                if n >= _LOOK_AT_MOST:
                    return False
                if _NAMESPACE_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                    return True
    except OSError:
        pass
    return False


def _refuse_a_neighbouring_directory(root: Path) -> None:
    """``root`` holds no namespace directory: refuse it when it is plainly not the disk tier's
    ``disk_path`` but next to it, so that a purge given the wrong directory does not report
    "removed 0 chunks" and exit 0 (an empty or fresh ``disk_path`` is fine, nothing to remove).

    Raises:
        UserError: ``root`` is a namespace directory itself (its shard directories ``00``..``ff``
            inside, its name 32 hex digits), a directory one of whose sub-directories holds
            namespace directories (``disk_path``'s parent), or one holding anything but kvtier's own
            dot files (``/etc``: not a disk tier's directory at all).
    """
    if _NAMESPACE_DIR.fullmatch(root.name):
        try:
            shards = any(_SHARD_DIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False) for e in os.scandir(root))
        except OSError:
            shards = False
        if shards:
            raise UserError(f"--disk-path {root} is one namespace directory, not the disk tier's directory; give "
                            f"--disk-path {root.parent} --namespace {root.name}")
    try:
        with os.scandir(root) as entries:
            children = [Path(e.path) for _, e in zip(range(_LOOK_AT_MOST), entries)
                        if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    tiers = [child for child in sorted(children) if _namespace_dirs(child)]
    if len(tiers) == 1:
        raise UserError(f"--disk-path {root} holds no namespace directory but {tiers[0]} does; give the disk "
                        f"tier's directory, --disk-path {tiers[0]}")
    if tiers:  # several disk tiers side by side: name them all, not the first as if it were the one
        raise UserError(f"--disk-path {root} holds no namespace directory but {len(tiers)} of its sub-directories "
                        f"do ({', '.join(map(str, tiers))}), each a disk tier's; give the one to purge, e.g. "
                        f"--disk-path {tiers[0]}")
    try:
        with os.scandir(root) as entries:
            foreign = sorted(e.name for _, e in zip(range(_LOOK_AT_MOST), entries) if not _kvtier_own(e.name))
    except OSError:
        return
    if foreign:  # /etc, a home directory: "removed 0 chunks" and exit 0 read as a purge that worked
        raise UserError(f"--disk-path {root} is not a kvtier disk tier's directory: it holds no namespace directory "
                        f"(32 hex digits) but other entries ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                        "nothing was removed; give the directory the engines' disk tier uses")


def _kvtier_own(name: str) -> bool:
    """Whether an entry of ``disk_path`` with no namespace directory yet may be there: kvtier's own
    dot files (the KV events' journal, I/O probes) or a fresh filesystem's ``lost+found``."""
    return name.startswith(".kvtier-") or name == "lost+found"
