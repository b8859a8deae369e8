"""Shared helpers of the vLLM engine tests (imported by the test modules beside it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

RUNNER = Path(__file__).with_name("engine_runner.py")
PROMPT_WORDS = 200  # about 400 tokens with the tiny model's tokenizer: 6 full chunks of 64


def metrics_snapshot() -> dict[str, float]:
    """``vllm:*prefix_cache*``, preemption and ``kvtier_*`` samples of this process's registry."""
    from tests.integrations.engine_runner import _metrics

    return _metrics()


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def run_engine(spec: dict[str, Any], workdir: Path, name: str, timeout_s: float = 420,
               env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``engine_runner.py`` on ``spec`` in its own process; read the result with :func:`result_of`."""
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - held by the child process
    # the engine core (scheduler) in the runner's process, the worker in its own (engine_runner.py)
    child_env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.Popen([sys.executable, str(RUNNER), str(spec_path), str(workdir / f"{name}.out.json")],
                            stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=workdir)
    proc.timeout_s = timeout_s  # type: ignore[attr-defined]
    return proc


def result_of(proc: subprocess.Popen[bytes], workdir: Path, name: str) -> dict[str, Any]:
    try:
        rc = proc.wait(timeout=getattr(proc, "timeout_s", 420))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = -9
    out = workdir / f"{name}.out.json"
    if rc != 0 or not out.exists():
        tail = (workdir / f"{name}.log").read_text(errors="replace")[-4000:]
        pytest.fail(f"engine {name} exited with {rc}:\n{tail}")
    return json.loads(out.read_text())


def max_logprob_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def live_spec(model: Path, kvtier: dict[str, Any], role: str = "kv_both", cache_tokens: int = 2048,
              env: dict[str, str] | None = None) -> Any:
    """A small ``vllm serve`` (api_server) with KVTierConnector for the live engine tests: float32
    (logprobs compared exactly), eager mode, context 1,024, an engine cache of ``cache_tokens``,
    128-token blocks, one reserved core (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: equal compute threads
    for every engine compared), the dev endpoints on (``POST /reset_prefix_cache``), no graceful
    stop (SIGTERM force-stops the workers: these tests never need the shutdown flush)."""
    from kvtier.launch.serve import ServerSpec, transfer_config

    return ServerSpec(model=str(model), max_model_len=1024, cache_tokens=cache_tokens, block_size=128,
                      load_format=None, kv_transfer_config=transfer_config(kvtier, role), memory_fraction=0.1,
                      enforce_eager=True, shutdown_timeout_s=None, extra_args=("--dtype", "float32"),
                      env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
                           **(env or {})}, reserved_cpus=1)


def one_layer_config(model: Path, block: int = 16, num_blocks: int = 32, layer: str = "model.layers.0.self_attn.attn",
                     kvtier: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """A real vLLM config with one full-attention layer (2 KV heads of 16, fp32) and the KV cache
    config of ``num_blocks`` blocks of ``block`` tokens, KVTierConnector as its connector (``kvtier``:
    its ``kv_connector_extra_config``), no engine.  Returns ``(VllmConfig, KVCacheConfig)``."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", seed=0, max_model_len=256),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=block, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both",
                                            kv_connector_module_path="kvtier.integrations.vllm",
                                            kv_connector_extra_config=dict(kvtier or {})),
        device_config=DeviceConfig("cpu"))
    spec = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=16, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec([layer], spec)])
    return config, kv_cache_config


def one_layer_worker(model: Path, kvtier: dict[str, Any], block: int = 16, num_blocks: int = 32,
                     layer: str = "model.layers.0.self_attn.attn") -> tuple[Any, Any]:
    """A rank-0 worker side (:class:`~kvtier.integrations.vllm.worker.side.WorkerSide`) of
    :func:`one_layer_config`, registered on a fresh KV cache of ``num_blocks`` blocks of ``block``
    tokens (random, seeded, block-major: blocks along dim 0), no engine; ``kvtier``: the connector's
    settings.  Returns ``(worker, cache tensor)``."""
    import torch

    from kvtier.core.config import KVTierConfig
    from kvtier.integrations.vllm.worker.side import WorkerSide

    config, kv_cache_config = one_layer_config(model, block, num_blocks, layer)
    worker = WorkerSide(config, kv_cache_config, KVTierConfig.from_dict(kvtier))
    cache = torch.randn(num_blocks, 2, block, 2, 16, generator=torch.Generator().manual_seed(0))
    worker.register_kv_caches({layer: cache})
    return worker, cache
