"""The audit's engine-cache rules on a TP size vLLM (and ``kvtier size``) refuse for the model.

Seen: ``vllm serve Qwen/Qwen3-8B --kv-offloading-size 64 --tensor-parallel-size 3`` audited with
``--gpu H100`` warned that 64 GiB "is not larger than the engine's KV cache of 188 GiB (Qwen/Qwen3-8B
at TP 3 on H100, as kvtier size computes it)", while ``kvtier size --model Qwen/Qwen3-8B --tp 3``
refuses TP 3 (it does not divide the 32 attention heads): no such figure exists."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app

runner = CliRunner()


def findings(line: str, *args: str) -> dict[str, str]:
    result = runner.invoke(app, ["audit", "-", "--vllm-version", "0.32.0", "--format", "json", *args], input=line)
    assert result.exit_code in (0, 1), result.output
    return {f["rule"]: f["message"] for f in json.loads(result.stdout)["findings"]}


@pytest.mark.parametrize("gpu", [("--gpu", "H100"), ()])
@pytest.mark.parametrize("tp", ["3", "64"])
def test_a_refused_tp_is_named_not_sized(tp, gpu):
    size = runner.invoke(app, ["size", "--model", "Qwen/Qwen3-8B", "--tp", tp])
    assert size.exit_code == 2 and "does not divide the 32 attention heads" in size.output, size.output
    found = findings(f"vllm serve Qwen/Qwen3-8B --kv-offloading-backend native --kv-offloading-size 64 "
                     f"--tensor-parallel-size {tp}", *gpu)
    assert "cpu-tier-not-above-engine-cache" not in found, found
    assert f"TP {tp} does not divide the 32 attention heads" in found["cpu-tier-vs-engine-cache-unknown"], found


def test_a_tp_size_vllm_accepts_is_still_sized():
    found = findings("vllm serve Qwen/Qwen3-8B --kv-offloading-backend native --kv-offloading-size 64 "
                     "--tensor-parallel-size 2", "--gpu", "H100")
    assert "engine's KV cache of 120 GiB (Qwen/Qwen3-8B at TP 2 on H100" in found["cpu-tier-not-above-engine-cache"]
