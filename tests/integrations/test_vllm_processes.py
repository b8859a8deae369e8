"""KVTierConnector across engine processes: graceful stop and restart, the identity fence, a
producer handing KV to a running consumer, tensor parallelism (7 engine start-ups in all: each
test chains the scenarios that can share its engines).

Each engine is ``engine_runner.py`` in its own process with vLLM's multiprocessing executor, so
the scheduler-side connector (the runner's process) and the worker-side connector (the worker
process) meet only through vLLM's own per-step messages, as under ``vllm serve`` on CPU; except
two engines whose subject is not the split (tests/engine_layout.py), whose worker runs in the
runner's process: the engine started after the weights were replaced (the file fingerprint is read
from the model directory in either layout) and the producer that feeds the running consumer.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.engine_layout import WORKER_IN_RUNNER
from tests.integrations.vllm_helpers import PROMPT_WORDS, max_logprob_diff, result_of, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.shares_cpu]

LOADABLE = 6 * 64
TOLERANCE = 1e-4


def _prompts() -> list[str]:
    from kvtier.launch.testmodel import random_prompt

    return [random_prompt(300 + i, PROMPT_WORDS) for i in range(2)]


def _spec(model: Path, disk: Path, steps: list[dict[str, Any]], role: str = "kv_both",
          write_mode: str = "write-through") -> dict[str, Any]:
    return {"model": str(model), "role": role, "steps": steps,
            "kvtier": {"chunk_tokens": 64, "cpu_gib": 0.01, "disk_path": str(disk), "disk_gib": 0.05,
                       "write_mode": write_mode}}


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x["tokens"] == y["tokens"]
        assert max_logprob_diff(x["logprobs"], y["logprobs"]) < TOLERANCE


def test_graceful_stop_keeps_the_hot_set_and_other_identities_miss(tiny_model: Path, tmp_path: Path) -> None:
    """Write-back with a cpu tier that never fills: only the shutdown flush puts chunks on disk
    (that a restart with the same identity is served from them is test_vllm_serve.py's SIGTERM
    restart, and test_vllm_hybrid_kvtier.py's for a hybrid model).  Then two engines whose KV
    differs from the first one's, on the same disk tier, load nothing and answer as their own
    prefill does: one with
    ``--hf-overrides`` changing every layer's KV (break test F-hf-overrides), one after the weight
    file is replaced in place (same names, shapes and sizes, other values).

    The first engine's cpu tier (cpu_gib 0.004: 32 chunks of this model) is smaller than one
    max_model_len prompt (16 chunks) plus the disk write queue (64): it still starts and serves,
    and its log says why saves may be dropped (breaker F9)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    disk = tmp_path / "disk"
    prompts = _prompts()
    steps = [{"op": "generate", "prompts": prompts}]
    small = _spec(model, disk, steps, write_mode="write-back")
    small["kvtier"]["cpu_gib"] = 0.004
    first = result_of(run_engine(small, tmp_path, "first"), tmp_path, "first")
    m = first["metrics"]
    assert m["kvtier_saved_tokens_total"] == 2 * LOADABLE
    assert m["kvtier_dirty_bytes"] > 0, "write-back: the chunks were only in DRAM when the engine stopped"
    assert m["kvtier_pinned_chunks{cpu}"] == m["kvtier_pinned_chunks{disk}"] == 0
    log = (tmp_path / "first.log").read_text(errors="replace")
    assert "kvtier: rank 0 cpu tier holds 32 chunks, fewer than one max_model_len prompt (16 chunks) plus the disk " \
           "write queue (save_queue_depth 64)" in log

    # the stop flushed every chunk the first engine saved: the disk holds what a restart would load
    assert f"kvtier: rank 0 shutdown flush wrote {2 * LOADABLE // 64} dirty chunks" in log

    spec = dict(_spec(model, disk, steps), engine={"hf_overrides": {"rms_norm_eps": 0.9}})
    other = result_of(run_engine(spec, tmp_path, "override"), tmp_path, "override")
    m = other["metrics"]
    assert m["kvtier_loaded_tokens_total{disk}"] + m["kvtier_loaded_tokens_total{cpu}"] == 0
    assert m["vllm:external_prefix_cache_hits_total"] == 0
    assert m["kvtier_saved_tokens_total"] == 2 * LOADABLE  # its own chunks, in its own namespace
    assert other["results"][0][0]["logprobs"] != first["results"][0][0]["logprobs"]  # the override does change KV

    from kvtier.launch.testmodel import GEOMETRIES
    from kvtier.launch.testmodel_weights import write_weights

    before = (model / "model.safetensors").stat().st_size
    write_weights(model, GEOMETRIES["tiny"], seed=1)  # replaced in place: same file, same size
    assert (model / "model.safetensors").stat().st_size == before
    # the file fingerprint is read from the model directory, whatever the process layout: this engine's
    # worker runs in its runner's process (one start-up import less: tests/engine_layout.py)
    third_spec = dict(_spec(model, disk, steps), engine=WORKER_IN_RUNNER)
    third = result_of(run_engine(third_spec, tmp_path, "third"), tmp_path, "third")
    m = third["metrics"]
    assert m["kvtier_loaded_tokens_total{disk}"] + m["kvtier_loaded_tokens_total{cpu}"] == 0
    assert m["vllm:external_prefix_cache_hits_total"] == 0
    assert third["results"][0][0]["logprobs"] != first["results"][0][0]["logprobs"]  # the weights did change


def test_running_consumer_adopts_what_a_producer_writes_later(tiny_model: Path, tmp_path: Path) -> None:
    """A kv_consumer (loads only) starts on an empty shared disk tier and keeps running; a
    kv_producer (saves only) then prefills and stops.  The consumer's periodic rescan
    (``disk_rescan_s``) adopts the producer's chunk files, its next engine step carries them to the
    scheduler's mirror, and it serves the prompts from disk with the producer's tokens and
    logprobs; it never writes, and its graceful stop says so."""
    disk = tmp_path / "disk"
    ready, done = tmp_path / "consumer-ready", tmp_path / "producer-done"
    prompts = _prompts()
    chunk_bytes = 2 * 2 * (2 * 32 * 64 * 2 * 4)  # layers × blocks per chunk × (K,V × block × heads × head × fp32)
    spec = _spec(tiny_model, disk, [{"op": "touch", "path": str(ready)},
                                    {"op": "wait", "path": str(done), "timeout_s": 600},
                                    # a rescan adopted the producer's 12 chunk files (the gauge comes with steps)
                                    {"op": "until", "metric": "kvtier_usage_bytes{disk}",
                                     "at_least": 2 * 6 * chunk_bytes, "timeout_s": 60},
                                    {"op": "flush"},  # one engine step: the index changes reach the mirror
                                    {"op": "generate", "prompts": prompts}], role="kv_consumer")
    spec["kvtier"]["disk_rescan_s"] = 0.2
    consumer = run_engine(spec, tmp_path, "consumer", timeout_s=900)
    # the producer starts beside the consumer (two start-ups at once) but prefills only once the
    # consumer is up: the consumer still starts on an empty disk tier and adopts the files by rescan.
    # The producer's worker runs in its runner's process (one start-up import less: tests/engine_layout.py);
    # the consumer, whose rescan reaches the scheduler's mirror, keeps its halves in separate processes
    # (its saves are deferred: their counts reach /metrics with a later engine step's stats, which a loaded
    # machine may not have run when generate() returns: the save of a finished request is no step of its own)
    made_spec = _spec(tiny_model, disk, [{"op": "wait", "path": str(ready), "timeout_s": 600},
                                         {"op": "generate", "prompts": prompts},
                                         {"op": "until", "metric": "kvtier_saved_tokens_total",
                                          "at_least": 2 * LOADABLE, "timeout_s": 60}], role="kv_producer")
    made_spec["engine"] = WORKER_IN_RUNNER
    producer = run_engine(made_spec, tmp_path, "producer", timeout_s=900)
    try:
        deadline = time.monotonic() + 420
        while not ready.exists() and consumer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), "the consumer did not start"
        made = result_of(producer, tmp_path, "producer")
    finally:
        done.write_text("done")
        if producer.poll() is None:  # a failed check above: the producer is not left waiting at its gate
            producer.kill()
            producer.wait()
    used = result_of(consumer, tmp_path, "consumer")
    assert made["metrics"]["kvtier_saved_tokens_total"] == 2 * LOADABLE
    assert made["metrics"]["kvtier_loaded_tokens_total{cpu}"] + made["metrics"]["kvtier_loaded_tokens_total{disk}"] == 0
    assert used["metrics"]["kvtier_saved_tokens_total"] == 0  # a consumer never writes
    # its graceful stop says so: the flush line is logged with nothing dirty too (breaker F8)
    assert "kvtier: rank 0 shutdown flush wrote 0 dirty chunks" in (tmp_path / "consumer.log").read_text(errors="replace")
    assert used["metrics"]["kvtier_loaded_tokens_total{disk}"] == 2 * LOADABLE
    assert used["metrics"]["vllm:external_prefix_cache_hits_total"] == 2 * LOADABLE
    _same(made["results"][0], used["results"][0])


