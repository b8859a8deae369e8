"""A real ``python -m vllm.entrypoints.openai.api_server`` stopped with SIGTERM and started again.

The first server runs in write-back mode with a cpu tier that never fills, so nothing reaches
the disk tier unless the graceful stop flushes it (``--shutdown-timeout`` lets vLLM stop its
worker gracefully; the connector's ``shutdown()`` then writes the dirty chunks).  The restarted
server, with kvtier's default settings and only a disk tier named, must serve its very first
request from disk, bit for bit as vLLM's own prefix cache holding the same prefix does.  The
engine runs in bfloat16: a fresh engine whose first forward runs over loaded KV reaches vLLM's
AMX attention kernel before any oneDNN GEMM has asked for AMX permission, which kills the process
with SIGILL on AMX CPUs unless the connector asked first.  (kvtier's default write-through save
before a SIGTERM restart is test_vllm_demo.py's case.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integrations.openai_client import metrics as served_metrics

pytestmark = pytest.mark.engine

TOLERANCE = 1e-3  # bfloat16 engine: logprobs of a cold prefill vs one continuing from loaded KV


def _complete(base_url: str, model: str, prompt: str | list[int], max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 0}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=600.0)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
            "logprobs": choice["logprobs"]["token_logprobs"]}


def _token_ids(base_url: str, model: str, prompt: str) -> list[int]:
    r = httpx.post(base_url + "/tokenize", json={"model": model, "prompt": prompt}, timeout=60.0)
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


def test_sigterm_flushes_write_back_and_the_restart_reproduces_the_engines_own_prefix_cache_bit_for_bit(
        tiny_model: Path, tmp_path: Path) -> None:
    """The operator's case: a write-back server stopped with SIGTERM flushes its dirty chunks; the
    server started again with nothing tuned (kvtier's default settings, ``disk_io: auto``, plus the
    same disk tier) serves its first request from disk, and that answer is compared, with no
    tolerance, against the exact reference: a server without any connector whose own prefix cache
    holds exactly the tokens kvtier loads (it first prefills that prefix alone), so both compute
    the same tail over the same cached prefix with the same threads
    (``VLLM_CPU_NUM_OF_RESERVED_CPU`` pinned for all three)."""
    from kvtier.launch.serve import Server, ServerSpec, transfer_config
    from kvtier.launch.testmodel import random_prompt

    disk = {"disk_path": str(tmp_path / "disk"), "disk_gib": 0.5}
    write_back = {**disk, "cpu_gib": 0.25, "write_mode": "write-back"}
    with_kvtier = ServerSpec(model=str(tiny_model), max_model_len=2048, kv_cache_bytes=256 << 20, load_format=None,
                             kv_transfer_config=transfer_config(disk), memory_fraction=0.1, enforce_eager=True,
                             shutdown_timeout_s=30, extra_args=("--dtype", "bfloat16"))
    text = random_prompt(401, 420)
    runs, metrics, logs = [], [], []
    for name, kvtier in (("first", write_back), ("restarted", disk)):
        spec = dataclasses.replace(with_kvtier, kv_transfer_config=transfer_config(kvtier))
        with Server(spec, tmp_path / f"{name}.log").start(600) as server:
            ids = _token_ids(server.base_url, server.served_model, text)
            runs.append(_complete(server.base_url, server.served_model, ids))
            metrics.append(served_metrics(server.base_url))
        # leaving the block sent SIGTERM; the server stopped gracefully (--shutdown-timeout 30)
        logs.append((tmp_path / f"{name}.log").read_text(errors="replace"))
        assert "Illegal instruction" not in logs[-1]
    assert "shutdown flush wrote" in logs[0], f"the graceful stop did not flush:\n{logs[0][-3000:]}"
    assert metrics[0].get("kvtier_saved_tokens_total", 0) >= 768
    assert metrics[0].get("kvtier_dirty_bytes", 0) > 0  # write-back: only in DRAM until the stop
    loaded = int(metrics[1].get("kvtier_loaded_tokens_total{disk}", 0))
    assert loaded == (len(ids) - 1) // 128 * 128 >= 768, "the restarted server must load every full chunk from disk"
    assert metrics[1].get("vllm:external_prefix_cache_hits_total", 0) == loaded
    assert runs[0]["tokens"] == runs[1]["tokens"]  # the cold run agrees on the tokens ...
    assert max(abs(a - b) for a, b in zip(runs[0]["logprobs"], runs[1]["logprobs"])) < TOLERANCE  # ... within bf16

    without = dataclasses.replace(with_kvtier, kv_transfer_config=None)
    with Server(without, tmp_path / "reference.log").start(600) as server:
        _complete(server.base_url, server.served_model, ids[:loaded], max_tokens=1)  # vLLM caches exactly that prefix
        before = served_metrics(server.base_url)
        reference = _complete(server.base_url, server.served_model, ids)
        cached = served_metrics(server.base_url).get("vllm:prefix_cache_hits_total", 0) - before.get(
            "vllm:prefix_cache_hits_total", 0)
    assert cached == loaded, "the reference must compute the same tail over its own cached prefix"
    assert runs[1]["tokens"] == reference["tokens"]
    assert runs[1]["logprobs"] == reference["logprobs"]  # bit for bit, no tolerance
