"""One request's path through the scheduler side, from admission to its receipt: its state
(:class:`RequestState`), its chunk keys (:class:`RequestChain`, found again in the engine's
:class:`~kvtier.integrations.vllm.scheduler.steps.KeyMemo`), the facts its receipt is built from
(:class:`ReceiptFacts`) and, once vLLM finished it, its receipt (:func:`build_receipt`, completed
by :class:`ReceiptDesk` when its last step's facts are in; design: docs/scheduler.md § Receipts).
What the scheduler keeps across requests and steps is :mod:`~kvtier.integrations.vllm.scheduler.steps`'.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, cast

import msgspec

from kvtier.core.keys import chunk_keys, request_root
from kvtier.core.receipt import (
    NO_TIER,
    WHOLLY_SERVED,
    MissReason,
    Receipt,
    ReceiptMiss,
    ReceiptPin,
    ReceiptSaved,
    ReceiptSink,
)
from kvtier.core.receiptsinks import receipt_counters as receipt_sink_counters
from kvtier.core.tenant import TenantId
from kvtier.integrations.vllm.protocol import RequestFacts
from kvtier.integrations.vllm.scheduler.steps import KeyMemo
from kvtier.integrations.vllm.worker.identity import lora_identity
from kvtier.integrations.vllm.worker.loader import tokens_by_tier

log = logging.getLogger(__name__)

@lru_cache(maxsize=1024)
def _root_and_tenant(key_root: bytes, salt: str | None, lora_name: str | None, lora_id: str | None,
                     mm: tuple[str, ...]) -> tuple[bytes, TenantId]:
    """A request's key root and tenant (each one BLAKE3 call or more), computed once per distinct request identity."""
    return request_root(key_root, salt, lora_id, mm), TenantId.of(salt, lora_name)


class RequestChain:
    """Chunk keys of one request, extended as its tokens grow (hashing each chunk once, and none
    that ``memo`` already knows)."""

    def __init__(self, request: Any, key_root: bytes, chunk_tokens: int, memo: KeyMemo | None = None) -> None:
        lora = getattr(request, "lora_request", None)
        lora_id = lora_identity(lora.lora_name, lora.lora_path) if lora is not None else None  # files fingerprinted
        features = getattr(request, "mm_features", None)  # (the generator only for a multimodal request: the hit path)
        mm = tuple(str(f.identifier) for f in features) if features else ()
        self.root, self.tenant = _root_and_tenant(key_root, getattr(request, "cache_salt", None),
                                                  lora.lora_name if lora is not None else None, lora_id, mm)
        self.chunk_tokens = chunk_tokens
        self.keys: list[bytes] = []
        self.memo = memo if memo is not None and memo.step else None
        # vLLM's list, extended in place as the request's tokens grow
        self.block_hashes: Sequence[Any] = getattr(request, "block_hashes", ()) if self.memo is not None else ()

    def upto(self, token_ids: Any, num_chunks: int) -> list[bytes]:
        """Keys of chunks ``0 .. num_chunks - 1`` (``token_ids`` must hold them)."""
        have = len(self.keys)
        if num_chunks > have and self.memo is not None:
            self.keys.extend(self.memo.known(self.root, self.block_hashes, have, num_chunks))
            have = len(self.keys)
        if num_chunks > have:
            parent = self.keys[-1] if self.keys else self.root
            more = chunk_keys(parent, token_ids[have * self.chunk_tokens:num_chunks * self.chunk_tokens],
                              self.chunk_tokens)
            if self.memo is not None:
                self.memo.add(self.root, self.block_hashes, have, more)
            self.keys.extend(more)
        return self.keys[:num_chunks]


