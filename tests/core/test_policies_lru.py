"""LRU policies: narrated scenarios with the exact eviction order."""

from kvtier.core.keys import ChunkKey
from kvtier.core.policies import make_policy
from kvtier.core.policies.lru import LRUPolicy


def k(name: str) -> ChunkKey:
    return ChunkKey(name.encode())


def drain(policy, evictable=lambda key: True) -> list[str]:
    order = []
    while (victim := policy.victim(evictable)) is not None:
        order.append(victim.decode())
        policy.remove(victim)
    return order


def test_prompt_order_lru_evicts_head_first():
    p = LRUPolicy()
    for name, parent in (("a0", None), ("a1", "a0"), ("a2", "a1")):
        p.insert(k(name), k(parent) if parent else None)
    p.insert(k("b0"), None)
    p.touch([k("a0"), k("a1"), k("a2")])  # request A used again, in prompt order
    assert drain(p) == ["b0", "a0", "a1", "a2"]


def test_tail_first_lru_keeps_the_shared_head():
    p = make_policy("lru-tail")
    for name in ("a0", "a1", "a2", "b0"):
        p.insert(k(name), None)
    p.touch([k("a0"), k("a1"), k("a2")])
    assert drain(p) == ["b0", "a2", "a1", "a0"]


def test_victim_skips_pinned_and_remove_is_idempotent():
    p = LRUPolicy()
    for name in ("x", "y", "z"):
        p.insert(k(name), None)
    assert p.victim(lambda key: key != k("x")) == k("y")
    p.remove(k("nope"))
    p.remove(k("y"))
    p.remove(k("y"))
    assert len(p) == 2 and k("y") not in p
    assert p.victim(lambda key: False) is None


def test_reinsert_counts_as_use():
    p = LRUPolicy()
    p.insert(k("a"), None)
    p.insert(k("b"), None)
    p.insert(k("a"), None)
    assert drain(p) == ["b", "a"]
