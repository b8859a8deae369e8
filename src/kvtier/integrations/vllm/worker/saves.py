"""Saves: after the forward pass, on the engine's thread, each save job's pages not stored yet are
copied out of the engine's blocks into cpu pages and published (a bounded memcpy); disk and shared
writes then happen on the store's threads through its bounded queue (full: dropped and counted).
The copy is done when :func:`save_jobs` returns, so no save outlives the blocks it reads and vLLM
may free them at once.  The store's two-phase contract: ``prepare_store`` reserves, the copy runs,
``complete_store`` runs on every path.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

from kvtier.core.context import EngineSave, OpContext
from kvtier.core.keys import ChunkKey
from kvtier.core.sinks import RequestRecord
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.protocol import SaveJob
from kvtier.integrations.vllm.worker.copy import GroupCopiers
from kvtier.integrations.vllm.worker.facts import FactsBook, save_facts

log = logging.getLogger(__name__)


def save_jobs(store: TieredStore, copiers: GroupCopiers, jobs: Sequence[SaveJob], sync_cut: Mapping[str, int],
              token_group: int, chunk_tokens: int, facts: FactsBook | None = None) -> None:
    """Run this step's save jobs.  Never raises: a failed save is a future miss, never an engine failure.

    Args:
        sync_cut: this step's synchronous loads that came up short, request → first chunk not
            filled: that request's pages from there on hold KV computed over unfilled blocks (wrong),
            and are not saved.
        token_group: the KV cache group whose pages count saved tokens (the first full-attention
            group; -1: none counted).
        facts: where each job's facts go, for its request's receipt (:mod:`.facts`); ``None``: nowhere.
    """
    for job in jobs:
        cut = sync_cut.get(job.req_id)
        if cut is not None:
            job = dataclasses.replace(job, pages=tuple(p for p in job.pages if p.chunk < cut))
            if not job.pages:
                continue
        record = RequestRecord(chunk_tokens)
        try:
            _save_one(store, copiers, job, token_group, chunk_tokens, record)
        except Exception:  # a failed save is a future miss, never an engine failure
            log.exception("kvtier: saving request %s's chunks failed", job.req_id)
        if facts is not None:
            facts.add(job.req_id, save_facts(record, store.cpu.name, chunk_tokens, job.explain_chunk * chunk_tokens))


def _save_one(store: TieredStore, copiers: GroupCopiers, job: SaveJob, token_group: int, chunk_tokens: int,
              record: RequestRecord) -> None:
    """Copy the job's pages not stored yet out of the engine; the store counts what was saved
    (and tells ``record``, with why the page of ``job.explain_chunk`` was in no tier).  Then pin
    the prompt's pages the job names when the request asked for a TTL pin."""
    chain = [ChunkKey(job.parent)] if job.parent else []
    chain += [ChunkKey(p.key) for p in job.pages]
    first = len(chain) - len(job.pages)  # the parent only names the first page's parent
    t0 = time.perf_counter()
    ctx = OpContext(job.req_id, job.tenant, record)  # the request's context: its id and tenant, explicitly
    explain = next((first + i for i, p in enumerate(job.pages) if p.chunk == job.explain_chunk), -1) \
        if job.explain_chunk >= 0 else -1
    handle = store.prepare_store(chain, start=first, ctx=ctx, explain=explain)
    if handle.num_chunks:
        stored = [job.pages[i - first] for i in handle.indices]
        ok = False
        try:
            copiers.save(list(zip(stored, handle.buffers)))
            ok = True
        finally:
            # tokens: those of the full-attention chunks stored (one group's pages count each chunk once)
            tokens = sum(1 for p in stored if p.group == token_group) * chunk_tokens
            store.complete_store(handle, ok, EngineSave(tokens, copiers.moved_bytes(stored),
                                                        time.perf_counter() - t0))
    if job.pin_s > 0:
        store.ttl_pin([ChunkKey(p.key) for p in job.pages if p.chunk < job.pin_chunks], job.pin_s, ctx)