@dataclass(eq=False)
class ReceiptFacts:
    """What the scheduler keeps of one request for its receipt.

    Attributes:
        asked: the local hit ``get_num_new_matched_tokens`` was last asked with (consumed by the
            allocation that follows it; ``None``: not asked since).
        engine: vLLM's own prefix-cache tokens at the request's admission (``None``: never admitted).
        planned: kvtier tokens promised at that admission, by planned tier.
        explain_chunk / explain_sent: the first chunk no cache was to serve (-1: none), and whether
            a save job asked the workers why.
        load_failed: its admission found a failed load (kvtier offered nothing again).
        waited_steps: engine steps it waited for an asynchronous load.
        pin: ``(ttl_s, problem)`` of the TTL pin it asked for, ``None``: none asked.
        ranks: what each tensor-parallel rank reported, merged over steps.
        shared_asked / shared_miss: ``(reason, tier)`` when the scheduler's shared-tier lookup at
            the last ask / at the admission did not answer (``deadline``: timed out or the
            lookups were queued ``shared_queue_depth`` deep; ``breaker_open``: the tier's breaker
            was open or the tier not ready), so the chunks it may have held were not offered.
    """

    asked: int | None = None
    engine: int | None = None
    planned: dict[str, int] = field(default_factory=dict)
    explain_chunk: int = -1
    explain_sent: bool = False
    load_failed: bool = False
    waited_steps: int = 0
    pin: tuple[float, str | None] | None = None
    ranks: dict[int, RequestFacts] = field(default_factory=dict)
    shared_asked: tuple[str, str] | None = None
    shared_miss: tuple[str, str] | None = None

    def admitted(self, request: Any, tiers: Sequence[str] | None, external: int, chunk_tokens: int,
                 load_failed: bool) -> None:
        """vLLM allocated ``request`` after asking for its hit (``update_state_after_alloc``):
        record what it counts as cached (its ``prefill_stats`` when it has them), unless this is a
        re-admission after preemption (vLLM keeps the first admission's numbers too)."""
        asked, self.asked = self.asked, None
        shared, self.shared_asked = self.shared_asked, None
        if asked is None or getattr(request, "num_preemptions", 0) > 0:
            return
        stats = getattr(request, "prefill_stats", None)
        self.engine = int(stats.num_local_cached_tokens) if stats is not None else asked
        hit = len(tiers) * chunk_tokens if tiers else 0
        self.planned = tokens_by_tier(tiers, hit - external, hit, chunk_tokens) if external > 0 and tiers else {}
        self.load_failed = load_failed
        self.shared_miss = shared
        served = self.engine + external
        loadable = (request.num_prompt_tokens - 1) // chunk_tokens * chunk_tokens
        self.explain_chunk = served // chunk_tokens if served < loadable else -1
        self.explain_sent = False

    def explain_in(self, start: int, end: int) -> int:
        """The chunk a save job of chunks ``[start, end)`` asks the workers about (-1: none)."""
        if self.explain_sent or not start <= self.explain_chunk < end:
            return -1
        self.explain_sent = True
        return self.explain_chunk

    def observe(self, rank: int, facts: RequestFacts) -> None:
        mine = self.ranks.get(rank)
        if mine is None:
            self.ranks[rank] = facts
        else:
            mine.merge(facts)


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
        receipt: what its receipt is built from (:class:`ReceiptFacts`).
        tenant: its tenant (``cache_salt`` and LoRA adapter as digests), shipped with its load and save
            jobs so each worker builds the request's :class:`~kvtier.core.context.OpContext`; ``None``
            until its chain is made (:meth:`keys`).
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
    tenant: TenantId | None = None

    def keys(self, key_root: bytes, chunk_tokens: int, memo: KeyMemo, num_chunks: int) -> list[bytes]:
        """Keys of its first ``num_chunks`` chunks (its :class:`RequestChain`, and so its tenant, made
        at the first call)."""
        if self.chain is None:
            self.chain = RequestChain(self.request, key_root, chunk_tokens, memo)
            self.tenant = self.chain.tenant
        return self.chain.upto(self.request.all_token_ids, num_chunks)

    def loaded(self, first_chunk: int, tiers: Sequence[str], sync: bool, local: AbstractSet[str]) -> None:
        """A load job of chunks ``first_chunk`` (where vLLM's own hit ends, rounded down) to
        ``len(tiers)`` (``tiers``: the planned tier of each chunk of the hit) was shipped: those in a
        tier of ``local`` (the cpu tier, disk: not shared) are held there, so no save job carries them
        again: ``saved_chunks`` moves past them at once for a synchronous load, once it reports
        finished with no failed block for an asynchronous one (:meth:`load_ended`); never for a
        TTL-pinned request, nor when the chunks before ``first_chunk`` are not saved yet.  Why this
        changes no placement, policy or receipt: docs/scheduler.md § A hit's chunks are not saved again."""
        if self.pin_s or self.saved_chunks < first_chunk:
            return
        end_chunk = next((c for c in range(first_chunk, len(tiers)) if tiers[c] not in local), len(tiers))
        if sync:
            self.saved_chunks = max(self.saved_chunks, end_chunk)
        else:
            self.loaded_chunks = end_chunk

    def check_sync_load(self, req_id: str, invalid: AbstractSet[int]) -> None:
        """One step output after its synchronous load: the blocks it could not fill come back as
        that output's ``invalid_block_ids``; vLLM recomputes the running request from the first one and
        the worker did not save the chunks from there, so they are saved again once recomputed."""
        bad = [chunk for chunk, blocks in self.sync_pages if invalid and not invalid.isdisjoint(blocks)]
        if bad:
            log.info("kvtier: request %s: its synchronous load came up short; vLLM recomputes from chunk %d",
                     req_id, min(bad))
            self.saved_chunks = min(self.saved_chunks, min(bad))
            self.sync_outputs_left = 1
        self.sync_outputs_left -= 1
        if not self.sync_outputs_left:
            self.sync_pages = ()

    def load_ended(self, ok: bool) -> None:
        """Its asynchronous load reported finished (``ok``: no block failed; else vLLM recomputes
        from the first failed block and those chunks are saved once computed)."""
        if ok:
            self.saved_chunks = max(self.saved_chunks, self.loaded_chunks)
        self.loaded_chunks = 0


