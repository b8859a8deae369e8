"""Every registered eviction policy keeps the base.py contract (hypothesis, against a set model)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.policies import available_policies, make_policy
from kvtier.core.policies.registry import DEFAULT_POLICY

KEYS = st.integers(0, 15)
OPS = st.lists(st.one_of(
    st.tuples(st.just("insert"), KEYS, st.one_of(st.none(), KEYS)),
    st.tuples(st.just("touch"), st.lists(KEYS, max_size=5)),
    st.tuples(st.just("remove"), KEYS),
    st.tuples(st.just("victim"), st.frozensets(KEYS, max_size=4)),
    st.tuples(st.just("evict"), st.frozensets(KEYS, max_size=4)),
), max_size=80)


@pytest.mark.parametrize("name", available_policies())
@settings(max_examples=80, deadline=None)
@given(ops=OPS)
def test_contract_against_a_set_model(name, ops):
    policy = make_policy(name)
    model: set[int] = set()
    for op in ops:
        kind = op[0]
        if kind == "insert":
            policy.insert(op[1], op[2])
            model.add(op[1])
        elif kind == "touch":
            policy.touch(op[1])  # untracked keys are ignored
        elif kind == "remove":
            policy.remove(op[1])  # unknown keys are ignored
            model.discard(op[1])
        else:
            pinned = op[1]
            evictable = lambda key, pinned=pinned: key not in pinned
            victim = policy.victim(evictable)
            if model - pinned:
                assert victim in model and victim not in pinned
                assert policy.victim(evictable) == victim  # no mutation
            else:
                assert victim is None
            if kind == "evict" and victim is not None:
                policy.remove(victim)
                model.discard(victim)
        assert len(policy) == len(model)
        assert set(policy.keys()) == model
        assert all(key in policy for key in model)


def test_default_is_registered_and_resolves():
    assert DEFAULT_POLICY in available_policies()
    assert type(make_policy("default")) is type(make_policy(DEFAULT_POLICY))
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("mru")


BATCH_OPS = st.lists(st.one_of(
    st.tuples(st.just("insert_many"), st.lists(st.tuples(KEYS, st.one_of(st.none(), KEYS)), max_size=6)),
    st.tuples(st.just("touch"), st.lists(KEYS, max_size=5)),
    st.tuples(st.just("evict"), st.integers(0, 6), st.frozensets(KEYS, max_size=4)),
), max_size=60)


@pytest.mark.parametrize("name", available_policies())
@settings(max_examples=60, deadline=None)
@given(ops=BATCH_OPS)
def test_batch_verbs_do_what_one_at_a_time_does(name, ops):
    """``evict(n)`` and ``insert_many`` (a load's promotions in one call each) leave a policy where
    ``victim``-then-``remove`` n times and ``insert`` one by one leave its twin: the same victims in
    the same order, the same keys, and the same next victim."""
    batched, single = make_policy(name), make_policy(name)
    for op in ops:
        if op[0] == "insert_many":
            batched.insert_many(op[1])
            for key, parent in op[1]:
                single.insert(key, parent)
        elif op[0] == "touch":
            batched.touch(op[1])
            single.touch(op[1])
        else:
            num, pinned = op[1], op[2]
            evictable = lambda key, pinned=pinned: key not in pinned
            one_by_one = []
            while len(one_by_one) < num and (victim := single.victim(evictable)) is not None:
                single.remove(victim)
                one_by_one.append(victim)
            # the pins as a predicate, or as the container ``held`` (asked by membership, no call per candidate)
            assert (batched.evict(num, held=pinned) if num % 2 else batched.evict(num, evictable)) == one_by_one
            assert len(one_by_one) == num or single.victim(evictable) is None
        assert set(batched.keys()) == set(single.keys())
        assert batched.victim() == single.victim()


HEAP_POLICIES = ("adaptive", "prefix-lru", "prefix-freq")


@pytest.mark.parametrize("name", HEAP_POLICIES)
@settings(max_examples=80, deadline=None)
@given(ops=OPS)
def test_compacting_the_heap_changes_no_victim(name, ops):
    """A heap compacted at every touch picks the same victims, pins included, as one never
    compacted (bound beyond reach): the compaction only drops entries the victim search would drop."""
    policies = [make_policy(name), make_policy(name)]
    policies[0].heap_slack = -(1 << 60)  # compact at every touch
    policies[1].heap_slack = 1 << 60  # never
    for op in ops:
        answers = []
        for policy in policies:
            if op[0] == "insert":
                policy.insert(op[1], op[2])
            elif op[0] == "touch":
                policy.touch(op[1])
            elif op[0] == "remove":
                policy.remove(op[1])
            else:
                victim = policy.victim(lambda key, pinned=op[1]: key not in pinned)
                if op[0] == "evict" and victim is not None:
                    policy.remove(victim)
                answers.append(victim)
        assert len(set(answers)) <= 1, (op, answers)


@pytest.mark.parametrize("name", HEAP_POLICIES)
def test_a_tier_that_never_evicts_keeps_its_heap_bounded(name):
    """One prompt of 7 chunks hit 20,000 times without an eviction: the heap held an entry per hit
    (20,007) before it was compacted; now at most 2 × 7 + heap_slack = 78."""
    policy = make_policy(name)
    for i in range(7):
        policy.insert(i, i - 1 if i else None)
    for _ in range(20_000):
        policy.touch(list(range(7)))
    heaps = [v for v in vars(policy).values() if isinstance(v, list) and v and isinstance(v[0], tuple)
             and len(v[0]) in (3, 4) and v is not getattr(policy, "pending", None)]
    assert heaps and all(len(h) <= 2 * 7 + policy.heap_slack for h in heaps), [len(h) for h in heaps]
    assert policy.victim() == 6
