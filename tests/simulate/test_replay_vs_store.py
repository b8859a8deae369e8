"""The simulator's cpu tier against kvtier's real store, driven as the connector drives it (trace-tools probe).

Through vLLM (tiny model, 20 requests: 4 conversations x 5 turns, engine 16 chunks, cpu_gib 32 chunks,
``policy: lru``, one request in flight) ``kvtier bench compare`` measured 28.0 % of prompt tokens served while the
connector touched only the chunks it loaded (a save of a chunk the cpu tier held stored and touched nothing), and
24.0 % once a save job touches the held chunks vLLM served from its own prefix cache (``SaveJob.touch_chunks``,
``prepare_store``'s ``touch_end``); ``kvtier simulate`` predicts 24.0 %: its replay touches every cpu-resident
chunk of a prompt after each request.  This test replays the same trace through a real :class:`TieredStore` the
connector's way (the engine's hit from the simulator's own engine model, which matched vLLM's 12.7 % exactly; a
load of what the store holds after it, then a save of every full chunk, touching those before the engine's hit)
and compares cpu hits request by request, with and without that touch (docs/simulate.md § Limits)."""

from __future__ import annotations

import hashlib

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.policies import make_policy
from kvtier.simulate.replay import chunk_parents, engine_prefix_hits, lookup_limits, replay
from kvtier.simulate.trace import Trace
from tests.core.helpers import make_store

ENGINE_CHUNKS, CPU_CHUNKS = 16, 32
MEASURED_CPU_CHUNKS = [0, 0, 0, 0, 0, 0, 0, 2, 5, 5, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0]
"""Chunks each request loaded from kvtier's cpu tier in the vLLM run above (its receipts, tokens / 128)."""
MEASURED_UNTOUCHED_CPU_CHUNKS = [0, 0, 0, 0, 0, 0, 0, 2, 5, 5, 5, 5, 8, 0, 0, 0, 0, 0, 0, 0]
"""The same before save jobs touched (``touch_end`` 0): request 12 loaded 8 chunks."""
MEASURED_DEFAULT_CPU_CHUNKS = [0, 0, 0, 0, 0, 0, 0, 2, 5, 5, 5, 5, 7, 4, 1, 0, 5, 4, 2, 0]
"""The same with the default policy (35.7 % served; the replay predicts 43.3 %: it evicts after each insert, the
store picks every victim of a save job before it inserts any)."""


def _conversations() -> Trace:
    """4 conversations x 5 turns, interleaved; every prompt starts with the shared chunk 0 and each turn adds 3
    chunks to its conversation (its last block partial): the trace of the vLLM run above, 512-token blocks."""
    convs: dict[int, list[int]] = {c: [0] for c in range(4)}
    next_id, tokens, keys = 1, [], []
    for _turn in range(5):
        for c in range(4):
            convs[c] += [next_id, next_id + 1, next_id + 2]
            next_id += 3
            tokens.append(512 * len(convs[c]) - 100)
            keys.append(convs[c][:tokens[-1] // 512])
    return Trace("conversations", 512, [float(i) for i in range(len(tokens))], tokens, keys)


def _store_cpu_hits(trace: Trace, touch: bool = True, policy: str = "lru") -> list[int]:
    store = make_store(None, cpu_chunks=CPU_CHUNKS, policy=policy)
    key = {k: ChunkKey(hashlib.blake2b(str(k).encode(), digest_size=KEY_BYTES).digest())
           for keys in trace.chunk_keys for k in keys}
    engine = engine_prefix_hits(trace, ENGINE_CHUNKS)
    hits = []
    for keys, first, limit in zip(trace.chunk_keys, engine, lookup_limits(trace)):
        chain = [key[k] for k in keys]
        found = store.lookup(chain[first:limit]) if first < limit else 0
        if found:  # the load job: the pages past vLLM's own hit, loaded and touched
            handle = store.prepare_load(chain[first:first + found])
            store.complete_load(handle, True)
        hits.append(found)
        # the save job of every full chunk; those vLLM served (before ``first``) are touched, as the connector's
        handle = store.prepare_store(chain, touch_end=first if touch else 0)
        store.complete_store(handle, True)  # (the bytes are not compared: the pages as reserved)
    return hits


def _replay_cpu_hits(trace: Trace) -> list[int]:
    engine, parents, hits, before = engine_prefix_hits(trace, ENGINE_CHUNKS), chunk_parents(trace), [], 0
    for n in range(1, trace.num_requests + 1):
        head = Trace(trace.name, 512, trace.times_s[:n], trace.num_tokens[:n], trace.chunk_keys[:n])
        counts = replay(head, engine[:n], CPU_CHUNKS, 0, lambda: make_policy("lru"), parents)
        hits.append(counts.cpu_hits - before)
        before = counts.cpu_hits
    return hits


def test_the_store_driven_as_the_connector_serves_what_vllm_measured() -> None:
    """Request by request, as the receipts of the vLLM run; request 12 (conversation 0's fourth turn) loads
    nothing: chunk 0 (vLLM's own hit at every request) was touched each time, so conversation 0's first chunk
    was the cpu tier's least recent and went first."""
    assert _store_cpu_hits(_conversations()) == MEASURED_CPU_CHUNKS


def test_without_the_touch_the_store_serves_what_vllm_measured_before() -> None:
    """``touch_end`` 0 (the default for other callers): the engine-served chunks keep their old rank, and
    request 12 loads 8 chunks, as the vLLM run measured before save jobs touched."""
    assert _store_cpu_hits(_conversations(), touch=False) == MEASURED_UNTOUCHED_CPU_CHUNKS


def test_the_replay_serves_what_the_store_serves_request_by_request() -> None:
    """With the touch the store and the replay agree (LRU); before, they parted at request 12."""
    assert _replay_cpu_hits(_conversations()) == _store_cpu_hits(_conversations()) == MEASURED_CPU_CHUNKS


def test_the_store_with_the_default_policy_serves_what_vllm_measured() -> None:
    """The default policy, request by request as that vLLM run's receipts."""
    assert _store_cpu_hits(_conversations(), policy="default") == MEASURED_DEFAULT_CPU_CHUNKS
