"""Chunk keys: chained, namespaced, deterministic digests of token-id chunks.

A prompt is cut into chunks of ``chunk_tokens`` tokens; only full chunks get a key (a partial
tail chunk is always recomputed)::

    tokens:  |<-- chunk 0 -->|<-- chunk 1 -->|<-- chunk 2 -->|<- tail ->|
    keys:     k0 = H(ns, t0)  k1 = H(k0, t1)  k2 = H(k1, t2)   (no key)

Because each key folds in its parent, equal keys imply equal whole prefixes, so a key identifies
a KV chunk together with everything before it.  The namespace ``ns`` folds in everything that
changes the KV bytes (model, dtype, geometry, layout, tensor-parallel size and rank, chunk size)
and the per-request isolation inputs (``cache_salt``, LoRA adapter, multimodal hashes), so KV
written under one namespace can never be returned under another.

Digests are BLAKE3 truncated to 128 bits: deterministic across processes, hosts and restarts
(no Python ``hash()``, no random seed), and collision-resistant even against adversarial
prompts, which matters because a collision would serve one tenant's KV to another.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, NewType

import blake3

if TYPE_CHECKING:
    import numpy as np

ChunkKey = NewType("ChunkKey", bytes)
"""A 16-byte chained digest naming one chunk of KV together with its whole prefix."""

KEY_BYTES = 16

KEY_FORMAT_VERSION = 1
"""Version of the key derivation below.  Keys name chunk files that outlive a process, so any change
to how a key is computed must bump this (old files then simply miss); the pinned vectors in
tests/core/test_format_vectors.py fail until the bump and the new vectors are made together."""

_NS_TAG = f"kvtier-ns-v{KEY_FORMAT_VERSION}\0".encode()
_ROOT_TAG = f"kvtier-root-v{KEY_FORMAT_VERSION}\0".encode()


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes of a KV chunk; two chunks share a key space only if
    every field is equal.

    Attributes:
        model: model identity (name or path plus revision if known).
        kv_dtype: KV cache dtype as the engine stores it, e.g. ``"bfloat16"``, ``"fp8_e4m3"``.
        num_layers: attention layers whose KV is stored.
        num_kv_heads: KV heads held by this tensor-parallel rank.
        head_size: elements per head.
        layout: the engine's per-layer KV layout string, e.g. ``"cpu:[blocks,heads,block,2*head]"``.
        tp_size: tensor-parallel size; tp_rank: this rank.
        chunk_tokens: tokens per chunk.
        extra: any other engine facts that change bytes (block size, MLA, cache version, ...).
    """

    model: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    layout: str
    tp_size: int = 1
    tp_rank: int = 0
    chunk_tokens: int = 128
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def digest(self) -> bytes:
        """The namespace's 16-byte digest (BLAKE3 over its canonical JSON)."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return blake3.blake3(_NS_TAG + text.encode()).digest(KEY_BYTES)

    def engine_digests(self) -> tuple[bytes, ...]:
        """The 16-byte digests of this namespace and of every other tensor-parallel rank's of the same
        engine (``tp_rank`` 0 .. ``tp_size`` - 1), this one's first: the namespace directories one engine's
        disk tiers fill together."""
        ranks = (replace(self, tp_rank=rank).digest() for rank in range(self.tp_size))
        return tuple(dict.fromkeys((self.digest(), *ranks)))


def request_root(namespace: Namespace | bytes, cache_salt: str | None = None,
                 lora: str | None = None, mm_hashes: Sequence[str] = ()) -> bytes:
    """The root digest of one request's key chain.

    Args:
        namespace: the engine namespace, or its ``digest()``.
        cache_salt: the request's ``cache_salt`` (vLLM request field); different salts never share.
        lora: LoRA adapter identity (name and/or path); ``None`` for the base model.
        mm_hashes: multimodal input hashes; different images never share KV.

    Returns:
        16 bytes.
    """
    ns = namespace.digest() if isinstance(namespace, Namespace) else namespace
    h = blake3.blake3(_ROOT_TAG + ns)
    for tag, value in ((b"salt", cache_salt), (b"lora", lora)):
        if value is not None:
            data = value.encode()
            h.update(tag + len(data).to_bytes(4, "little") + data)
    for mm in mm_hashes:
        data = mm.encode()
        h.update(b"mm" + len(data).to_bytes(4, "little") + data)
    return h.digest(KEY_BYTES)


def chunk_keys(root: bytes, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int) -> list[ChunkKey]:
    """Chained keys of the full chunks of ``token_ids``.

    Args:
        root: the request root from :func:`request_root` (16 bytes).
        token_ids: prompt token ids, shape ``[num_tokens]``.
        chunk_tokens: tokens per chunk (> 0).

    Returns:
        ``num_tokens // chunk_tokens`` keys; key ``i`` = BLAKE3(key ``i-1`` || tokens of chunk ``i``),
        with key ``-1`` being ``root``.  Token ids are hashed as little-endian int64.

    Raises:
        ValueError: if ``chunk_tokens`` is not positive.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    num_chunks = len(token_ids) // chunk_tokens
    n = num_chunks * chunk_tokens
    # (numpy is not imported here: an array can only come from a process that imported it, and the
    # CLI's start-up, which imports this module, imports no numpy)
    if (numpy := sys.modules.get("numpy")) is not None and isinstance(token_ids, numpy.ndarray):
        data = numpy.ascontiguousarray(token_ids[:n], dtype="<i8").tobytes()
    else:  # a list of ints: one C-level pack, a third of numpy's conversion (the scheduler's lookup path)
        data = struct.pack(f"<{n}q", *(token_ids if len(token_ids) == n else token_ids[:n]))
    step = chunk_tokens * 8
    keys: list[ChunkKey] = []
    parent = root
    for start in range(0, n * 8, step):
        parent = blake3.blake3(parent + data[start:start + step]).digest(KEY_BYTES)
        keys.append(ChunkKey(parent))
    return keys


def key_hex(key: bytes) -> str:
    """Hex form of a key, for file names and logs."""
    return key.hex()
