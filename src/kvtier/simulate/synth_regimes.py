"""The request streams of the synthetic traffic regimes (:mod:`kvtier.simulate.synth`), one
endless generator of :class:`~kvtier.simulate.synth_blocks.Record` per regime in arrival order
(:data:`STREAMS`), all randomness drawn from the one ``random.Random`` they are given."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

from kvtier.simulate.synth_blocks import Blocks, Prompt, Record
from kvtier.simulate.synth_params import AgentParams, BatchParams, ChatParams, CycleParams, RagParams


def _lognormal(rng: random.Random, median: float, sigma: float, low: float = 1.0) -> float:
    return max(low, median * math.exp(sigma * rng.gauss(0.0, 1.0)))


def _zipf_sampler(rng: random.Random, n: int, s: float) -> Any:
    cum = list(itertools.accumulate(1.0 / (rank + 1) ** s for rank in range(n)))
    population = list(range(n))
    return lambda: rng.choices(population, cum_weights=cum)[0]


def _sessions(rate_per_s: float, rng: random.Random, start: Any) -> Iterator[tuple[float, Any]]:
    """Merge sessions (generators of (delay_s, record_fn)) arriving as a Poisson process into one
    stream of (time_s, item), in time order."""
    heap: list[tuple[float, int, Any]] = []
    seq = 0
    next_arrival = 0.0
    while True:
        while not heap or next_arrival <= heap[0][0]:
            session = start()
            heapq.heappush(heap, (next_arrival, seq, session))
            seq += 1
            next_arrival += rng.expovariate(rate_per_s)
        when, _, session = heapq.heappop(heap)
        try:
            item, delay_s = next(session)
        except StopIteration:
            continue
        yield when, item
        heapq.heappush(heap, (when + delay_s, seq, session))
        seq += 1


def _record(time_s: float, ids: tuple[int, ...], tokens: int, output: int) -> Record:
    return Record(int(time_s * 1000), tokens, output, ids)


def _chat(p: ChatParams, rng: random.Random, blocks: Blocks) -> Iterator[Record]:
    pick_system = _zipf_sampler(rng, p.system_prompts, 1.0)

    def conversation() -> Iterator[tuple[tuple[tuple[int, ...], int, int], float]]:
        system = pick_system()
        turns = 1 if rng.random() < p.single_turn_share else 2 + int(rng.expovariate(1 / (p.mean_turns - 2 + 1e-9)))
        prompt = Prompt(blocks, blocks.ids(("system", system), p.system_tokens), p.system_tokens)
        answer = 0
        for _ in range(turns):
            ids = prompt.extend(answer + int(_lognormal(rng, p.user_median_tokens, 0.8)))
            answer = int(_lognormal(rng, p.answer_median_tokens, 0.7))
            yield (ids, prompt.tokens, answer), _lognormal(rng, p.think_median_s, p.think_sigma)

    for when, (ids, tokens, output) in _sessions(p.rate_per_s, rng, conversation):
        yield _record(when, ids, tokens, output)


def _agent(p: AgentParams, rng: random.Random, blocks: Blocks) -> Iterator[Record]:
    pick_agent = _zipf_sampler(rng, p.agents, 1.0)

    def session() -> Iterator[tuple[tuple[tuple[int, ...], int, int], float]]:
        agent = pick_agent()
        steps = 1 + int(rng.expovariate(1 / max(p.mean_steps - 1, 1e-9)))
        prompt = Prompt(blocks, blocks.ids(("agent", agent), p.system_tokens), p.system_tokens)
        grow = int(_lognormal(rng, p.task_median_tokens, 0.8))
        for _ in range(steps):
            ids = prompt.extend(grow)
            action = int(_lognormal(rng, 120, 0.5))
            grow = action + int(_lognormal(rng, p.step_median_tokens, 0.9))
            yield (ids, prompt.tokens, action), _lognormal(rng, p.tool_median_s, p.tool_sigma)

    for when, (ids, tokens, output) in _sessions(p.rate_per_s, rng, session):
        yield _record(when, ids, tokens, output)


def _rag(p: RagParams, rng: random.Random, blocks: Blocks) -> Iterator[Record]:
    pick_doc = _zipf_sampler(rng, p.documents, p.zipf_s)
    doc_tokens = [int(_lognormal(rng, p.doc_median_tokens, p.doc_sigma, 64)) for _ in range(p.documents)]
    now = 0.0
    while True:
        now += rng.expovariate(p.rate_per_s)
        doc = pick_doc()
        shared = p.system_tokens + doc_tokens[doc]
        prompt = Prompt(blocks, blocks.ids(("rag-doc", doc), shared), shared)
        ids = prompt.extend(int(_lognormal(rng, p.question_median_tokens, 0.6)))
        yield _record(now, ids, prompt.tokens, int(_lognormal(rng, 200, 0.6)))


def _batch(p: BatchParams, rng: random.Random, blocks: Blocks) -> Iterator[Record]:
    hot = [int(_lognormal(rng, p.hot_median_tokens, 0.5, 64)) for _ in range(p.hot_prompts)]
    now = 0.0
    while True:
        now += rng.expovariate(p.rate_per_s)
        if rng.random() < p.hot_share:
            h = rng.randrange(p.hot_prompts)
            prompt = Prompt(blocks, blocks.ids(("hot", h), hot[h]), hot[h])
            ids = prompt.extend(1)
        else:
            template = rng.randrange(p.templates)
            prompt = Prompt(blocks, blocks.ids(("template", template), p.template_tokens), p.template_tokens)
            ids = prompt.extend(int(_lognormal(rng, p.doc_median_tokens, 0.5)))
        yield _record(now, ids, prompt.tokens, int(_lognormal(rng, 150, 0.5)))


def _cycle(p: CycleParams, rng: random.Random, blocks: Blocks) -> Iterator[Record]:
    tokens = p.system_tokens + p.prompt_tokens
    prompts = [blocks.ids(("cycle", i, p.system_tokens), tokens) for i in range(p.prompts)]
    # Shared system prompt: every prompt's leading blocks are the same ids.
    system = blocks.ids(("cycle-system",), p.system_tokens)
    head = p.system_tokens // blocks.block_tokens
    prompts = [system[:head] + ids[head:] for ids in prompts]
    order = list(range(p.prompts))
    now = 0.0
    while True:
        for i in range(len(order) - 1):
            if rng.random() < p.jitter:
                order[i], order[i + 1] = order[i + 1], order[i]
        for i in order:
            yield _record(now, prompts[i], tokens, 100)
            now += 1.0 / p.rate_per_s


STREAMS: dict[str, Callable[[Any, random.Random, Blocks], Iterator[Record]]] = {
    "chat": _chat, "agent": _agent, "rag": _rag, "batch": _batch, "cycle": _cycle}
"""Regime name -> its stream of records, given the regime's parameters, the random source and the block ids."""
