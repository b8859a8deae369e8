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