def test_tensor_parallel_ranks_each_hold_their_share(tiny_model: Path, tmp_path: Path) -> None:
    """TP=2: each rank stores its KV heads in its own store of cpu_gib / 2; a hit needs both,
    and the scheduler's mirror merges both ranks' reports into one view."""
    disk = tmp_path / "disk"
    prompts = _prompts()[:1]
    spec = _spec(tiny_model, disk, [{"op": "generate", "prompts": prompts}, {"op": "reset_prefix_cache"},
                                    {"op": "generate", "prompts": prompts}, {"op": "flush"}])
    spec["engine"] = {"tensor_parallel_size": 2}
    # vLLM's CPU backend needs explicit core binding for two workers on one NUMA node.
    out = result_of(run_engine(spec, tmp_path, "tp2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}), tmp_path, "tp2")
    m = out["metrics"]
    assert m["kvtier_loaded_tokens_total{cpu}"] == LOADABLE == m["vllm:external_prefix_cache_hits_total"]
    assert m["kvtier_saved_tokens_total"] == LOADABLE  # counted once, not once per rank
    per_rank = int(0.01 * (1 << 30)) // 2  # cpu_gib is the total over ranks
    assert 2 * per_rank * 0.9 < m["kvtier_capacity_bytes{cpu}"] <= 2 * per_rank  # the gauge sums the ranks
    assert m["kvtier_pinned_chunks{cpu}"] == m["kvtier_pinned_chunks{disk}"] == 0
    assert m["kvtier_dirty_bytes"] == 0
    first, second = out["results"]
    _same(first, second)
