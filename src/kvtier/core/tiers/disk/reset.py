"""Removing every chunk file of one namespace from the disk tier's directory, and the reset marker.

A reset (vLLM's ``/reset_prefix_cache?reset_external=true``, :mod:`kvtier.integrations.vllm.scheduler`)
is acknowledged by one process (vLLM's scheduler) while the stores that hold the files live in
others (the workers), which apply it only when the next engine step carries the order.  So that a
restart in between never serves what the reset dropped, the acknowledging process
(:func:`kvtier.core.purge.reset_outside` over :class:`~kvtier.core.tiers.disk.blobs.DiskBlobs`):

1. writes the marker ``<disk_path>/<namespace hex>/reset-pending`` (:func:`mark_reset`), then
2. removes every chunk file of the namespace.

Files written after step 2 by a store that has not applied the order yet (writes queued before
the reset, a graceful stop's flush) are removed by whichever comes first: the store applying the
order (:meth:`~kvtier.core.tiers.disk.tier.DiskTier.clear`, which then removes the marker), or the
next store that opens the directory and finds the marker (it removes every chunk file before
building its index).

Temporary files of writers in flight are left alone: they become chunk files only by a rename
the writing store checks against its reset epoch (:mod:`kvtier.core.index`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.base import ClearResult
from kvtier.core.tiers.disk.scan import SUFFIX, chunk_entries

log = logging.getLogger(__name__)
RESET_MARKER = "reset-pending"
"""File (inside a namespace directory) saying a reset was acknowledged and may not be applied yet."""


def mark_reset(directory: Path) -> None:
    """Write the reset marker in ``directory`` (a namespace directory that exists).

    Raises:
        OSError: the marker cannot be written.
    """
    fd = os.open(directory / RESET_MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.fsync(fd)  # the marker must outlive a crash right after the reset was acknowledged
    finally:
        os.close(fd)


def reset_marked(directory: Path) -> bool:
    """Whether ``directory`` holds the reset marker."""
    return (directory / RESET_MARKER).exists()


def unmark_reset(directory: Path) -> None:
    """Remove the reset marker (absent: nothing to do)."""
    with contextlib.suppress(FileNotFoundError):
        (directory / RESET_MARKER).unlink()


def remove_chunk_files(directory: Path, key_bytes: int) -> ClearResult:
    """Remove every chunk file ``<key hex>.kvc`` in the 256 shard directories of ``directory``.

    Args:
        directory: a namespace directory of the disk tier.
        key_bytes: bytes of a chunk key (names of another length are not chunk files).

    Returns:
        the keys removed; ``ok`` is ``False`` (with the first error) if a file could not be removed.
    """
    removed: list[ChunkKey] = []
    errors: list[str] = []
    for entry in chunk_entries(directory, key_bytes, errors.append):
        try:
            key = ChunkKey(bytes.fromhex(entry.name[:-len(SUFFIX)]))
            os.unlink(entry.path)
        except ValueError:
            continue
        except FileNotFoundError:  # removed meanwhile (another process, an eviction)
            continue
        except OSError as exc:
            errors.append(f"cannot remove {entry.path} ({exc.strerror})")
            continue
        removed.append(key)
    error = errors[0] if errors else ""
    return ClearResult(removed, not error, error)


def apply_pending_reset(directory: Path, key_bytes: int) -> None:
    """Apply the reset ``directory``'s marker says was acknowledged and not applied: remove every chunk
    file, then the marker (a store starting up, before it builds its index).

    The marker goes only once every chunk file went: a store that started with one left (a shard mounted
    read-only) and dropped the marker would let the next start index and serve a chunk from before the
    reset.

    Raises:
        ConfigError: a chunk file or the marker cannot be removed (one sentence: the tier does not start,
            the marker stays, and the next start tries again).
    """
    gone = remove_chunk_files(directory, key_bytes)
    log.info("kvtier disk tier: removed %d chunk files of %s that an acknowledged reset dropped%s",
             len(gone.keys), directory, "" if gone.ok else f" ({gone.reason})")
    problem = None if gone.ok else gone.reason
    if problem is None:
        try:
            unmark_reset(directory)
        except OSError as exc:
            problem = f"cannot remove {directory / RESET_MARKER} ({exc.strerror})"
    if problem is not None:
        raise ConfigError(f"disk tier directory {str(directory)!r} holds chunk files a reset acknowledged before "
                          f"this start dropped, and the reset cannot be applied: {problem}; fix the permissions or "
                          "mount of its directory and restart (until then none of its chunks is served)")
