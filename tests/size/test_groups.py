"""``kvtier size`` per layer kind (vLLM's KV cache groups of a hybrid model): full attention holds
every token, a sliding window only its window, a state a constant per sequence.  Byte counts are
checked against vLLM's own spec objects and state-shape calculator for the hybrid test models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.launch.testmodel import config_json
from kvtier.size.hf_config import geometry_from_config
from kvtier.size.presets import find_preset


def test_group_bytes_add_up_to_the_sequence_bytes():
    for name in ("google/gemma-3-27b-it", "Qwen/Qwen3-Next-80B-A3B-Instruct", "openai/gpt-oss-120b"):
        g = find_preset(name).geometry()
        for tp in (1, 2):
            groups = g.groups(tp, 2)
            assert len(groups) == 2
            for context in (100, 5000, 100_000):
                assert sum(x.bytes_per_sequence(context) for x in groups) == g.bytes_per_sequence(context, tp, 2)
    gemma = {x.kind: x for x in find_preset("google/gemma-3-27b-it").geometry().groups(1, 2)}
    assert gemma["sliding"].held_tokens == 1024
    assert gemma["sliding"].bytes_per_sequence(50_000) == gemma["sliding"].bytes_per_sequence(1024)
    assert gemma["full"].bytes_per_sequence(50_000) == 50 * gemma["full"].bytes_per_sequence(1000)
    plain = find_preset("meta-llama/Llama-3.1-8B-Instruct").geometry()
    assert [x.kind for x in plain.groups(1, 2)] == ["full"]


def test_lfm2_short_conv_state_matches_vllm_state_shape():
    pytest.importorskip("vllm")
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import MambaSpec

    cfg = config_json("tiny-conv")
    g = geometry_from_config(cfg, "tiny-conv")
    assert (g.num_full_layers, g.num_state_layers, g.state.kind) == (2, 2, "short_conv")
    for tp in (1, 2):
        shapes = MambaStateShapeCalculator.short_conv_state_shape(tp, cfg["conv_dim"], cfg["conv_L_cache"])
        # the config's float32 runs in bf16 under --dtype auto (vllm/config/model.py "Downcast for float32
        # models"), the state too (mamba_cache_dtype auto: the model's dtype)
        spec = MambaSpec(block_size=32, shapes=shapes, dtypes=(torch.bfloat16,))
        assert g.state_bytes_per_sequence(tp) == 2 * spec.page_size_bytes * tp  # 2 layers, all ranks
    state = {x.kind: x for x in g.groups(1, 4)}["state"]
    assert state.bytes_per_token == 0 and state.bytes_per_sequence(10) == state.bytes_per_sequence(10_000) == 2048


def test_sliding_window_test_model_matches_vllm_page_sizes():
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    g = geometry_from_config(config_json("tiny-swa"), "tiny-swa")
    groups = {x.kind: x for x in g.groups(1, 4)}
    block = 32
    full = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64)
    assert groups["full"].bytes_per_token == 2 * full.page_size_bytes // block  # 2 layers
    assert groups["sliding"].bytes_per_token == 2 * swa.page_size_bytes // block
    assert groups["sliding"].held_tokens == 64


def test_cli_reports_groups_for_hybrids_only(tmp_path: Path):
    runner = CliRunner()
    (tmp_path / "config.json").write_text(json.dumps(config_json("tiny-conv")))
    result = runner.invoke(app, ["size", "--model", str(tmp_path), "--json"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    groups = json.loads(result.stdout)["groups"]
    assert [(x["kind"], x["num_layers"]) for x in groups] == [("full", 2), ("state", 2)]
    assert groups[0]["bytes_per_token"] == 2 * 2 * 2 * 64 * 2  # bf16 KV: K and V × heads × head × layers
    assert groups[1]["state_bytes_per_sequence"] == 2 * 2 * 256 * 2  # conv state of width 256, float32 run in bf16
    text = runner.invoke(app, ["size", "--model", str(tmp_path)], env={"COLUMNS": "200"})
    assert "state (2 layers)" in text.stdout and "per sequence, whatever its length" in text.stdout
    (tmp_path / "config.json").write_text(json.dumps(config_json("tiny")))
    plain = runner.invoke(app, ["size", "--model", str(tmp_path), "--json"], env={"COLUMNS": "200"})
    assert json.loads(plain.stdout)["groups"] == []
