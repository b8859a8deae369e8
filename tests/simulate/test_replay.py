"""The replay engine: a hand-computed LRU trace, the prefix constraint, the engine and disk tiers."""

from typing import ClassVar

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.policies import available_policies
from kvtier.core.policies.lru import LRUPolicy
from kvtier.simulate.replay import engine_prefix_hits, lookup_limits, replay
from tests.simulate.helpers import BLOCK, chained_traces, make_trace, policy_factory, reference_replay


class RecordingLRU(LRUPolicy):
    """The real prompt-order LRU, noting what its owner evicts."""

    evicted: ClassVar[list[int]] = []

    def remove(self, key):
        RecordingLRU.evicted.append(key)
        super().remove(key)


def test_lru_hand_computed():
    # cpu tier of 3 chunks, prompt-order LRU, no engine tier.  Oldest first:
    #   r0 [1,2]    lookup 1 miss             store 1,2        order 1 2
    #   r1 [1,3]    lookup 1 hit, 3 miss      touch 1; store 3 order 2 1 3
    #   r2 [1,2,4]  lookup 1 2 hit, 4 miss    touch 1 2; store 4, evict 3       -> 1 2 4
    #   r3 [5,6]    lookup 5 miss             store 5 evict 1; store 6 evict 2  -> 4 5 6
    #   r4 [1,2]    lookup 1 miss             store 1 evict 4; store 2 evict 5  -> 6 1 2
    trace = make_trace([([1, 2], 1), ([1, 3], 1), ([1, 2, 4], 1), ([5, 6], 1), ([1, 2], 1)])
    RecordingLRU.evicted = []
    counts = replay(trace, [0] * 5, 3, 0, RecordingLRU)
    assert counts.cpu_hits == 3 and counts.engine_hits == 0 and counts.disk_hits == 0
    assert RecordingLRU.evicted == [3, 1, 2, 4, 5]
    assert (counts.cpu_stores, counts.cpu_evictions) == (8, 5)
    assert counts.lookup_chunks == 11 and counts.prompt_tokens == 49


def test_no_hit_for_a_chunk_whose_prefix_missed():
    # After r1, chunk 1 is evicted but chunk 2 stays: r2 finds 2 resident yet must count nothing.
    trace = make_trace([([1, 2], 1), ([3], 1), ([1, 2], 1)])
    RecordingLRU.evicted = []
    counts = replay(trace, [0] * 3, 2, 0, RecordingLRU)
    assert RecordingLRU.evicted[0] == 1
    assert counts.cpu_hits == 0


def test_last_token_rule_and_engine_prefix():
    # A prompt of exactly 2 chunks may hit only its first one (the engine recomputes the last token).
    trace = make_trace([([1, 2], 0), ([1, 2], 0), ([1, 2], 1)])
    assert lookup_limits(trace) == [1, 1, 2]
    assert engine_prefix_hits(trace, 10) == [0, 1, 2]
    # An engine tier of 1 chunk keeps the head: vLLM frees a finished request's blocks tail first.
    assert engine_prefix_hits(trace, 1) == [0, 1, 1]
    counts = replay(trace, engine_prefix_hits(trace, 10), 0, 0, policy_factory("lru", trace))
    assert counts.engine_hits == 3 and counts.cpu_hits == 0


def test_engine_tier_keeps_shared_head_tail_first():
    # Engine of 2 chunks: r0 [1,2,3] is held whole while it runs, then its tail (3) goes first.
    trace = make_trace([([1, 2, 3], 1), ([1, 4], 1)])
    assert engine_prefix_hits(trace, 2) == [0, 1]


def test_cpu_evictions_spill_to_disk_and_disk_hits_count():
    # cpu 1 chunk, disk 4 chunks: chunk 1 spills to disk when 2 arrives, then r1 reads it back.
    trace = make_trace([([1, 2], 1), ([1, 3], 1)])
    counts = replay(trace, [0, 0], 1, 4, policy_factory("lru", trace))
    assert counts.disk_stores >= 1 and counts.disk_hits == 1 and counts.cpu_hits == 0


@settings(max_examples=60, deadline=None)
@given(trace=chained_traces(), cpu=st.integers(0, 6), name=st.sampled_from(available_policies() + ["belady"]))
def test_replay_matches_plain_reference_model(trace, cpu, name):
    """The optimised loop counts exactly what a plain reading of the rules counts, for every
    policy: in particular no chunk after a missed one is ever counted."""
    counts = replay(trace, [0] * trace.num_requests, cpu, 0, policy_factory(name, trace))
    hits, _ = reference_replay(trace, cpu, policy_factory(name, trace))
    assert counts.cpu_hits == hits
    assert counts.cpu_hits <= counts.lookup_chunks


@settings(max_examples=40, deadline=None)
@given(trace=chained_traces(), cpu=st.integers(0, 5), disk=st.integers(0, 5), engine=st.integers(0, 5))
def test_tiers_only_add_hits(trace, cpu, disk, engine):
    engine_hits = engine_prefix_hits(trace, engine)
    alone = replay(trace, engine_hits, 0, 0, policy_factory("lru", trace))
    tiered = replay(trace, engine_hits, cpu, disk, policy_factory("lru", trace))
    assert alone.engine_hits == tiered.engine_hits == sum(engine_hits)
    assert tiered.engine_hits + tiered.cpu_hits + tiered.disk_hits <= tiered.lookup_chunks
    assert tiered.cpu_stores - tiered.cpu_evictions <= cpu
    assert tiered.disk_stores - tiered.disk_evictions <= disk
    assert tiered.prompt_tokens == sum(trace.num_tokens) and BLOCK == trace.block_tokens
