"""One request as the scheduler side knows it: its state between admission and
``request_finished`` (:class:`RequestState`), its chunk keys (:class:`RequestChain`), the pin
TTL it asks for (:func:`pin_seconds`) and, after it finished, whether its deferred saves still
hold its blocks (:class:`DeferredSaves`).

**Deferred saves** as the scheduler sees them: which are still running on some rank, and which
finished requests therefore keep their blocks (``async_saves``; :mod:`kvtier.integrations.vllm.worker.saves`).

A deferred save job gets a number when it is shipped (:meth:`DeferredSaves.ship`); every rank
reports the number once the save ended there (``RankReport.saves_ended``, folded by
:meth:`DeferredSaves.ended`).  At ``request_finished`` a request with a number not yet reported by
every rank is held (:meth:`DeferredSaves.finish` → True: vLLM keeps its blocks) and named in the
next step's ``KVTierMetadata.held``, so that each rank reports it in ``finished_sending`` once its
own saves of it ended; one whose saves all ended is freed at once.  A preempted request's numbers
are forgotten (:meth:`DeferredSaves.forget`): the workers wait for its saves before the forward
that may reuse its blocks.  vLLM's offloading connector tracks its store jobs the same way
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py, ``get_finished``).

Bounds: one entry per deferred job not yet reported by every rank; a finished request's entries
go at once (its hold is then the workers' to end).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.keys import chunk_keys, request_root
from kvtier.core.tenant import TenantId
from kvtier.integrations.vllm.scheduler.receipts import ReceiptFacts

PIN_PARAM = "kvtier_pin_s"
"""The ``kv_transfer_params`` key a request names its prompt's pin TTL with, seconds (issue 22 item 4)."""


def pin_seconds(params: Any, max_s: float) -> tuple[float, str | None]:
    """A request's pin TTL from its ``kv_transfer_params`` (OpenAI ``extra_body``), seconds.

    Returns:
        ``(ttl_s, problem)``: ``ttl_s`` 0 when the request asks for no pin or asks wrongly, capped
        at ``max_s`` (``pin_max_s``); ``problem`` one sentence for the log when the value was
        refused or cut, else ``None``.
    """
    value = params.get(PIN_PARAM) if isinstance(params, dict) else None
    if value is None:
        return 0.0, None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return 0.0, (f"kv_transfer_params.{PIN_PARAM} must be a positive number of seconds, got {value!r}; "
                     "the prompt is not pinned")
    if value > max_s:
        return max_s, f"kv_transfer_params.{PIN_PARAM}={value:g} is above pin_max_s; pinned for {max_s:g} s"
    return float(value), None


class RequestChain:
    """Chunk keys of one request, extended as its tokens grow (hashing each chunk once)."""

    def __init__(self, request: Any, key_root: bytes, chunk_tokens: int) -> None:
        lora = getattr(request, "lora_request", None)
        lora_id = f"{lora.lora_name}@{lora.lora_path}" if lora is not None else None
        mm = [str(f.identifier) for f in (getattr(request, "mm_features", None) or ())]
        self.root = request_root(key_root, getattr(request, "cache_salt", None), lora_id, mm)
        self.tenant = TenantId.of(getattr(request, "cache_salt", None), lora.lora_name if lora is not None else None)
        self.chunk_tokens = chunk_tokens
        self.keys: list[bytes] = []

    def upto(self, token_ids: Any, num_chunks: int) -> list[bytes]:
        """Keys of chunks ``0 .. num_chunks - 1`` (``token_ids`` must hold them)."""
        have = len(self.keys)
        if num_chunks > have:
            parent = self.keys[-1] if self.keys else self.root
            more = token_ids[have * self.chunk_tokens:num_chunks * self.chunk_tokens]
            self.keys.extend(chunk_keys(parent, more, self.chunk_tokens))
        return self.keys[:num_chunks]


