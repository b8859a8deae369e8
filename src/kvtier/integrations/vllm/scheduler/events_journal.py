"""The KV-event journal's file: what the scheduler knew of its chunks' vLLM block hashes, and what
it had announced, kept across a graceful restart (:mod:`kvtier.integrations.vllm.scheduler.events`).

``<state_dir>/.kvtier-kv-events-<key root hex>.msgpack``: msgspec msgpack of :class:`Journal`,
written to a temporary file and renamed; read once by the restarted scheduler.  Engines sharing the
directory and namespace (data-parallel engines, replicas on one ``disk_path``) share the file: each
writer keeps the chunks the file already describes that its own map lacks, under an exclusive
``flock`` of the directory, so the last engine to stop does not drop the others' chunks."""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import Any

import msgspec
from vllm.v1.core import kv_cache_utils

log = logging.getLogger(__name__)

JOURNAL_VERSION = 1
MAX_BYTES = 1 << 30
"""Largest journal read, bytes (a larger file is ignored, logged)."""


class ChunkMeta(msgspec.Struct, array_like=True, frozen=True):
    """What a ``BlockStored`` of one page says, kept from when the scheduler had the request.

    ``block_hashes``: vLLM's raw ``BlockHash`` bytes of the page's blocks (``block_size`` tokens
    each); ``token_ids``: the chunk's token ids as native int32 bytes (``array("i")``)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: bytes
    block_size: int
    group_idx: int
    spec_kind: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None


class Journal(msgspec.Struct, array_like=True):
    """``keys``, ``metas`` and ``media`` are parallel: page key, its payload, and the medium it was
    announced at when the journal was written (``""``: not announced; the list is empty in journals
    written before it was kept, read as nothing announced)."""

    version: int
    none_hash: bytes
    keys: list[bytes]
    metas: list[ChunkMeta]
    media: list[str] = msgspec.field(default_factory=list)


def journal_path(journal_dir: Path | None, key_root: bytes) -> Path | None:
    """The journal of namespace ``key_root`` in ``journal_dir`` (``None``: no journal is kept)."""
    if journal_dir is None or not key_root:
        return None
    return journal_dir / f".kvtier-kv-events-{key_root.hex()}.msgpack"


def read_journal(path: Path) -> Journal | None:
    """The journal at ``path``, or ``None`` when it is absent, unreadable, larger than
    :data:`MAX_BYTES`, of another format or of another block-hash seed (logged once, never raised).
    ``media`` is ``[""] * len(keys)`` when the file kept none."""
    if not path.exists():
        return None
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        journal = msgspec.msgpack.decode(path.read_bytes(), type=Journal)
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        log.warning("kvtier: KV-event journal %s not read (%s); disk chunks are announced as requests "
                    "look them up", path, exc)
        return None
    if journal.version != JOURNAL_VERSION or journal.none_hash != none_hash() or len(journal.keys) != len(
            journal.metas):
        log.warning("kvtier: KV-event journal %s is of another format or block-hash seed (set PYTHONHASHSEED "
                    "or use a sha256 --prefix-caching-hash-algo to keep hashes across restarts); ignored", path)
        return None
    if len(journal.media) != len(journal.keys):
        journal.media = [""] * len(journal.keys)
    return journal


def write_journal(path: Path, keys: list[bytes], metas: list[ChunkMeta], media: list[str],
                  max_chunks: int | None = None) -> bool:
    """Write the journal (temporary file, then rename); ``False`` (logged) when it could not.

    The chunks a journal already at ``path`` describes (another engine's, on the same directory
    and namespace) and ``keys`` lacks are kept, before ``keys``'s, with the medium that engine
    announced them at; at most ``max_chunks`` (``None``: no bound) are written, the oldest of the
    kept ones dropped first.  The read and the rename are done under an exclusive ``flock`` of the
    directory, so two engines stopping at once do not write over each other."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        log.warning("kvtier: KV-event journal %s not written (%s)", path, exc)
        return False
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX)
        old = read_journal(path)
        if old is not None:
            ours = set(keys)
            kept = [i for i, key in enumerate(old.keys) if key not in ours]
            keys = [old.keys[i] for i in kept] + keys
            metas = [old.metas[i] for i in kept] + metas
            media = [old.media[i] for i in kept] + media
        if max_chunks is not None:
            keys, metas, media = keys[-max_chunks:], metas[-max_chunks:], media[-max_chunks:]
        tmp.write_bytes(msgspec.msgpack.encode(Journal(JOURNAL_VERSION, none_hash(), keys, metas, media)))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("kvtier: KV-event journal %s not written (%s)", path, exc)
        tmp.unlink(missing_ok=True)
        return False
    finally:
        os.close(dir_fd)  # and with it the lock
    return True


def none_hash() -> bytes:
    """vLLM's seed of every block-hash chain in this process (``b""`` before it is set)."""
    value = getattr(kv_cache_utils, "NONE_HASH", b"")
    return bytes(value) if value else b""
