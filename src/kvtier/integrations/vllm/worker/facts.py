"""What a rank learns of each request's cache use, for the request's receipt (issue 35).

A load's and a save's events reach a :class:`~kvtier.core.sinks.RequestRecord` (the operation's
context sink, :mod:`kvtier.core.context`); when the operation ends, :func:`load_facts` /
:func:`save_facts` turn the record into a :class:`~kvtier.integrations.vllm.protocol.RequestFacts`
and :class:`FactsBook` keeps it until the step's worker metadata carries it to the scheduler
(vLLM's ``build_connector_worker_meta``, the one worker → scheduler channel, merged across
tensor-parallel ranks by ``KVTierWorkerMeta.aggregate``).  One record per load and per save job,
built once when it ends: no per-chunk work.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvtier.core.context import EngineLoad
from kvtier.core.sinks import RequestRecord
from kvtier.integrations.vllm.protocol import LoadJob, PageMove, RequestFacts


class FactsBook:
    """Facts of this rank's requests since the last :meth:`take` (thread-safe: loads end on loader threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._facts: dict[str, RequestFacts] = {}

    def add(self, req_id: str, facts: RequestFacts) -> None:
        with self._lock:
            mine = self._facts.get(req_id)
            if mine is None:
                self._facts[req_id] = facts
            else:
                mine.merge(facts)

    def take(self) -> dict[str, RequestFacts]:
        with self._lock:
            out, self._facts = self._facts, {}
        return out


def _token(pages: Sequence[PageMove], index: int, chunk_tokens: int) -> int:
    """The first token of page ``index``'s chunk (past the end: the last page's end)."""
    if index < len(pages):
        return pages[index].chunk * chunk_tokens
    return (pages[-1].chunk + 1) * chunk_tokens if pages else 0


def load_facts(job: LoadJob, record: RequestRecord, engine: EngineLoad, top: str, chunk_tokens: int,
               budget_cut: int | None) -> RequestFacts:
    """One load's facts: unfilled tokens by planned tier, seconds by tier, the first token it came
    up short at and why, the first token read from below the top tier and why.

    ``budget_cut``: the page at which the copy stopped waiting (``load_wait_s`` passed), else
    ``None``; a cut there is ``budget`` unless a read failed earlier.  The load's wall time
    (``engine.seconds``) is split: each lower tier gets its reads' seconds, the rest goes to the
    tiers in proportion to the tokens each delivered."""
    delivered = {t: n for t, n in engine.tokens.items() if n}
    read_s = {t: s for t, s in record.read_seconds.items() if t in delivered or t in engine.unfilled_tokens}
    rest = max(engine.seconds - sum(read_s.values()), 0.0)
    total = sum(delivered.values())
    load_s = dict(read_s)
    for tier, n in delivered.items():
        load_s[tier] = load_s.get(tier, 0.0) + (rest * n / total if total else 0.0)
    miss = None
    if any(engine.unfilled_tokens.values()):
        m = record.miss
        if m is not None and (budget_cut is None or m.index <= budget_cut):
            miss = (_token(job.pages, m.index, chunk_tokens), m.reason, m.tier)
        elif budget_cut is not None:
            miss = (_token(job.pages, budget_cut, chunk_tokens), "budget", "")
        else:
            miss = (max(job.first_token, _token(job.pages, 0, chunk_tokens)), "load_failed", "")
    below = record.below
    return RequestFacts(unfilled={t: n for t, n in engine.unfilled_tokens.items() if n}, load_s=load_s, miss=miss,
                        below=(_token(job.pages, below.index, chunk_tokens), below.reason, top)
                        if below is not None else None)


def save_facts(record: RequestRecord, top: str, chunk_tokens: int, explain_token: int) -> RequestFacts:
    """One save job's facts: chunks stored in the top tier, chunks dropped and why, the TTL pin,
    and why the chunk it was asked about was in no tier (at token ``explain_token``)."""
    dropped: dict[str, int] = {}
    if record.dropped_chunks:
        dropped["save_dropped"] = record.dropped_chunks
    for n in record.unwritten_chunks.values():
        dropped["save_dropped"] = dropped.get("save_dropped", 0) + n
    e = record.explained
    return RequestFacts(saved={top: record.saved_tokens // chunk_tokens} if record.saved_tokens else {},
                        dropped=dropped, pinned=record.ttl_pinned, pin_refused=record.ttl_refused,
                        explained=(explain_token, e.reason, e.tier) if e is not None else None)
