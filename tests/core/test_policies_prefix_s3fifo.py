"""Narrated scenarios with exact eviction order: prefix-aware LRU, S3-FIFO, prefix-freq."""

from kvtier.core.policies import make_policy
from kvtier.core.policies.prefix_freq import PrefixFrequencyPolicy
from kvtier.core.policies.prefix_lru import PrefixAwareLRUPolicy
from kvtier.core.policies.s3fifo import S3FIFOPolicy


def drain(policy, evictable=lambda key: True):
    order = []
    while (victim := policy.victim(evictable)) is not None:
        order.append(victim)
        policy.remove(victim)
    return order


def insert_chain(policy, keys, parent=None):
    for key in keys:
        policy.insert(key, parent)
        parent = key


def drive(policy, accesses, capacity):
    """A minimal owner: touch on hit, insert + evict on miss.  Returns the hit flags."""
    flags = []
    for key in accesses:
        hit = key in policy
        flags.append(hit)
        if hit:
            policy.touch([key])
        else:
            policy.insert(key, None)
            if len(policy) > capacity:
                policy.remove(policy.victim())
    return flags


def test_prefix_lru_evicts_leaves_first():
    p = PrefixAwareLRUPolicy()
    insert_chain(p, ["sys", "a1", "a2"])  # conversation a
    insert_chain(p, ["b1"], parent="sys")  # conversation b shares "sys"
    p.touch(["sys", "a1", "a2"])  # a is the most recent: b1 is the LRU leaf
    # sys is the oldest-touched after b1 ... but has children until a1 and b1 are gone.
    assert drain(p) == ["b1", "a2", "a1", "sys"]


def test_prefix_lru_parent_that_returns_finds_its_children():
    p = PrefixAwareLRUPolicy()
    insert_chain(p, ["x", "y"])
    p.remove("x")  # deleted (e.g. failed checksum) while y stays
    p.insert("x", None)  # back again: it still has a resident child
    assert p.victim() == "y"


def test_s3fifo_one_hit_wonders_leave_through_the_small_queue():
    p = S3FIFOPolicy()
    for key in range(10):
        p.insert(key, None)
    p.touch([0, 1])  # reused while in S: promoted to M when they reach its head
    assert drain(p)[:8] == [2, 3, 4, 5, 6, 7, 8, 9]


def test_s3fifo_ghost_hit_goes_to_main():
    p = S3FIFOPolicy()
    for key in range(10):
        p.insert(key, None)
    victim = p.victim()
    assert victim == 0
    p.remove(victim)  # 0 -> ghost
    p.insert(0, None)  # seen again: straight to M, behind the S queue
    assert drain(p)[:9] == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_prefix_freq_is_tail_first_lru_with_leaves_first_before_evidence():
    p = make_policy("prefix-freq")
    insert_chain(p, ["sys", "a1", "a2"])
    insert_chain(p, ["b1", "b2"], parent="sys")
    p.touch(["sys", "a1", "a2"])
    assert not p.quarantine
    assert drain(p) == ["b2", "b1", "a2", "a1", "sys"]


def test_prefix_freq_quarantines_when_reuse_comes_back_late():
    # 10 chunks of room; a stream of one-time chunks, and 3 hot chunks reused every 20 inserts:
    # LRU evicts the hot ones after 10 inserts, so they always miss.  Their reuses come back
    # from the ghost list at ages between n and 4n, which switches on the quarantine; from then
    # on one-time chunks go first and the hot ones hit.
    p = PrefixFrequencyPolicy()
    accesses, fresh = [], 1000
    for step in range(600):
        if step % 20 == 0:
            accesses += ["h1", "h2", "h3"]
        accesses.append(fresh)
        fresh += 1
    flags = drive(p, accesses, capacity=10)
    assert p.quarantine
    hot = [hit for key, hit in zip(accesses, flags) if isinstance(key, str)]
    assert not any(hot[:6])  # LRU regime: every early hot access misses
    assert all(hot[-30:])  # quarantine: the hot set now survives the stream
    lru_flags = drive(make_policy("lru"), accesses, capacity=10)
    assert not any(hit for key, hit in zip(accesses, lru_flags) if isinstance(key, str))


def test_prefix_freq_stays_lru_when_first_reuses_are_near():
    # Every chunk is reused once, 3 inserts after it arrived, then never again: quarantine would
    # only lose those hits, so the policy must stay LRU and catch them all.
    p = PrefixFrequencyPolicy()
    accesses = []
    for i in range(400):
        accesses.append(i)
        if i >= 3:
            accesses.append(i - 3)
    flags = drive(p, accesses, capacity=10)
    assert not p.quarantine
    assert sum(flags) == 397


def test_prefix_freq_and_prefix_lru_look_past_pinned_leaves():
    for name in ("prefix-freq", "prefix-lru"):
        p = make_policy(name)
        insert_chain(p, ["a0", "a1"])
        insert_chain(p, ["b0", "b1"])
        p.touch(["b0", "b1"])  # a is older: a1 is the first leaf to go
        assert p.victim() == "a1"
        assert p.victim(lambda key: key != "a1") == "b1"  # a0 has a child: the next leaf is b1
        assert p.victim() == "a1"  # the pinned leaf was put back
        everything_pinned = p.victim(lambda key: key == "a0")  # only an inner chunk may go
        assert everything_pinned == "a0"
        assert p.victim(lambda key: False) is None
