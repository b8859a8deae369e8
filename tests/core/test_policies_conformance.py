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
            assert batched.evict(num, evictable) == one_by_one
            assert len(one_by_one) == num or single.victim(evictable) is None
        assert set(batched.keys()) == set(single.keys())
        assert batched.victim() == single.victim()