@dataclass(eq=False)
class RequestState:
    """What the scheduler side knows of one request, from its admission to ``request_finished``.

    Attributes:
        request: vLLM's ``Request``.
        chain: its chunk keys, hashed once each as its tokens grow (``None`` until first needed).
        planned_tiers: the tier of each chunk of the hit last offered (``get_num_new_matched_tokens``),
            until its load job is shipped or the offer is withdrawn; ``None``: nothing offered.
        loading_blocks: an asynchronous load shipped and not yet reported finished: the engine
            blocks it fills.
        sync_pages: a synchronous load shipped: ``(chunk, its engine blocks)`` per page, checked
            against the invalid blocks of the next ``sync_outputs_left`` step outputs (2: with
            asynchronous scheduling a step's output comes after the next step is scheduled).
        load_failed: its load failed once (blocks reported invalid, or the whole load failed): vLLM
            asks again at once, and the same answer would fail the same way (e.g. a worker whose
            shared tier skips reads while the scheduler's lookups succeed), so it recomputes.
        saved_chunks: chunks ``0 .. saved_chunks - 1`` were put in save jobs, or are held by the
            tiers because its load filled them (:meth:`loaded`).
        loaded_chunks: an asynchronous load in flight fills chunks up to here; they join
            ``saved_chunks`` when it reports finished without a failed block (0: none).
        pin_s: its prompt's pin TTL, seconds (asked with ``kvtier_pin_s`` and valid; 0: none).
        refreshed: it asked again once already after an idle gap (see ``SchedulerSide``).
        receipt: what its receipt is built from (:mod:`~kvtier.integrations.vllm.scheduler.receipts`).
    """

    request: Any
    chain: RequestChain | None = None
    planned_tiers: list[str] | None = None
    loading_blocks: frozenset[int] | None = None
    sync_pages: tuple[tuple[int, tuple[int, ...]], ...] = ()
    sync_outputs_left: int = 0
    load_failed: bool = False
    saved_chunks: int = 0
    loaded_chunks: int = 0
    pin_s: float = 0.0
    refreshed: bool = False
    receipt: ReceiptFacts = field(default_factory=ReceiptFacts)

    @property
    def tenant(self) -> TenantId | None:
        """Its tenant (``cache_salt`` and LoRA adapter as digests), shipped with its load and save
        jobs so each worker builds the request's :class:`~kvtier.core.context.OpContext`; ``None``
        until its chain is first needed."""
        return self.chain.tenant if self.chain is not None else None

    def loaded(self, first_chunk: int, tiers: Sequence[str], sync: bool, local: AbstractSet[str]) -> None:
        """A load job of chunks ``first_chunk`` (where vLLM's own hit ends, rounded down) to
        ``len(tiers)`` (``tiers``: the planned tier of each chunk of the hit) was shipped: those in a
        tier of ``local`` (the cpu tier, disk: not shared) are held there (the load pins and reads them; its
        ``complete_load`` touches them in the policy), so no save job carries them again.  A save of
        a chunk a local tier holds stores nothing and touches nothing (``Index.plan_store`` passes it
        by), so skipping it changes no placement, policy or receipt; vLLM's native offload skips its
        hit chunks the same way (vllm/distributed/kv_transfer/kv_connector/v1/offloading/
        scheduler.py, ``next_stored_chunk_idx`` set to the hit's chunks on a load).  From the first
        chunk planned in a shared tier on, saves go as before (a shared-tier chunk the load could not
        promote into a cpu page is stored by the save, as it was).

        Only when the chunks before ``first_chunk`` already went out in save jobs (vLLM's own hit is
        none, or a resumed request's), so that ``saved_chunks`` stays one watermark over a prefix;
        never for a TTL-pinned request (its save job pins the prompt's chunks, held or not).  A
        synchronous load counts at once (its step's save job follows its copy; a block it could not
        fill moves the watermark back: ``steps.check_sync_load``); an asynchronous one once it
        reports finished with no failed block (:meth:`load_ended`).  A chunk evicted between the
        load and a later save is not saved again: its tier chose it as a victim after the load
        touched it, as it would have without this request."""
        if self.pin_s or self.saved_chunks < first_chunk:
            return
        end_chunk = next((c for c in range(first_chunk, len(tiers)) if tiers[c] not in local), len(tiers))
        if sync:
            self.saved_chunks = max(self.saved_chunks, end_chunk)
        else:
            self.loaded_chunks = end_chunk

    def load_ended(self, ok: bool) -> None:
        """Its asynchronous load reported finished (``ok``: no block failed; else vLLM recomputes
        from the first failed block and those chunks are saved once computed)."""
        if ok:
            self.saved_chunks = max(self.saved_chunks, self.loaded_chunks)
        self.loaded_chunks = 0


class DeferredSaves:
    """Deferred save jobs not yet reported ended by every rank (see the module docstring).

    Args:
        tp_size: tensor-parallel ranks, each of which reports every job.
    """

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self._next = 0
        self._open: dict[int, tuple[str, set[int]]] = {}  # seq -> (request, ranks yet to report it)
        self._by_req: dict[str, set[int]] = {}
        self._held: set[str] = set()  # finished and held, for the next step's metadata

    def ship(self, req_id: str) -> int:
        """A deferred save job of ``req_id`` is shipped: its number."""
        seq, self._next = self._next, self._next + 1
        self._open[seq] = (req_id, set(range(self.tp_size)))
        self._by_req.setdefault(req_id, set()).add(seq)
        return seq

    def ended(self, rank: int, seqs: Iterable[int]) -> None:
        """``rank`` reports the jobs ``seqs`` ended (numbers not open any more are ignored)."""
        for seq in seqs:
            entry = self._open.get(seq)
            if entry is None:
                continue
            req_id, ranks = entry
            ranks.discard(rank)
            if not ranks:
                del self._open[seq]
                left = self._by_req.get(req_id)
                if left is not None:
                    left.discard(seq)
                    if not left:
                        del self._by_req[req_id]

    def running(self, req_id: str) -> bool:
        """A deferred save of ``req_id`` has not been reported ended by every rank."""
        return bool(self._by_req.get(req_id))

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s numbers (preempted: the workers wait for its saves in ``handle_preemptions``)."""
        for seq in self._by_req.pop(req_id, ()):
            self._open.pop(seq, None)

    def finish(self, req_id: str) -> bool:
        """``request_finished``: True (hold the blocks; named in the next ``held``) when a save runs."""
        running = self.running(req_id)
        self.forget(req_id)
        if running:
            self._held.add(req_id)
        return running

    def take_held(self) -> frozenset[str]:
        """The requests held since the last call (for this step's metadata)."""
        held, self._held = frozenset(self._held), set()
        return held
