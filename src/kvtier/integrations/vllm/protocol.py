"""What the scheduler-side connector tells the worker-side connector, per engine step.

Index arithmetic (``k = chunk_tokens // block_size`` engine blocks per chunk)::

    tokens : |<------- chunk 0 ------->|<------- chunk 1 ------->|<- tail ->|
    blocks : | b0 | b1 | ... | b(k-1)  | bk | ...     | b(2k-1)  |  ...
    a load : local prefix-cache hit ends at block j (block-aligned, maybe mid-chunk);
             kvtier fills blocks j .. num_chunks*k - 1, reading each block from
             its chunk's page at offset (block index - chunk index * k).

Everything here is plain data (msgspec/pickle-friendly): vLLM ships the metadata from the
scheduler process to every worker process each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class RequestKeys:
    """What a request's chunk keys depend on, besides the engine namespace.

    Attributes:
        token_ids: the request's tokens, ``[num_tokens]`` (only full chunks get keys).
        cache_salt: vLLM's per-request ``cache_salt``; different salts never share KV.
        lora: LoRA adapter identity (``name@path``) or ``None`` for the base model.
        mm_hashes: multimodal input identifiers (vLLM's mm hashes), in prompt order.
    """

    token_ids: tuple[int, ...]
    cache_salt: str | None = None
    lora: str | None = None
    mm_hashes: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoadJob:
    """Copy pinned chunks into the engine's blocks before this step's forward pass.

    Attributes:
        req_id: vLLM request id (its chunks were pinned by ``pin``).
        first_block: request-relative index of the first block to fill.
        block_ids: engine block ids for blocks ``first_block .. num_chunks*k - 1``.
        num_chunks: chunks of the pinned prefix this load uses.
        resumed: the request is re-admitted after a preemption (vLLM counts its hits apart,
            as preempted hits, not in ``external_prefix_cache_hits``).
    """

    req_id: str
    first_block: int
    block_ids: tuple[int, ...]
    num_chunks: int
    resumed: bool = False


@dataclass(frozen=True)
class SaveJob:
    """Copy the KV of full chunks out of the engine after this step's forward pass.

    Attributes:
        req_id: vLLM request id.
        keys: key inputs covering chunks ``0 .. chunk_end - 1``.
        chunk_start: first chunk to save (earlier ones were handled in earlier steps).
        chunk_end: one past the last chunk to save.
        block_ids: engine block ids of chunks ``chunk_start .. chunk_end - 1`` (``k`` per chunk).
    """

    req_id: str
    keys: RequestKeys
    chunk_start: int
    chunk_end: int
    block_ids: tuple[int, ...]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """One step's jobs: loads run in ``start_load_kv``, saves in ``wait_for_save``."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
