"""KVTierConnector across engine processes: restart, and a producer handing KV to a consumer.

Each engine is ``engine_runner.py`` in its own process with vLLM's default multiprocessing, so
the scheduler-side connector (EngineCore process) and the worker-side connector (worker
process) talk over the rank service's Unix socket, as under ``vllm serve`` on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm_helpers import PROMPT_WORDS, max_logprob_diff, result_of, run_engine

pytestmark = pytest.mark.engine

LOADABLE = 6 * 64
TOLERANCE = 1e-4


def _prompts() -> list[str]:
    from kvtier.integrations.vllm.testmodel import random_prompt

    return [random_prompt(300 + i, PROMPT_WORDS) for i in range(2)]


def _spec(model: Path, disk: Path, steps: list[dict[str, Any]], role: str = "kv_both") -> dict[str, Any]:
    return {"model": str(model), "role": role, "steps": steps,
            "kvtier": {"chunk_tokens": 64, "cpu_gib": 0.01, "disk_path": str(disk), "disk_gib": 0.05,
                       "write_mode": "write-through"}}


def test_restarted_engine_is_served_from_disk(tiny_model: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    prompts = _prompts()
    first = result_of(run_engine(_spec(tiny_model, disk, [{"op": "generate", "prompts": prompts}]),
                                 tmp_path, "first"), tmp_path, "first")
    assert first["metrics"].get("kvtier_saved_tokens_total", 0) == 2 * LOADABLE
    assert first["integrity"] == "ok"

    second = result_of(run_engine(_spec(tiny_model, disk, [{"op": "generate", "prompts": prompts}]),
                                  tmp_path, "second"), tmp_path, "second")
    m = second["metrics"]
    assert m["kvtier_loaded_tokens_total{disk}"] == 2 * LOADABLE  # a fresh process: only the disk has it
    assert m["vllm:external_prefix_cache_hits_total"] == 2 * LOADABLE
    assert second["integrity"] == "ok"
    for a, b in zip(first["results"][0], second["results"][0]):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a["logprobs"], b["logprobs"]) < TOLERANCE


def test_producer_hands_kv_to_consumer_through_shared_disk(tiny_model: Path, tmp_path: Path) -> None:
    """Two engine processes at once on one disk tier: a kv_producer (saves only) prefills, a
    kv_consumer (loads only) then serves the same prompts from what the producer wrote."""
    disk = tmp_path / "disk"
    prompts = _prompts()
    ready = tmp_path / "producer-ready"
    producer = run_engine(_spec(tiny_model, disk, [{"op": "generate", "prompts": prompts},
                                                   {"op": "flush"}, {"op": "touch", "path": str(ready)}],
                                role="kv_producer"), tmp_path, "producer")
    consumer = run_engine(_spec(tiny_model, disk, [{"op": "wait", "path": str(ready)},
                                                   {"op": "generate", "prompts": prompts}],
                                role="kv_consumer"), tmp_path, "consumer")
    made = result_of(producer, tmp_path, "producer")
    used = result_of(consumer, tmp_path, "consumer")
    assert made["metrics"]["kvtier_saved_tokens_total"] == 2 * LOADABLE
    assert made["metrics"]["kvtier_loaded_tokens_total{cpu}"] + made["metrics"]["kvtier_loaded_tokens_total{disk}"] == 0
    assert used["metrics"]["kvtier_saved_tokens_total"] == 0  # a consumer never writes
    assert used["metrics"]["kvtier_loaded_tokens_total{disk}"] == 2 * LOADABLE
    assert used["metrics"]["vllm:external_prefix_cache_hits_total"] == 2 * LOADABLE
    for a, b in zip(made["results"][0], used["results"][0]):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_diff(a["logprobs"], b["logprobs"]) < TOLERANCE


def test_tensor_parallel_ranks_each_hold_their_share(tiny_model: Path, tmp_path: Path) -> None:
    """TP=2: each rank stores its KV heads in its own store of cpu_gib / 2; a hit needs both."""
    disk = tmp_path / "disk"
    prompts = _prompts()[:1]
    spec = _spec(tiny_model, disk, [{"op": "generate", "prompts": prompts}, {"op": "reset_prefix_cache"},
                                    {"op": "generate", "prompts": prompts}])
    spec["engine"] = {"tensor_parallel_size": 2}
    # vLLM's CPU backend needs explicit core binding for two workers on one NUMA node.
    out = result_of(run_engine(spec, tmp_path, "tp2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}), tmp_path, "tp2")
    m = out["metrics"]
    assert m["kvtier_loaded_tokens_total{cpu}"] == LOADABLE == m["vllm:external_prefix_cache_hits_total"]
    assert m["kvtier_saved_tokens_total"] == LOADABLE  # counted once, not once per rank
    per_rank = int(0.01 * (1 << 30)) // 2  # cpu_gib is the total over ranks
    rank0 = out["store"]["cpu"]["capacity_bytes"]
    assert per_rank * 0.9 < rank0 <= per_rank
    assert m["kvtier_capacity_bytes{cpu}"] == 2 * rank0  # the /metrics gauge sums the ranks
    assert out["integrity"] == "ok"
    first, second = out["results"]
    assert first[0]["tokens"] == second[0]["tokens"]
    assert max_logprob_diff(first[0]["logprobs"], second[0]["logprobs"]) < TOLERANCE
