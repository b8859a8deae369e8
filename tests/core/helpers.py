"""Small builders shared by the core tests (real objects, no mocks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.keys import ChunkKey, Namespace, chunk_keys, request_root
from kvtier.core.store import TieredStore
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
from kvtier.core.tiers.disk.tier import DiskTier

CHUNK_TOKENS = 4
CHUNK_BYTES = 1024
NS = Namespace(model="test-model", kv_dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64,
               layout="test", chunk_tokens=CHUNK_TOKENS)


def make_store(tmp_path: Path | None, cpu_chunks: int, disk_chunks: int = 0, **overrides: object) -> TieredStore:
    """A store whose cpu tier holds ``cpu_chunks`` chunks and disk tier ``disk_chunks`` chunk files."""
    values: dict[str, object] = {"chunk_tokens": CHUNK_TOKENS, "cpu_gib": cpu_chunks * CHUNK_BYTES / GiB,
                                 "write_mode": "write-back"}  # the scenarios here narrate write-back
    if disk_chunks and tmp_path is not None:
        values.update(disk_path=str(tmp_path / "disk"), disk_gib=disk_chunks * (CHUNK_BYTES + HEADER_BYTES) / GiB)
    values.update(overrides)
    return TieredStore(KVTierConfig.from_dict(values), NS, CHUNK_BYTES)


def chain_of(prompt: int, num_chunks: int, salt: str | None = None) -> list[ChunkKey]:
    """Keys of a prompt whose tokens are derived from ``prompt`` (distinct prompts share nothing)."""
    tokens = np.arange(num_chunks * CHUNK_TOKENS) + prompt * 1_000_000
    return chunk_keys(request_root(NS, cache_salt=salt), tokens, CHUNK_TOKENS)


def payload(key: bytes) -> bytes:
    """Deterministic chunk bytes derived from the key, so any mix-up shows."""
    return (key * (CHUNK_BYTES // len(key) + 1))[:CHUNK_BYTES]


def break_disk_shards(disk: DiskTier, keys: list[ChunkKey]) -> None:
    """Make every write of ``keys`` to ``disk`` fail (ENOTDIR): a file stands where each key's shard
    directory was."""
    import shutil

    for k in keys:
        shard = disk.path(k).parent
        if shard.is_dir():
            shutil.rmtree(shard)
        shard.write_text("not a directory")


def shared_prefix(store: TieredStore, chain: list[ChunkKey]) -> int:
    """Leading chunks of ``chain`` held by ``store``'s local tiers and then its first shared tier:
    what the scheduler's remote lookup finds (one presence batch for the rest of the chain,
    :mod:`kvtier.integrations.vllm.scheduler.remote`) and what ``prepare_load`` then reads."""
    n = store.lookup(chain)
    shared = store.index.shared
    if not shared or n >= len(chain):
        return n
    return n + store.mover.leading_present(shared[0].name, chain[n:])
