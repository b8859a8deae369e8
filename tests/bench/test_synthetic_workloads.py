"""prefix-repetition and multi-round: sharing structure and determinism."""

import itertools
import re

import pytest

from kvtier.bench.factory import WorkloadKnobs, build_workload, check_knobs
from kvtier.bench.multi_round import multi_round_workload
from kvtier.bench.prefix_repetition import prefix_repetition_workload
from kvtier.bench.workload import TokenSpace, WorkloadError

TOKENS = TokenSpace(seed=5, low=100, high=32000)


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_prefix_repetition_cycles_prefixes_with_fresh_suffixes():
    w = prefix_repetition_workload(TOKENS, num_requests=12, prefix_len=100, suffix_len=30, num_prefixes=4,
                                   output_len=5)
    prompts = [r.prompt_token_ids for r in w.requests]
    assert all(len(p) == 130 for p in prompts)
    for i in range(12):
        for j in range(i + 1, 12):
            shared = common_prefix(prompts[i], prompts[j])
            if i % 4 == j % 4:
                assert 100 <= shared < 130  # same prefix, different suffix
            else:
                assert shared < 100
    assert [r.shared_prefix_tokens for r in w.requests] == [0] * 4 + [100] * 8
    assert all(r.max_tokens == 5 and r.arrival_s == 0 for r in w.requests)


def test_prefix_repetition_is_deterministic_and_shuffle_is_seeded():
    a = prefix_repetition_workload(TOKENS, num_requests=20, num_prefixes=5, shuffle=True)
    b = prefix_repetition_workload(TokenSpace(seed=5, low=100, high=32000), num_requests=20, num_prefixes=5,
                                   shuffle=True)
    assert a == b
    plain = prefix_repetition_workload(TOKENS, num_requests=20, num_prefixes=5)
    assert [r.prompt_token_ids[:256] for r in a.requests] != [r.prompt_token_ids[:256] for r in plain.requests]
    assert sorted(r.prompt_token_ids[:256] for r in a.requests) == sorted(r.prompt_token_ids[:256] for r in plain.requests)


def test_prefix_repetition_rate_spaces_arrivals():
    w = prefix_repetition_workload(TOKENS, num_requests=4, request_rate=2.0)
    assert [r.arrival_s for r in w.requests] == [0.0, 0.5, 1.0, 1.5]


def test_multi_round_grows_each_conversation():
    w = multi_round_workload(TOKENS, num_sessions=3, num_rounds=3, system_len=50, question_len=10, answer_len=4,
                             think_time_s=0.2, session_interval_s=1.0)
    by_id = {r.request_id: r for r in w.requests}
    for s in range(3):
        turns = [by_id[f"session-{s}-turn-{r}"] for r in range(3)]
        assert [t.prompt_len for t in turns] == [60, 74, 88]  # each turn adds answer + question
        for earlier, later in itertools.pairwise(turns):
            assert later.prompt_token_ids[:earlier.prompt_len] == earlier.prompt_token_ids
            assert later.shared_prefix_tokens == earlier.prompt_len
        assert {t.session for t in turns} == {f"session-{s}"}
        assert [t.think_time_s for t in turns] == [0.0, 0.2, 0.2]
        assert all(t.arrival_s == s * 1.0 for t in turns)
    first_turns = [by_id[f"session-{s}-turn-0"] for s in range(3)]
    for a in first_turns:
        for b in first_turns:
            if a is not b:
                assert common_prefix(a.prompt_token_ids, b.prompt_token_ids) == 50  # only the system prompt
    assert [t.shared_prefix_tokens for t in first_turns] == [0, 50, 50]


def test_multi_round_is_deterministic():
    assert multi_round_workload(TOKENS) == multi_round_workload(TokenSpace(seed=5, low=100, high=32000))


