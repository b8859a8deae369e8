"""A scan of one-time prompts flushes LRU's hot prefix but not S3-FIFO's."""

from kvtier.simulate.replay import replay
from tests.simulate.helpers import make_trace, policy_factory

HOT = [1, 2, 3, 4]  # a shared 4-chunk prefix (system prompt + tools), used by every hot request
CPU_CHUNKS = 12


def scan_trace():
    scan = [([100 + 4 * i + j for j in range(4)], 1) for i in range(8)]  # 32 chunks, each used once
    return make_trace([(HOT, 1)] * 3 + scan + [(HOT, 1)])


def hits_of_last_request(name):
    trace = scan_trace()
    before = make_trace([(keys, tokens - len(keys) * 4) for keys, tokens in
                         zip(trace.chunk_keys[:-1], trace.num_tokens[:-1])])
    total = replay(trace, [0] * trace.num_requests, CPU_CHUNKS, 0, policy_factory(name, trace)).cpu_hits
    earlier = replay(before, [0] * before.num_requests, CPU_CHUNKS, 0, policy_factory(name, before)).cpu_hits
    return total - earlier


def test_scan_flushes_lru():
    assert hits_of_last_request("lru") == 0
    assert hits_of_last_request("lru-tail") == 0


def test_scan_does_not_flush_s3fifo():
    assert hits_of_last_request("s3fifo") == len(HOT)


def test_belady_keeps_the_hot_prefix_too():
    assert hits_of_last_request("belady") == len(HOT)
