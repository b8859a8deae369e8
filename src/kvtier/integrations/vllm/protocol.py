"""What the two halves of the connector tell each other, through vLLM's own per-step messages.

- scheduler → workers: :class:`KVTierMetadata` (vLLM's ``KVConnectorMetadata``), built each
  step by ``build_connector_meta`` and shipped by vLLM with the scheduler output;
- workers → scheduler: :class:`KVTierWorkerMeta` (vLLM's ``KVConnectorWorkerMetadata``), built
  each step by ``build_connector_worker_meta``, merged across tensor-parallel ranks by vLLM with
  :meth:`KVTierWorkerMeta.aggregate` and handed to ``update_connector_output``.

There is no other channel.  Everything here is plain data (str, int, bytes, tuples, lists,
dicts): vLLM serializes it between processes with its own serializer.

Jobs have one shape for every model: a list of :class:`PageMove` (a dense model is a one-group
plan whose pages are its chunks).  Index arithmetic of a full-attention group
(``k = chunk_tokens // block_size`` engine blocks per chunk)::

    tokens : |<------- chunk 0 ------->|<------- chunk 1 ------->|<- tail ->|
    blocks : | b0 | b1 | ... | b(k-1)  | bk | ...     | b(2k-1)  |  ...
    a load : local prefix-cache hit ends at block j (block-aligned, maybe mid-chunk);
             kvtier fills blocks j .. hit/block_size - 1: chunk j // k's page from slot
             j - (j // k) * k, then whole pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # scripts/gpu_check.py --mode runner, on a GPU machine without vLLM: plain dataclasses
    KVConnectorMetadata = KVConnectorWorkerMetadata = object  # type: ignore[misc,assignment]

from kvtier.core.tenant import TenantId


@dataclass(frozen=True)
class PageMove:
    """One stored page of one KV cache group: page slot ``first_slot + j`` ↔ engine block
    ``block_ids[j]`` of group ``group``'s layers.  A dense model is a one-group plan: its pages
    are its chunks (see :mod:`kvtier.integrations.vllm.scheduler.pages`).

    Attributes:
        key: the page's key (16 bytes): the chunk key for a dense model,
            ``group_key(chunk key, group)`` for a hybrid one.
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
    """Move a request's cached prefix into its engine blocks on the workers.

    One shape for every model: the pages of every KV cache group (one group for a dense model).
    Asynchronous by default (a loader thread; the request waits in ``WAITING_FOR_REMOTE_KVS`` and
    the job ends in ``finished_recving``).  ``sync``: the copy runs in ``start_load_kv`` before
    the forward of the step that scheduled the request (vLLM's ``(n, False)`` answer of
    ``get_num_new_matched_tokens``, vllm/distributed/kv_transfer/kv_connector/v1/base.py); it is
    never reported in ``finished_recving``, and the blocks it could not fill are reported by
    ``get_block_ids_with_load_errors`` in that same step.

    Attributes:
        req_id: vLLM request id; reported in ``finished_recving`` when the job ends (either way).
        pages: every page to move, each group's in chunk order.
        first_token: the engine's own hit (block aligned): tokens before it are not loaded.
        hit_tokens: the chunk boundary the load resumes the request at.
        tiers: the tier the scheduler planned to read each chunk ``0 .. hit_tokens / chunk_tokens
            - 1`` from (the slowest of its pages' tiers; ``""`` before the engine's own hit): what
            vLLM was told (``get_external_cache_hit_sources``) and what the loaded-token
            counters are labelled with.
        resumed: the request is re-admitted after a preemption (vLLM counts its hits apart).
        sync: copy in this step, before the forward, from the cpu tier and the node pool only (see above).
        tenant: the request's tenant (:class:`~kvtier.core.tenant.TenantId`), for the load's
            context on the worker (:class:`~kvtier.core.context.OpContext`); ``None``: unknown.
    """

    req_id: str
    pages: tuple[PageMove, ...]
    first_token: int
    hit_tokens: int
    tiers: tuple[str, ...]
    resumed: bool = False
    sync: bool = False
    tenant: TenantId | None = None


@dataclass(frozen=True)
class SaveJob:
    """Copy the KV of full chunks out of the engine after this step's forward pass.

    Attributes:
        req_id: vLLM request id.
        pages: the pages to save, each group's in chunk order.
        parent: the key of the page before the first one in its group's chain (``b""``: none);
            the eviction policy keeps children after their parents.
        pin_s: the request asked to keep its prompt's chunks in the cpu tier this long, seconds
            (``kv_transfer_params`` ``kvtier_pin_s``, capped at ``pin_max_s``); 0: no pin.
        pin_chunks: the pages of chunks ``0 .. pin_chunks - 1`` (the prompt's full chunks) are pinned.
        tenant: the request's ``cache_salt`` and LoRA adapter as digests (:class:`~kvtier.core.tenant.TenantId`),
            stored with the chunks for ``kvtier purge --salt/--lora``; ``None``: unknown.
        explain_chunk: the chunk whose absence the request's receipt explains (its first chunk no
            cache served): a worker that finds it in no tier reports why
            (:attr:`RequestFacts.explained`); -1: none.
        seq: a deferred save's number (``async_saves``; full-attention pages only; -1: not
            deferred): the copy runs after ``wait_for_save`` returns, on the worker's saver thread;
            each rank reports the number once the save ended (``RankReport.saves_ended``), and a
            request finished before every rank did is held (``KVTierMetadata.held``).
        touch_chunks: chunks ``0 .. touch_chunks - 1`` were served by vLLM's own prefix cache at the
            request's admission: those of its pages the cpu tier holds are touched in its policy (a
            use, as a load's); 0: none touched.
    """

    req_id: str
    pages: tuple[PageMove, ...]
    parent: bytes = b""
    pin_s: float = 0.0
    pin_chunks: int = 0
    tenant: TenantId | None = None
    explain_chunk: int = -1
    seq: int = -1
    touch_chunks: int = 0

    @property
    def deferred(self) -> bool:
        """The copy runs on the worker's saver thread, after ``wait_for_save`` returned."""
        return self.seq >= 0


