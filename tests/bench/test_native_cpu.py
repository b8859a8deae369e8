"""The benchmark-only CPU shim for vLLM's OffloadingConnector (the ``native`` arm) is faithful: a
prompt served from the native CPU tier gives the tokens and logprobs of its computed first run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.shares_cpu]


def test_native_cpu_tier_serves_exact_kv(tmp_path: Path) -> None:
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="random", seed=0)
    out = tmp_path / "out.json"
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("native_runner.py")), str(model), str(out)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    first, reference, second = data["runs"]
    assert first["cached"] == 0
    # whole 32-token blocks of the prompt: from vLLM's own cache, then back from the native CPU tier
    assert reference["cached"] == second["cached"] == (second["prompt_tokens"] - 1) // 32 * 32 > 0
    assert data["counters"]["vllm:external_prefix_cache_hits_total"] == second["cached"]
    # the exact reference: vLLM's own prefix cache holding the same bytes (the prefix computed once,
    # alone), the same tail computed (a cold prefill of the whole prompt differs in the last bits on
    # an AMD EPYC host)
    assert second["tokens"] == reference["tokens"]
    assert second["logprobs"] == reference["logprobs"]