def build_receipt(request_id: str, prompt_tokens: int, r: ReceiptFacts, chunk_tokens: int, tp_size: int) -> Receipt:
    """The receipt of a finished request (what each number is: docs/scheduler.md § Receipts).

    Tensor-parallel ranks load and save the same chunks (each its own KV heads): tokens a rank did
    not get are missing for all, so unfilled tokens are the most any rank reports; seconds the most
    (the request waited for the slowest); chunks saved the fewest; the earliest miss wins."""
    ranks = [r.ranks.get(i) or RequestFacts() for i in range(max(tp_size, 1))]
    engine = r.engine or 0
    tiers: dict[str, int] = {}
    for tier, n in r.planned.items():
        got = n - max(f.unfilled.get(tier, 0) for f in ranks)
        if got > 0:
            tiers[tier] = got
    served = engine + sum(tiers.values())
    tokens = {"engine": engine, **tiers, "computed": max(prompt_tokens - served, 0)}
    load_ms = {t: round(1000 * max(f.load_s.get(t, 0.0) for f in ranks), 3)
               for t in dict.fromkeys(t for f in ranks for t in f.load_s)}
    saved = {t: min(f.saved.get(t, 0) for f in ranks) for t in dict.fromkeys(t for f in ranks for t in f.saved)}
    dropped = {k: max(f.dropped.get(k, 0) for f in ranks) for k in dict.fromkeys(k for f in ranks for k in f.dropped)}
    return Receipt(request_id=request_id, prompt_tokens=prompt_tokens, tokens=tokens, load_ms=load_ms,
                   waited_steps=r.waited_steps, miss=_miss(prompt_tokens, served, r, ranks, chunk_tokens),
                   saved=ReceiptSaved({t: n for t, n in saved.items() if n}, dropped), pin=_pin(r, ranks),
                   top_miss=_earliest(f.below for f in ranks))


def receipt_counters(tokens: dict[str, int], reason: str, tier: str) -> dict[str, float]:
    """The payload counters of one receipt: its served tokens by source, its computed tokens under
    its miss's ``reason`` and ``tier`` (``""``: :data:`~kvtier.core.receipt.NO_TIER`, as
    :func:`~kvtier.core.receipt.miss_tier_label` labels it)."""
    out: dict[str, float] = {f"served_tokens_{t}": n for t, n in tokens.items() if t != "computed" and n}
    if tokens.get("computed"):
        out[f"missed_tokens_{reason}|{tier or NO_TIER}"] = tokens["computed"]
    return out


def _earliest(found: Iterable[tuple[int, str, str] | None]) -> ReceiptMiss | None:
    first = min((f for f in found if f is not None), key=lambda f: f[0], default=None)
    return ReceiptMiss(first[0], first[1], first[2]) if first is not None else None  # type: ignore[arg-type]


