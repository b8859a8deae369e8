"""``kvtier purge`` over the disk tier's directory: the tier's
:attr:`~kvtier.core.tiers.registry.TierSpec.purge` hook.

The directory holds one sub-directory per namespace (``<disk_path>/<namespace hex>/``, its 256
shard directories ``00`` … ``ff`` holding ``<key hex>.kvc`` files: :mod:`kvtier.core.tiers.diskscan`).
A chunk file matches a :class:`~kvtier.core.purge.PurgeSelector` by its namespace directory, its
modification time (when it was written: files are written once, into a temporary file renamed into
place) and, for ``--salt``/``--lora``, the tenant record in its header
(:mod:`kvtier.core.tenant`); a file whose header cannot be read or checked, or whose tenant
record fails its own check, is left alone and reported (a live engine removes a bad header as
corrupt when it reads it; a bad tenant record leaves the chunk readable).

Removing a file a live engine is reading is safe: an open file stays readable to the reader that
opened it (POSIX ``unlink(2)``), which then serves a verified chunk it had begun to read; a read
that opens it afterwards finds no file, a miss.  Temporary files of writers in flight are left
alone (they are not chunks yet), as are the reset marker and the writers' lock files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.core.errors import UserError
from kvtier.core.keys import KEY_BYTES
from kvtier.core.purge import NamespacePurge, PurgeSelector
from kvtier.core.tiers.chunkfile import HEADER_BYTES, ChunkFormatError, decode_header
from kvtier.core.tiers.diskscan import chunk_entries

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

TIER = "disk"
_NAMESPACE_DIR = re.compile(r"[0-9a-f]{32}")


def purge(config: KVTierConfig, selector: PurgeSelector, dry_run: bool) -> list[NamespacePurge] | None:
    """Purge ``config.disk_path`` (see the module docstring); ``None`` without a ``disk_path``.

    Returns:
        one :class:`~kvtier.core.purge.NamespacePurge` per namespace directory the selector
        admits, in name order (those with nothing matched included, so a dry run shows where it looked).

    Raises:
        UserError: ``disk_path`` is not a directory that can be listed.
    """
    if not config.disk_path:
        return None
    root = Path(config.disk_path)
    if not root.is_dir():
        raise UserError(f"--disk-path {root} is not a directory; give the disk tier's disk_path")
    try:
        names = sorted(entry.name for entry in os.scandir(root) if entry.is_dir(follow_symlinks=False)
                       and _NAMESPACE_DIR.fullmatch(entry.name))
    except OSError as exc:
        raise UserError(f"cannot list --disk-path {root} ({exc.strerror}); fix its permissions or run as its owner") \
            from None
    if not names:
        _refuse_a_neighbouring_directory(root)
    out = []
    for name in names:
        namespace = bytes.fromhex(name)
        if selector.wants_namespace(namespace):
            out.append(purge_namespace(root / name, namespace, selector, dry_run))
    return out


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
            inside, its name 32 hex digits), or a directory one of whose sub-directories holds
            namespace directories (``disk_path``'s parent).
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
    for child in sorted(children):
        if _namespace_dirs(child):
            raise UserError(f"--disk-path {root} holds no namespace directory but {child} does; give the disk "
                            f"tier's directory, --disk-path {child}")


def purge_namespace(directory: Path, namespace: bytes, selector: PurgeSelector, dry_run: bool) -> NamespacePurge:
    """Purge the chunk files of one namespace directory (see :func:`purge`)."""
    result = NamespacePurge(TIER, namespace)
    for entry in chunk_entries(directory, KEY_BYTES, result.problem):
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # removed meanwhile (an engine's eviction)
            continue
        except OSError as exc:
            result.problem(f"cannot stat {entry.path} ({exc.strerror})")
            continue
        if not selector.old_enough(st.st_mtime):
            continue
        if selector.needs_tenant:
            record = _tenant_record(entry.path, namespace, result)
            if record is None or not selector.tenant_admits(result, namespace, record, entry.path):
                continue
        if not dry_run:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                result.problem(f"cannot remove {entry.path} ({exc.strerror})")
                continue
        result.chunks += 1
        result.bytes += st.st_size
    return result


def _tenant_record(path: str, namespace: bytes, result: NamespacePurge) -> bytes | None:
    """The raw tenant record in the file's header; ``None`` (with a problem noted) when the header
    cannot be read or checked, or the file is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        result.problem(f"cannot read {path} ({exc.strerror})")
        return None
    try:
        header = decode_header(os.pread(fd, HEADER_BYTES, 0))
    except ChunkFormatError as exc:
        result.problem(f"{path}: {exc}")
        return None
    except OSError as exc:
        result.problem(f"cannot read {path} ({exc.strerror})")
        return None
    finally:
        os.close(fd)
    if header.namespace != namespace:
        result.problem(f"{path}: chunk belongs to another namespace")
        return None
    return bytes(header.tenant)
