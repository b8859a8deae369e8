"""``kvtier bench compare --max-model-len`` longer than a local model's context window (user41's
review): every arm's vLLM server refused it after its start-up (vLLM's _get_and_verify_max_len);
now one sentence, exit 2, before any server starts."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.bench.test_bench_failures import WORKLOAD, error_line


def test_compare_refuses_a_max_model_len_past_the_models_window_before_any_server_starts(tmp_path):
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="none", seed=0)
    window = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "compare", "--model", str(model),
                          "--arms", "baseline", "--max-model-len", str(2 * window), "--engine-cache-tokens",
                          str(2 * window), *WORKLOAD, "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=120, check=False)
    line = error_line(out)
    assert (f"error: --max-model-len {2 * window} is longer than {model}'s context window, {window} tokens "
            "(max_position_embeddings in its config.json)") in line, line
    assert f"give --max-model-len {window} or less" in line
    assert "starting" not in out.stdout.lower() and not any((tmp_path / "r").iterdir())


def test_vllms_override_is_left_to_the_arms(tmp_path):
    """With VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (which every arm's server inherits) vLLM serves past the window:
    the check stands aside; --json in a missing directory then stops the run before any server starts."""
    import os

    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="none", seed=0)
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "compare", "--model", str(model),
                          "--arms", "baseline", "--max-model-len", "8192", "--engine-cache-tokens", "8192", *WORKLOAD,
                          "--out", str(tmp_path / "r"), "--json", str(tmp_path / "missing" / "x.json")],
                         capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    line = error_line(out)
    assert "context window" not in line and "missing" in line, line
