"""Synthetic request traces in Mooncake format, one generator per traffic regime (seeded).

Every regime emits Mooncake records (``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids`` with one id per ``block_tokens`` block, the last one possibly partial), built from
*prompts as token counts*: a prompt is a list of segments, and a block's id is fixed by the whole
prefix before it, exactly as chained KV keys are, so equal ids mean equal prefixes::

    turn 1:  [sys 1200 tok][user 300][                ]   ids a b c(partial)
    turn 2:  [sys 1200 tok][user 300][answer 400][u2 ] ids a b d e f(partial)   (c's block grew:
                                                                                  new content)

Regimes (``REGIMES``; parameters are the fields of each ``*Params`` class, documented there and
in docs/simulate.md):

- ``chat``: multi-turn conversations; each turn re-sends the conversation so far; lognormal
  think time between turns; many conversations never return.
- ``agent``: sessions of tool loops behind a long system prompt shared by every session of the
  same agent; short, tool-latency gaps between steps.
- ``rag``: a system prompt, then a retrieved document drawn from a Zipf-popular set, then a
  unique question.
- ``batch``: scan-once jobs (a shared instruction, then a unique document) with a small hot set
  of repeated prompts mixed in (scan resistance).
- ``cycle``: a fixed set of prompts requested round-robin, with a little order jitter: a working
  set that cycles (LRU's worst case whenever the cache is smaller than the set).

All randomness comes from one ``random.Random(seed)``; the same parameters and seed give the same
file.  Prompts are never generated, only their lengths and block identities.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MAX_PROMPT_BLOCKS = 65_536
"""Most blocks in one generated prompt (32 Mi tokens at 512 tokens a block: past every model's context)."""
MAX_REQUESTS = 1_000_000
"""Most requests in one generated trace: a million takes tens of seconds to generate and write and
is past what a simulation needs; a typo such as ``--requests 1000000000000`` would run for hours."""
MAX_TRACE_BLOCKS = 20_000_000
"""Most block ids in one generated trace (about 0.7 GiB of memory while it is built)."""


@dataclass(frozen=True)
class Record:
    """One request: arrival (ms), prompt and completion lengths (tokens), block ids."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class _Blocks:
    """Allocates block ids for prompts given as token counts of shared segments."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._next = 0
        self._ids: dict[tuple[Any, int], int] = {}

    def ids(self, prefix: Any, num_tokens: int) -> tuple[int, ...]:
        """Ids of a prompt of ``num_tokens`` whose content is named by ``prefix`` (a hashable that
        names the content of the *whole* prompt prefix; prompts that extend one another must use
        :meth:`extend`).  Block ``i`` gets an id keyed by ``(prefix, i, filled tokens)``."""
        out = []
        b = self.block_tokens
        _check_prompt_blocks(math.ceil(num_tokens / b), num_tokens, b)
        for i in range(math.ceil(num_tokens / b)):
            filled = min(b, num_tokens - i * b)
            key = (prefix, i * b + filled)
            block = self._ids.get(key)
            if block is None:
                block = self._ids[key] = self._next
                self._next += 1
            out.append(block)
        return tuple(out)


class _Prompt:
    """A prompt that grows (a conversation): full blocks keep their ids, the grown tail gets new
    ones.  ``content`` names the shared part it started from, for sharing across prompts."""

    def __init__(self, blocks: _Blocks, start: tuple[int, ...], start_tokens: int) -> None:
        self._blocks = blocks
        b = blocks.block_tokens
        self.tokens = start_tokens
        self.full = list(start[: start_tokens // b])

    def extend(self, tokens: int) -> tuple[int, ...]:
        """Append ``tokens`` tokens of new content; returns the prompt's ids (last may be partial)."""
        b = self._blocks.block_tokens
        self.tokens += tokens
        _check_prompt_blocks(math.ceil(self.tokens / b), self.tokens, b)
        while len(self.full) < self.tokens // b:
            self.full.append(self._fresh())
        tail = (self._fresh(),) if self.tokens % b else ()
        return tuple(self.full) + tail

    def _fresh(self) -> int:
        blocks = self._blocks
        blocks._next += 1
        return blocks._next - 1


def _check_prompt_blocks(num_blocks: int, num_tokens: int, block_tokens: int) -> None:
    if num_blocks > MAX_PROMPT_BLOCKS:
        raise SynthError(f"a generated prompt reached {num_tokens:,} tokens ({num_blocks:,} blocks of {block_tokens}), "
                         f"over the generator's bound of {MAX_PROMPT_BLOCKS:,} blocks per prompt; lower the *_tokens "
                         "parameters (or mean_turns / mean_steps), or raise --block-tokens")


def _lognormal(rng: random.Random, median: float, sigma: float, low: float = 1.0) -> float:
    return max(low, median * math.exp(sigma * rng.gauss(0.0, 1.0)))


def _zipf_sampler(rng: random.Random, n: int, s: float) -> Any:
    cum = list(itertools.accumulate(1.0 / (rank + 1) ** s for rank in range(n)))
    population = list(range(n))
    return lambda: rng.choices(population, cum_weights=cum)[0]


@dataclass(frozen=True)
class ChatParams:
    """Multi-turn chat.

    Attributes:
        rate_per_s: new conversations per second (Poisson).
        system_prompts: distinct system prompts, chosen Zipf(1) (the first is the most used).
        system_tokens: tokens of each system prompt.
        single_turn_share: share of conversations with one turn only.
        mean_turns: mean turns of the others (geometric, >= 2).
        think_median_s, think_sigma: lognormal think time between turns (seconds; the answer's
            generation time included).
        user_median_tokens, answer_median_tokens: lognormal lengths of a user message and an answer.
    """

    rate_per_s: float = 2.0
    system_prompts: int = 4
    system_tokens: int = 1200
    single_turn_share: float = 0.6
    mean_turns: float = 4.0
    think_median_s: float = 90.0
    think_sigma: float = 1.0
    user_median_tokens: float = 350.0
    answer_median_tokens: float = 400.0


@dataclass(frozen=True)
class AgentParams:
    """Agents in tool loops.

    Attributes:
        rate_per_s: new agent sessions per second (Poisson).
        agents: distinct agents (system prompt + tool definitions), chosen Zipf(1).
        system_tokens: tokens of each agent's system prompt and tool definitions.
        mean_steps: mean tool-loop steps per session (geometric, >= 1).
        tool_median_s, tool_sigma: lognormal gap between steps (tool latency + generation), s.
        task_median_tokens: lognormal length of the task that starts a session.
        step_median_tokens: lognormal tokens appended per step (the action and the tool's output).
    """

    rate_per_s: float = 1.0
    agents: int = 3
    system_tokens: int = 6000
    mean_steps: float = 10.0
    tool_median_s: float = 4.0
    tool_sigma: float = 0.8
    task_median_tokens: float = 300.0
    step_median_tokens: float = 500.0


@dataclass(frozen=True)
class RagParams:
    """Retrieval-augmented generation over a Zipf-popular document set.

    Attributes:
        rate_per_s: requests per second (Poisson).
        documents: size of the document set.
        zipf_s: Zipf exponent of document popularity (1.0: classic; larger: more skewed).
        doc_median_tokens, doc_sigma: lognormal document length.
        system_tokens: tokens of the one system prompt before the document.
        question_median_tokens: lognormal length of the (unique) question after the document.
    """

    rate_per_s: float = 5.0
    documents: int = 3000
    zipf_s: float = 0.9
    doc_median_tokens: float = 2000.0
    doc_sigma: float = 0.6
    system_tokens: int = 400
    question_median_tokens: float = 80.0


@dataclass(frozen=True)
class BatchParams:
    """Scan-once batch jobs with a hot set mixed in.

    Attributes:
        rate_per_s: requests per second (Poisson).
        templates: distinct instruction templates (shared prefixes of the scan).
        template_tokens: tokens of each template.
        doc_median_tokens: lognormal length of each scanned (unique) document.
        hot_share: share of requests drawn from the hot set instead of the scan.
        hot_prompts: prompts in the hot set (chosen uniformly), each ``hot_median_tokens`` long.
        hot_median_tokens: lognormal length of a hot prompt.
    """

    rate_per_s: float = 10.0
    templates: int = 3
    template_tokens: int = 600
    doc_median_tokens: float = 2500.0
    hot_share: float = 0.3
    hot_prompts: int = 200
    hot_median_tokens: float = 2000.0


@dataclass(frozen=True)
class CycleParams:
    """A working set requested round-robin.

    Attributes:
        rate_per_s: requests per second (evenly spaced).
        prompts: prompts in the working set.
        prompt_tokens: tokens of each prompt (all distinct after a shared system prompt).
        system_tokens: tokens of the system prompt every prompt starts with.
        jitter: each cycle's order is the previous one with this share of neighbours swapped.
    """

    rate_per_s: float = 5.0
    prompts: int = 300
    prompt_tokens: int = 4000
    system_tokens: int = 512
    jitter: float = 0.1


REGIMES: dict[str, type] = {"chat": ChatParams, "agent": AgentParams, "rag": RagParams,
                            "batch": BatchParams, "cycle": CycleParams}


class SynthError(ValueError):
    """Bad generator parameters; the message names the parameter and the fix."""


def make_params(regime: str, overrides: dict[str, str]) -> Any:
    """The parameter object of ``regime`` with ``overrides`` (strings, converted to the field type).

    Raises:
        SynthError: unknown regime or parameter, unparsable or out-of-range value.
    """
    cls = REGIMES.get(regime)
    if cls is None:
        raise SynthError(f"unknown regime {regime!r}; choose one of {', '.join(REGIMES)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for name, text in overrides.items():
        if name not in fields:
            raise SynthError(f"regime {regime} has no parameter {name!r}; its parameters are {', '.join(fields)}")
        kind: Any = type(fields[name].default)
        try:
            values[name] = kind(text)
        except ValueError:
            raise SynthError(f"parameter {name} of regime {regime} must be {kind.__name__}, got {text!r}") from None
    params = cls(**values)
    for name in fields:
        value = getattr(params, name)
        high = _maximum(name)
        most = f"{int(high):,}" if float(high).is_integer() else f"{high:g}"
        if name.endswith("share") or name == "jitter":
            ok, rule = 0 <= value <= 1, "between 0 and 1"
        elif name == "mean_turns":
            ok, rule = 2 <= value <= high, f"at least 2 and at most {most}"
        elif name == "rate_per_s":  # a mean gap past the longest think time wrote timestamps of 300 digits
            ok, rule = MIN_RATE_PER_S <= value <= high, f"at least {MIN_RATE_PER_S:.2g} (one per 30 days) and at most {most}"
        else:
            ok, rule = 0 < value <= high, f"positive and at most {most}"
        if not ok:  # NaN fails every comparison, infinity the upper bound
            raise SynthError(f"parameter {name} of regime {regime} must be {rule}, got {value}")
    return params


MIN_RATE_PER_S = 1 / (30 * 86_400.0)
"""Slowest arrival rate a regime accepts, per second: one per 30 days, the bound of think and tool times."""


def _maximum(name: str) -> float:
    """Largest accepted value of parameter ``name``: far past any real traffic, small enough that a
    typo cannot make the generator run for hours or fill the memory."""
    if name.endswith("_tokens"):
        return 1_000_000
    if name.endswith("sigma"):
        return 4.0
    if name == "zipf_s":
        return 10.0
    if name == "rate_per_s":
        return 100_000.0
    if name.endswith("_s"):  # think and tool times
        return 30 * 86_400.0
    if name in ("mean_turns", "mean_steps"):
        return 1_000.0
    return 1_000_000  # counts: system prompts, agents, documents, templates, hot prompts, prompts


def generate(regime: str, params: Any, num_requests: int, seed: int, block_tokens: int = 512) -> list[Record]:
    """``num_requests`` records of ``regime`` in arrival order (see the module docstring).

    Raises:
        SynthError: ``num_requests`` not from 1 to :data:`MAX_REQUESTS`, ``block_tokens`` not
            from 1 to :data:`~kvtier.core.config.MAX_CHUNK_TOKENS`, unknown regime.
    """
    from kvtier.core.config import MAX_CHUNK_TOKENS

    if num_requests <= 0 or block_tokens <= 0:
        raise SynthError(f"--requests ({num_requests}) and --block-tokens ({block_tokens}) must be positive")
    if num_requests > MAX_REQUESTS:
        raise SynthError(f"--requests {num_requests:,} is more than the {MAX_REQUESTS:,} one trace holds (a million "
                         "takes tens of seconds to generate; more would run for hours); lower --requests")
    if block_tokens > MAX_CHUNK_TOKENS:
        raise SynthError(f"--block-tokens {block_tokens:,} is more than {MAX_CHUNK_TOKENS:,}, longer than any "
                         "model's context, so no prompt would fill a block; use Mooncake's 512 or kvtier's "
                         "chunk_tokens")
    if regime not in REGIMES:
        raise SynthError(f"unknown regime {regime!r}; choose one of {', '.join(REGIMES)}")
    rng = random.Random(f"kvtier-synth/{regime}/{seed}")
    blocks = _Blocks(block_tokens)
    stream: Any = {"chat": _chat, "agent": _agent, "rag": _rag, "batch": _batch, "cycle": _cycle}[regime]
    out = []
    num_ids = 0
    for record in stream(params, rng, blocks):
        out.append(record)
        num_ids += len(record.hash_ids)
        if num_ids > MAX_TRACE_BLOCKS:
            raise SynthError(f"the trace would hold more than {MAX_TRACE_BLOCKS:,} block ids after {len(out):,} of "
                             f"{num_requests:,} requests; lower --requests or the *_tokens parameters, or raise "
                             "--block-tokens")
        if len(out) == num_requests:
            break
    return out


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


def _chat(p: ChatParams, rng: random.Random, blocks: _Blocks) -> Iterator[Record]:
    pick_system = _zipf_sampler(rng, p.system_prompts, 1.0)

    def conversation() -> Iterator[tuple[tuple[tuple[int, ...], int, int], float]]:
        system = pick_system()
        turns = 1 if rng.random() < p.single_turn_share else 2 + int(rng.expovariate(1 / (p.mean_turns - 2 + 1e-9)))
        prompt = _Prompt(blocks, blocks.ids(("system", system), p.system_tokens), p.system_tokens)
        answer = 0
        for _ in range(turns):
            ids = prompt.extend(answer + int(_lognormal(rng, p.user_median_tokens, 0.8)))
            answer = int(_lognormal(rng, p.answer_median_tokens, 0.7))
            yield (ids, prompt.tokens, answer), _lognormal(rng, p.think_median_s, p.think_sigma)

    for when, (ids, tokens, output) in _sessions(p.rate_per_s, rng, conversation):
        yield _record(when, ids, tokens, output)


def _agent(p: AgentParams, rng: random.Random, blocks: _Blocks) -> Iterator[Record]:
    pick_agent = _zipf_sampler(rng, p.agents, 1.0)

    def session() -> Iterator[tuple[tuple[tuple[int, ...], int, int], float]]:
        agent = pick_agent()
        steps = 1 + int(rng.expovariate(1 / max(p.mean_steps - 1, 1e-9)))
        prompt = _Prompt(blocks, blocks.ids(("agent", agent), p.system_tokens), p.system_tokens)
        grow = int(_lognormal(rng, p.task_median_tokens, 0.8))
        for _ in range(steps):
            ids = prompt.extend(grow)
            action = int(_lognormal(rng, 120, 0.5))
            grow = action + int(_lognormal(rng, p.step_median_tokens, 0.9))
            yield (ids, prompt.tokens, action), _lognormal(rng, p.tool_median_s, p.tool_sigma)

    for when, (ids, tokens, output) in _sessions(p.rate_per_s, rng, session):
        yield _record(when, ids, tokens, output)


def _rag(p: RagParams, rng: random.Random, blocks: _Blocks) -> Iterator[Record]:
    pick_doc = _zipf_sampler(rng, p.documents, p.zipf_s)
    doc_tokens = [int(_lognormal(rng, p.doc_median_tokens, p.doc_sigma, 64)) for _ in range(p.documents)]
    now = 0.0
    while True:
        now += rng.expovariate(p.rate_per_s)
        doc = pick_doc()
        shared = p.system_tokens + doc_tokens[doc]
        prompt = _Prompt(blocks, blocks.ids(("rag-doc", doc), shared), shared)
        ids = prompt.extend(int(_lognormal(rng, p.question_median_tokens, 0.6)))
        yield _record(now, ids, prompt.tokens, int(_lognormal(rng, 200, 0.6)))


def _batch(p: BatchParams, rng: random.Random, blocks: _Blocks) -> Iterator[Record]:
    hot = [int(_lognormal(rng, p.hot_median_tokens, 0.5, 64)) for _ in range(p.hot_prompts)]
    now = 0.0
    while True:
        now += rng.expovariate(p.rate_per_s)
        if rng.random() < p.hot_share:
            h = rng.randrange(p.hot_prompts)
            prompt = _Prompt(blocks, blocks.ids(("hot", h), hot[h]), hot[h])
            ids = prompt.extend(1)
        else:
            template = rng.randrange(p.templates)
            prompt = _Prompt(blocks, blocks.ids(("template", template), p.template_tokens), p.template_tokens)
            ids = prompt.extend(int(_lognormal(rng, p.doc_median_tokens, 0.5)))
        yield _record(now, ids, prompt.tokens, int(_lognormal(rng, 150, 0.5)))


def _cycle(p: CycleParams, rng: random.Random, blocks: _Blocks) -> Iterator[Record]:
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
