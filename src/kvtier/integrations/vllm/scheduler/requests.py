"""One request's path through the scheduler side, from admission to ``request_finished``: its
state (:class:`RequestState`), its chunk keys (:class:`RequestChain`, found again in a
:class:`KeyMemo`) and the pin TTL it asks for (:func:`pin_seconds`).  What the scheduler keeps
across requests and steps (the mirror, the pages planned from it, the budgets) is
:mod:`~kvtier.integrations.vllm.scheduler.steps`'; the request's receipt,
:mod:`~kvtier.integrations.vllm.scheduler.receipts`'.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import islice
from typing import Any

from kvtier.core.keys import chunk_keys, request_root
from kvtier.core.tenant import TenantId
from kvtier.integrations.vllm.scheduler.receipts import ReceiptFacts

log = logging.getLogger(__name__)

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


KEY_MEMO_CHUNKS = 1 << 16
"""Chunk keys a :class:`KeyMemo` keeps (about 200 bytes each: ~13 MiB; past it the older half goes)."""

MEMO_HASH_ALGOS = frozenset({"sha256", "sha256_cbor"})
"""vLLM's ``prefix_caching_hash_algo`` values whose block hashes a :class:`KeyMemo` trusts: the
collision-resistant ones (vllm/config/cache.py warns that ``xxhash`` is not; with it, every key is hashed)."""


class KeyMemo:
    """Chunk keys already computed, found again by vLLM's block hash of the prefix each one ends.

    vLLM hashes every request's full blocks once, when the request is created
    (``Request.block_hashes``, vllm/v1/core/kv_cache_utils.py ``get_request_block_hasher``: each
    hash chains the whole prefix's token ids and the block's extra keys); its native offload keys
    its chunks by those hashes (vllm/v1/kv_offload).  kvtier's keys are its own (BLAKE3 over the
    token ids, :func:`~kvtier.core.keys.chunk_keys`, pinned by tests/core/test_format_vectors.py),
    so a new request with a prefix seen before would hash every chunk again (~2-4 µs a chunk on the
    lookup's path); the memo gives back the key computed for the same prefix instead: the entry of
    vLLM's hash at the chunk's last block, taken only when its root (namespace, ``cache_salt``,
    LoRA adapter, multimodal inputs: :func:`~kvtier.core.keys.request_root`) is the request's.
    Equal SHA-256 block hashes mean equal token prefixes, so the key is the one BLAKE3 would give:
    keys never change, only how often they are computed.

    Args:
        hash_block_size: tokens per vLLM block hash (``KVCacheConfig.hash_block_size``); ``None``
            or not dividing ``chunk_tokens``: the memo is off (:attr:`step` 0).
        chunk_tokens: tokens per chunk.
        hash_algo: vLLM's ``prefix_caching_hash_algo``; off unless one of :data:`MEMO_HASH_ALGOS`.
        limit: keys kept at most (:data:`KEY_MEMO_CHUNKS`).
    """

    def __init__(self, hash_block_size: int | None, chunk_tokens: int, hash_algo: str | None,
                 limit: int = KEY_MEMO_CHUNKS) -> None:
        usable = (hash_algo in MEMO_HASH_ALGOS and isinstance(hash_block_size, int) and hash_block_size > 0
                  and chunk_tokens % hash_block_size == 0)
        self.step = chunk_tokens // hash_block_size if usable and hash_block_size else 0
        self.limit = limit
        self._keys: dict[Any, tuple[bytes, bytes]] = {}  # vLLM block hash -> (root, chunk key)

    @classmethod
    def of_engine(cls, vllm_config: Any, kv_cache_config: Any, chunk_tokens: int) -> KeyMemo:
        """The memo of an engine: vLLM's ``KVCacheConfig.hash_block_size`` (set by the engine core
        before the scheduler is built) and ``CacheConfig.prefix_caching_hash_algo``."""
        return cls(getattr(kv_cache_config, "hash_block_size", None), chunk_tokens,
                   getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None))

    def known(self, root: bytes, block_hashes: Sequence[Any], start: int, end: int) -> list[bytes]:
        """Keys of chunks ``start ..`` up to ``end`` (exclusive) the memo holds for ``root``, up to the first it lacks."""
        step, out = self.step, []
        stop = min(end, len(block_hashes) // step if step else 0)  # each chunk's last block's hash, looked up in C
        for entry in map(self._keys.get, block_hashes[(start + 1) * step - 1:stop * step:step]) if stop > start else ():
            if entry is None or entry[0] != root:
                break
            out.append(entry[1])
        return out

    def add(self, root: bytes, block_hashes: Sequence[Any], start: int, keys: Sequence[bytes]) -> None:
        """Remember ``keys`` (of chunks ``start ..``) under ``root``, for the chunks vLLM has hashed."""
        if not self.step:
            return
        step, memo = self.step, self._keys
        for c, key in enumerate(keys, start):
            if (c + 1) * step > len(block_hashes):
                break
            memo[block_hashes[(c + 1) * step - 1]] = (root, key)
        if len(memo) > self.limit:  # the newer half stays (a dict keeps insertion order)
            self._keys = dict(islice(memo.items(), len(memo) - self.limit // 2, None))

    def __len__(self) -> int:
        return len(self._keys)


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
        lora_id = f"{lora.lora_name}@{lora.lora_path}" if lora is not None else None
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
        fill moves the watermark back: :meth:`check_sync_load`); an asynchronous one once it
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