def _miss(prompt_tokens: int, served: int, r: ReceiptFacts, ranks: list[RequestFacts],
          chunk_tokens: int) -> ReceiptMiss | None:
    """The first token not served and why (``None``: at most the prompt's last token was computed)."""
    if served >= prompt_tokens - 1:
        return None
    if served >= (prompt_tokens - 1) // chunk_tokens * chunk_tokens:
        return ReceiptMiss(served, "partial_chunk")
    short = _earliest(f.miss for f in ranks)
    if short is not None:  # a load came up short: what its read said
        return ReceiptMiss(served, short.reason, short.tier)
    if r.load_failed:
        return ReceiptMiss(served, "load_failed")
    if r.shared_miss is not None:  # the shared tier, which may have held it, was not heard from
        return ReceiptMiss(served, cast(MissReason, r.shared_miss[0]), r.shared_miss[1])
    why = _earliest(f.explained for f in ranks)
    if why is not None:
        return ReceiptMiss(served, why.reason, why.tier)
    return ReceiptMiss(served, "new")


def _pin(r: ReceiptFacts, ranks: list[RequestFacts]) -> ReceiptPin | None:
    if r.pin is None:
        return None
    ttl_s, problem = r.pin
    if ttl_s <= 0:
        return ReceiptPin(False, 0.0, problem or "pins are off (pin_max_share is 0)")
    if any(f.pin_refused for f in ranks):
        return ReceiptPin(False, 0.0, "pin_max_share of the cpu tier was pinned already")
    if not all(f.pinned for f in ranks):
        return ReceiptPin(False, 0.0, "the prompt's chunks were not in the cpu tier when it was saved")
    return ReceiptPin(True, ttl_s, problem or "")


@dataclass(eq=False)
class _Pending:
    request_id: str
    prompt_tokens: int
    facts: ReceiptFacts
    params: dict[str, Any]
    trace_headers: Mapping[str, str] | None


class ReceiptDesk:
    """Receipts of requests vLLM finished, completed once their last step's facts are in (design:
    docs/scheduler.md § Receipts, When).

    Args:
        chunk_tokens: tokens per chunk.
        tp_size: tensor-parallel ranks.
        sinks: where every receipt goes besides the response (the scheduler side's
            ``receipt_sinks``; empty: nowhere).
    """

    def __init__(self, chunk_tokens: int, tp_size: int, sinks: list[ReceiptSink]) -> None:
        self.chunk_tokens = chunk_tokens
        self.tp_size = tp_size
        self.sinks = sinks
        self.pending: dict[str, _Pending] = {}  # finished requests whose receipts wait for their last step's facts
        self._dropped_seen: dict[str, float] = {}

    def finished(self, request: Any, facts: ReceiptFacts) -> dict[str, Any]:
        """``request`` finished: the dict its ``kv_transfer_params["kvtier"]`` will be (filled by :meth:`finish`)."""
        params: dict[str, Any] = {}
        self.pending[request.request_id] = _Pending(request.request_id, int(request.num_prompt_tokens), facts, params,
                                                     getattr(request, "trace_headers", None))
        return params

    def observe(self, req_id: str, rank: int, facts: RequestFacts) -> bool:
        """Fold a rank's late facts into a finished request's receipt; False: not one of them."""
        pending = self.pending.get(req_id)
        if pending is None:
            return False
        pending.facts.observe(rank, facts)
        return True

    def finish(self) -> dict[str, float]:
        """Complete every pending receipt: fill its response dict, emit it to the sinks; returns the
        payload counters of them all (:func:`receipt_counters`)."""
        counters: dict[str, float] = {}
        pending, self.pending = self.pending, {}
        for p in pending.values():
            receipt = build_receipt(p.request_id, p.prompt_tokens, p.facts, self.chunk_tokens, self.tp_size)
            p.params.update(msgspec.to_builtins(receipt))  # Receipt.to_builtins
            miss = receipt.miss if receipt.miss is not None else WHOLLY_SERVED  # Receipt.computed_miss's rule
            for name, n in receipt_counters(receipt.tokens, miss.reason, miss.tier).items():
                counters[name] = counters.get(name, 0) + n
            for sink in self.sinks:
                try:
                    sink.emit(receipt, trace_headers=p.trace_headers)
                except Exception:  # a sink must never stop the engine
                    log.exception("kvtier: a receipt sink failed on request %s's receipt", p.request_id)
        for name, total in (receipt_sink_counters(self.sinks) if self.sinks else {}).items():  # drops: totals -> changes
            if total != self._dropped_seen.get(name, 0.0):
                counters[name] = total - self._dropped_seen.get(name, 0.0)
                self._dropped_seen[name] = total
        return counters
