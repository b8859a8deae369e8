"""Clearing one namespace of the redis tier on the server: a reset (``reset_scope: all``).

Keys are ``<prefix><namespace hex>:<keyspace><chunk key hex>`` (:mod:`kvtier.core.tiers.redis.tier`).
:func:`clear_namespace` lists them with ``SCAN MATCH`` (the prefix, glob characters escaped, then
exactly a chunk key's 32 hex digits: never another namespace's keys, nor this namespace's under
another shared secret's keyspace) and deletes them with ``UNLINK`` in batches, on the tier's own
threads under :data:`CLEAR_DEADLINE_S`.  In a Cluster, redis-py's ``scan_iter`` visits every
primary.  This is the store's own clear (the tier's data path); from outside any store (vLLM's
scheduler) the reset is :func:`kvtier.core.purge.reset_outside` over
:class:`~kvtier.core.tiers.redis.blobs.RedisBlobs`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.tiers.base import ClearResult

CLEAR_DEADLINE_S = 30.0
"""Longest a clear waits for the server to list and delete a namespace's keys, seconds."""
CLEAR_BATCH = 1000
"""Keys asked per ``SCAN`` call and deleted per ``UNLINK``."""


def glob_escape(raw: bytes) -> bytes:
    """``raw`` with Redis glob characters escaped, so a key prefix matches only itself."""
    out = bytearray()
    for byte in raw:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)


def _chunk_keys(rkeys: list[bytes], prefix_len: int) -> list[ChunkKey]:
    out = []
    for rk in rkeys:
        try:
            out.append(ChunkKey(bytes.fromhex(rk[prefix_len:].decode())))
        except ValueError:
            continue
    return out


def clear_namespace(client: Any, prefix: bytes, call: Callable[[Callable[[], list[ChunkKey]]], list[ChunkKey] | None],
                    where: str) -> ClearResult:
    """Delete every ``<prefix><chunk key hex>`` key.

    Args:
        client: a redis-py client (standalone or Cluster).
        prefix: the tier's key prefix with the namespace (and keyspace).
        call: runs the work under the tier's deadline and breaker; ``None`` on a fault.
        where: the redacted URL, for the reason.

    Returns:
        the chunk keys deleted; ``ok`` False when the server did not answer in time.
    """
    pattern = glob_escape(prefix) + b"?" * (2 * KEY_BYTES)

    def scan_and_unlink() -> list[ChunkKey]:
        removed: list[ChunkKey] = []
        batch: list[bytes] = []
        for rk in client.scan_iter(match=pattern, count=CLEAR_BATCH):
            batch.append(rk)
            if len(batch) >= CLEAR_BATCH:
                client.unlink(*batch)
                removed += _chunk_keys(batch, len(prefix))
                batch = []
        if batch:
            client.unlink(*batch)
            removed += _chunk_keys(batch, len(prefix))
        return removed

    removed = call(scan_and_unlink)
    if removed is None:
        return ClearResult([], False, f"the server at {where} did not list and delete the namespace's keys")
    return ClearResult(removed)
