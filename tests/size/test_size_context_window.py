"""``kvtier size --context`` against the model's context window (user41's review).

A session longer than the model's window cannot exist (vLLM refuses a ``--max-model-len`` above it),
yet size planned tiers for it and printed a serve line: the test model (4,096 positions) at
``--context 100000`` got 709 sessions in HBM and a 110 GiB cpu tier.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.size.test_size_hardening import _json, run


def _tiny(tmp_path: Path) -> Path:
    from kvtier.launch.testmodel import write_model

    return write_model(tmp_path / "tiny", "tiny", weights="none", seed=0)


def test_a_context_longer_than_the_models_window_is_refused_in_one_sentence(tmp_path: Path):
    model = _tiny(tmp_path)
    window = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    for fmt in ((), ("--json",)):
        result = run("--model", str(model), "--gpu", "L4", "--context", str(window + 1), "--sessions", "1000", *fmt)
        assert result.exit_code == 2, result.output
        line = " ".join(result.output.split())
        assert f"{window:,} tokens (max_position_embeddings" in line and f"--context {window} or less" in line, line
        assert "vllm serve" not in result.output and "Traceback" not in result.output
    assert _json("--model", str(model), "--gpu", "L4", "--context", str(window), "--sessions", "10000",
                 "--weights-gib", "0.01")["recipe"]


def test_the_window_is_read_as_vllm_reads_it(tmp_path: Path):
    """The smallest length key wins, a linear RoPE factor scales it, llama3/yarn factors do not (vLLM's
    _get_and_verify_max_len), a text_config's keys count, and a config without one is not checked."""
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
    cases = (({"max_position_embeddings": 8192, "seq_length": 2048}, 2048),
             ({"max_position_embeddings": 2048, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 8192),
             ({"max_position_embeddings": 2048, "rope_scaling": {"type": "dynamic", "factor": 2}}, 4096),
             ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
             ({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0}}, 32768),
             ({"text_config": {"max_position_embeddings": 1024}}, 1024))
    config = tmp_path / "config.json"
    for extra, window in cases:
        config.write_text(json.dumps({**base, **extra}))
        assert run("--model", str(config), "--context", str(window), "--sessions", "1",
                   "--offload-gib", "1").exit_code == 0, extra
        refused = run("--model", str(config), "--context", str(window + 1), "--sessions", "1", "--offload-gib", "1")
        assert refused.exit_code == 2 and f"{window:,} tokens" in refused.output, (extra, refused.output)
    config.write_text(json.dumps(base))  # no length key: vLLM assumes 2,048 and warns; size does not guess
    assert run("--model", str(config), "--context", "100000", "--sessions", "1", "--offload-gib", "1").exit_code == 0


def test_vllms_override_lets_a_longer_context_through(tmp_path: Path, monkeypatch):
    """vLLM serves past the window with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (vllm/envs.py): then size plans it."""
    model = _tiny(tmp_path)
    refused = run("--model", str(model), "--context", "8192", "--sessions", "1", "--offload-gib", "1")
    assert refused.exit_code == 2 and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in " ".join(refused.output.split())
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert run("--model", str(model), "--context", "8192", "--sessions", "1", "--offload-gib", "1").exit_code == 0