@dataclass
class RequestFacts:
    """What one rank learned of one request's cache use in one step, for its receipt (issue 35;
    :class:`~kvtier.integrations.vllm.scheduler.requests.ReceiptDesk` builds the receipt from these and the plan).

    Attributes:
        unfilled: tokens its load was planned and did not get, by planned tier.
        load_s: seconds its loads took, by tier (each tier's reads, and the rest of the load's wall
            time split by the tokens each tier delivered).
        miss: ``(token, reason, tier)`` of the first token a load came up short at, else ``None``.
        below: ``(token, reason, tier)``: the first token served from below the top tier, and why
            the top tier lacked it (the top tier's name as ``tier``).
        explained: ``(token, reason, tier)``: why the chunk its save job asked about
            (``SaveJob.explain_chunk``) was in no tier.
        saved: chunks its saves newly stored, by tier (the top tier's; hybrid models: pages).
        dropped: chunks its saves dropped, by :data:`~kvtier.core.receipt.MissReason`.
        pinned / pin_refused: chunks its TTL pins kept / were refused.
    """

    unfilled: dict[str, int] = field(default_factory=dict)
    load_s: dict[str, float] = field(default_factory=dict)
    miss: tuple[int, str, str] | None = None
    below: tuple[int, str, str] | None = None
    explained: tuple[int, str, str] | None = None
    saved: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    pinned: int = 0
    pin_refused: int = 0

    def merge(self, other: RequestFacts) -> None:
        """Add ``other`` (a later report of the same rank): sums, and the earliest miss."""
        for mine, theirs in ((self.unfilled, other.unfilled), (self.saved, other.saved), (self.dropped, other.dropped)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        for k, s in other.load_s.items():
            self.load_s[k] = self.load_s.get(k, 0.0) + s
        self.miss = _first(self.miss, other.miss)
        self.below = _first(self.below, other.below)
        self.explained = self.explained or other.explained
        self.pinned += other.pinned
        self.pin_refused += other.pin_refused


def _first(a: tuple[int, str, str] | None, b: tuple[int, str, str] | None) -> tuple[int, str, str] | None:
    return b if a is None or (b is not None and b[0] < a[0]) else a


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
    ``reset`` order is applied in ``start_load_kv`` before this step's loads start.

    ``no_forward``: the step schedules no tokens (``SchedulerOutput.total_num_scheduled_tokens ==
    0``; vLLM's worker runs ``kv_connector_no_forward``): a rank with a load in flight may wait for
    it to end, up to ``idle_step_wait_s``, before it answers ``get_finished``.  False: never waits.

    ``preempted``: requests vLLM preempted this step (``SchedulerOutput.preempted_req_ids``): their
    blocks are free again, so ``handle_preemptions`` waits for their deferred saves before the forward.
    ``held``: requests finished with a deferred save still running on some rank (``request_finished``
    returned True): each rank names them in ``finished_sending`` once its own saves of them ended."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    reset: ResetOrder | None = None
    no_forward: bool = False
    preempted: frozenset[str] = frozenset()
    held: frozenset[str] = frozenset()


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
            an idle engine stepping until it is false: :mod:`kvtier.integrations.vllm.scheduler.steps`).
        epoch: the last :class:`ResetOrder` epoch this rank applied (0: none); the mirror drops
            reports of an older epoch than its own.
        facts: what this rank learned of requests' cache use since its last report, by request id
            (:class:`RequestFacts`, for their receipts).
        saves_ended: the numbers (``SaveJob.seq``) of the deferred saves that ended on this rank
            since its last report, published or not.
    """

    key_root: bytes
    changes: list[tuple[bytes, str | None]] = field(default_factory=list)
    full: bool = False
    namespace: bytes = b""
    busy: bool = False
    epoch: int = 0
    facts: dict[str, RequestFacts] = field(default_factory=dict)
    saves_ended: tuple[int, ...] = ()


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler, one step: each rank's :class:`RankReport`, by tensor-parallel rank."""

    ranks: dict[int, RankReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMeta), f"cannot merge {type(other).__name__} into kvtier's metadata"
        self.ranks.update(other.ranks)
        return self