@pytest.mark.parametrize("knobs,match", [
    (WorkloadKnobs(kind="bogus"), "unknown workload"),
    (WorkloadKnobs(kind="prefix-repetition", prefix_len=4000, suffix_len=200), "more than max model len"),
    (WorkloadKnobs(kind="prefix-repetition", num_prefixes=0), "--num-prefixes"),
    (WorkloadKnobs(kind="multi-round", num_rounds=40), "more than max model len"),
    (WorkloadKnobs(kind="trace", max_output_tokens=5000), "leaves no room"),
    # nan sent every request at once, inf and tiny rates waited for ever (fresh-operator tester's class)
    (WorkloadKnobs(kind="prefix-repetition", request_rate=float("nan")), r"--request-rate nan must be from 0.001"),
    (WorkloadKnobs(kind="prefix-repetition", request_rate=1e-300), r"--request-rate 1e-300 must be from 0.001"),
    (WorkloadKnobs(kind="prefix-repetition", request_rate=float("inf")), r"--request-rate inf must be from 0.001"),
    (WorkloadKnobs(kind="multi-round", think_time_s=float("inf")), r"--think-time and --session-interval .*\(an hour\)"),
    (WorkloadKnobs(kind="multi-round", session_interval_s=float("nan")), "--think-time and --session-interval"),
    (WorkloadKnobs(kind="trace", time_scale=float("nan")), r"--time-scale nan must be from 0 to 1,000"),
    (WorkloadKnobs(kind="trace", time_scale=float("inf")), r"--time-scale inf must be from 0 to 1,000"),
])
def test_factory_names_the_knob_to_fix(knobs, match):
    with pytest.raises(WorkloadError, match=match):
        build_workload(knobs, vocab_size=2048, max_model_len=4096, closed_loop=False)


def test_factory_fits_trace_prompts_to_the_model_and_closes_the_loop():
    knobs = WorkloadKnobs(kind="trace", limit=50, tokens_per_block=512, max_output_tokens=16)
    w = build_workload(knobs, vocab_size=2048, max_model_len=2048, closed_loop=True)
    assert max(r.prompt_len + r.max_tokens for r in w.requests) <= 2048
    assert all(r.arrival_s == 0 for r in w.requests)
    assert all(100 <= t < 1948 for r in w.requests for t in r.prompt_token_ids)
    open_loop = build_workload(knobs, vocab_size=2048, max_model_len=2048, closed_loop=False)
    assert max(r.arrival_s for r in open_loop.requests) > 0


def test_demo_workload_is_the_documented_one():
    """3 prompts of 1,028 tokens round robin, 9 requests; each prompt fits the engine cache alone,
    two do not, so every repeat was evicted from the engine before it comes back."""
    from kvtier.bench.demo import DEMO_CACHE_TOKENS, DEMO_KNOBS, DEMO_MAX_MODEL_LEN, DEMO_PROMPT_TOKENS

    w = build_workload(DEMO_KNOBS, vocab_size=8192, max_model_len=DEMO_MAX_MODEL_LEN, closed_loop=True)
    prompts = [r.prompt_token_ids for r in w.requests]
    assert len(prompts) == 9 and {len(p) for p in prompts} == {DEMO_PROMPT_TOKENS}
    assert len(set(prompts)) == 3 and all(prompts[i] == prompts[i % 3] for i in range(9))
    assert [r.shared_prefix_tokens for r in w.requests] == [0] * 3 + [DEMO_PROMPT_TOKENS] * 6
    assert DEMO_PROMPT_TOKENS + DEMO_KNOBS.output_len <= DEMO_MAX_MODEL_LEN <= DEMO_CACHE_TOKENS
    assert 2 * DEMO_PROMPT_TOKENS > DEMO_CACHE_TOKENS


@pytest.mark.parametrize("knobs, message", [
    (WorkloadKnobs(kind="trace", num_requests=60), ("--num-requests is an option of the prefix-repetition workload, "
     "not of trace, and would be ignored; add --workload prefix-repetition or drop it")),
    (WorkloadKnobs(kind="multi-round", request_rate=5.0, shuffle=True), ("--request-rate, --shuffle are options of the "
     "prefix-repetition workload, not of multi-round")),
    (WorkloadKnobs(kind="prefix-repetition", limit=5), "--limit is an option of the trace workload"),
    (WorkloadKnobs(kind="trace", think_time_s=3.0), "--think-time is an option of the multi-round workload"),
])
def test_an_option_of_another_workload_is_refused_not_ignored(knobs, message):
    """A knob of another workload was ignored without a word (tester4); its default value is fine."""
    with pytest.raises(WorkloadError, match=re.escape(message)):
        check_knobs(knobs, closed_loop=True)
    with pytest.raises(WorkloadError, match=re.escape(message)):  # bench compare builds before any server
        build_workload(knobs, vocab_size=2048, max_model_len=4096, closed_loop=True)
    for kind in ("trace", "prefix-repetition", "multi-round"):
        check_knobs(WorkloadKnobs(kind=kind), closed_loop=True)
