"""What the two halves of the connector tell each other, through vLLM's own per-step messages.

- scheduler → workers: :class:`KVTierMetadata` (vLLM's ``KVConnectorMetadata``), built each
  step by ``build_connector_meta`` and shipped by vLLM with the scheduler output;
- workers → scheduler: :class:`KVTierWorkerMeta` (vLLM's ``KVConnectorWorkerMetadata``), built
  each step by ``build_connector_worker_meta``, merged across tensor-parallel ranks by vLLM with
  :meth:`KVTierWorkerMeta.aggregate` and handed to ``update_connector_output``.

There is no other channel.  Everything here is plain data (str, int, bytes, tuples, lists,
dicts): vLLM serializes it between processes with its own serializer.

Index arithmetic (``k = chunk_tokens // block_size`` engine blocks per chunk)::

    tokens : |<------- chunk 0 ------->|<------- chunk 1 ------->|<- tail ->|
    blocks : | b0 | b1 | ... | b(k-1)  | bk | ...     | b(2k-1)  |  ...
    a load : local prefix-cache hit ends at block j (block-aligned, maybe mid-chunk);
             kvtier fills blocks j .. num_chunks*k - 1, reading each block from
             its chunk's page at offset (block index - chunk index * k).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class PageMove:
    """One stored page of one KV cache group of a hybrid model (see
    :mod:`kvtier.integrations.vllm.groups`): page slot ``first_slot + j`` ↔ engine block
    ``block_ids[j]`` of group ``group``'s layers.

    Attributes:
        key: the page's key (``group_key(chunk key, group)``, 16 bytes).
        group: KV cache group index.
        chunk: chunk index (for a state page: the chunk ending at the snapshot's boundary).
        first_slot: first page slot moved.
        block_ids: engine block ids of that group (never the null block).
    """

    key: bytes
    group: int
    chunk: int
    first_slot: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadJob:
    """Move a request's cached prefix into its engine blocks, asynchronously, on the workers.

    Attributes:
        req_id: vLLM request id; reported in ``finished_recving`` when the job ends (either way).
        keys: chunk keys ``0 .. num_chunks - 1`` of the prefix (16 bytes each).
        first_block: request-relative index of the first block to fill.
        block_ids: engine block ids for blocks ``first_block .. num_chunks*k - 1``.
        resumed: the request is re-admitted after a preemption (vLLM counts its hits apart).
        pages: hybrid models only: every page to move (all groups); ``keys`` and ``block_ids``
            are then empty.  The load succeeds whole or is reported failed whole (vLLM takes no
            block-level errors with several KV cache groups).
        hit_tokens: hybrid models only: the boundary the pages resume at.
    """

    req_id: str
    keys: tuple[bytes, ...]
    first_block: int
    block_ids: tuple[int, ...]
    resumed: bool = False
    pages: tuple[PageMove, ...] = ()
    hit_tokens: int = 0

    @property
    def num_chunks(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class SaveJob:
    """Copy the KV of full chunks out of the engine after this step's forward pass.

    Attributes:
        req_id: vLLM request id.
        keys: chunk keys ``0 .. chunk_end - 1`` (parents are needed by the eviction policy).
        chunk_start: first chunk to save (earlier ones were handled in earlier steps).
        block_ids: engine block ids of chunks ``chunk_start .. chunk_end - 1`` (``k`` per chunk).
        pages: hybrid models only: the pages to save (``keys``/``block_ids`` then empty).
    """

    req_id: str
    keys: tuple[bytes, ...]
    chunk_start: int
    block_ids: tuple[int, ...]
    pages: tuple[PageMove, ...] = ()

    @property
    def chunk_end(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class ResetOrder:
    """Clear this rank's store (vLLM's external prefix-cache reset; the scheduler acknowledged it).

    Attributes:
        epoch: the scheduler's reset count; the rank reports it back (``RankReport.epoch``) once applied.
        tiers: names of the tiers to clear (``reset_scope`` resolved by the registry).
    """

    epoch: int
    tiers: tuple[str, ...]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """One step's jobs: loads start in ``start_load_kv``, saves copy in ``wait_for_save``; a
    ``reset`` order is applied in ``start_load_kv`` before this step's loads start."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    reset: ResetOrder | None = None


@dataclass
class RankReport:
    """One rank's news for the scheduler's mirror of its store.

    Attributes:
        key_root: the rank-independent namespace digest chunk keys are chained from (16 bytes).
        changes: ``(key, tier)`` pairs from the store's change feed (``tier`` ``None`` = gone).
        full: ``changes`` is a complete snapshot (the mirror of this rank is replaced).
        namespace: this rank's store namespace digest (16 bytes; with the tp rank in it): the
            shared tier's keys are ``<prefix><namespace hex>:<chunk key hex>``, so the scheduler
            needs it to ask the shared tier about this rank's chunks.
        busy: chunks of this rank are pinned by loads or disk writes in flight (the scheduler keeps
            an idle engine stepping until it is false: :mod:`kvtier.integrations.vllm.settle`).
        epoch: the last :class:`ResetOrder` epoch this rank applied (0: none); the mirror drops
            reports of an older epoch than its own.
    """

    key_root: bytes
    changes: list[tuple[bytes, str | None]] = field(default_factory=list)
    full: bool = False
    namespace: bytes = b""
    busy: bool = False
    epoch: int = 0


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler, one step: each rank's :class:`RankReport`, by tensor-parallel rank."""

    ranks: dict[int, RankReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMeta), f"cannot merge {type(other).__name__} into kvtier's metadata"
        self.ranks.update(other.ranks)
        return self
