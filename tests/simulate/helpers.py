"""Small traces for simulator tests, and an independent, plain model of the replay rules."""

from __future__ import annotations

from hypothesis import strategies as st

from kvtier.core.policies import make_policy
from kvtier.simulate.belady import BeladyPolicy, TraceOracle
from kvtier.simulate.replay import OfflinePolicy
from kvtier.simulate.trace import Trace

BLOCK = 4  # tokens per chunk in test traces


def make_trace(requests: list[tuple[list[int], int]]) -> Trace:
    """``[(chunk keys, extra tokens beyond the full chunks), ...]`` → a trace, one request a second."""
    return Trace("test", BLOCK, [float(i) for i in range(len(requests))],
                 [len(keys) * BLOCK + extra for keys, extra in requests], [list(keys) for keys, _ in requests])


def policy_factory(name: str, trace: Trace):
    if name == "belady":
        oracle = TraceOracle(trace)
        return lambda: BeladyPolicy(oracle)
    return lambda: make_policy(name)


@st.composite
def chained_traces(draw, max_requests: int = 30) -> Trace:
    """Random prefix-consistent traces: each request continues a random earlier prompt (a turn of
    a conversation, or a branch of a shared prefix) or starts a new one, then adds new chunks."""
    prompts: list[list[int]] = [[]]
    next_key = 0
    requests = []
    for _ in range(draw(st.integers(1, max_requests))):
        base = draw(st.sampled_from(prompts))
        keep = draw(st.integers(0, len(base)))
        new = draw(st.integers(0 if keep else 1, 4))
        keys = base[:keep] + list(range(next_key, next_key + new))
        next_key += new
        prompts.append(keys)
        requests.append((keys, draw(st.integers(0, BLOCK - 1))))
    return make_trace(requests)


def reference_replay(trace: Trace, cpu_chunks: int, make) -> tuple[int, list[int]]:
    """A deliberately plain model of the replay rules (cpu tier only, no engine, no disk):
    per request, count the longest prefix of lookup-eligible chunks resident in the tier, then
    touch the resident chunks and insert the missing ones in prompt order, evicting after each
    insert.  Returns (hits, eviction order)."""
    policy = make()
    resident: set[int] = set()
    hits, evicted = 0, []
    for r, (keys, tokens) in enumerate(zip(trace.chunk_keys, trace.num_tokens)):
        if isinstance(policy, OfflinePolicy):
            policy.advance(r)
        eligible = keys[:(tokens - 1) // trace.block_tokens]
        for key in eligible:
            if key not in resident:
                break
            hits += 1
        policy.touch([key for key in keys if key in resident])
        for i, key in enumerate(keys):
            if key in resident:
                continue
            resident.add(key)
            policy.insert(key, keys[i - 1] if i else None)
            if len(resident) > cpu_chunks:
                victim = policy.victim()
                policy.remove(victim)
                resident.remove(victim)
                evicted.append(victim)
    return hits, evicted
