"""``kvtier size`` defects a new user met following only the docs, through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.audit.test_cli_audit import kvtier as audit
from tests.size.test_size_hardening import _json, run


def _extra(recipe_line: str) -> dict:
    quoted = recipe_line.split("--kv-transfer-config ", 1)[1].strip().strip("'")
    return json.loads(quoted)["kv_connector_extra_config"]


def test_state_models_get_chunk_tokens_auto_and_the_recipe_audits_clean(tmp_path: Path):
    data = _json("--model", "Qwen/Qwen3-Next-80B-A3B-Instruct", "--tp", "4", "--gpu", "H100", "--offload-gib", "700")
    assert _extra(data["recipe"]["kvtier"])["chunk_tokens"] == "auto"
    proc = audit("-", "--vllm-version", "0.32.0", "--format", "json", stdin=data["recipe"]["kvtier"])
    assert "kvtier-chunk-tokens-below-state-block" not in proc.stdout
    tiny = tmp_path / "tiny-next"
    subprocess.run([sys.executable, "-m", "kvtier.launch.testmodel", "--geometry", "tiny-next", "--out", str(tiny),
                    "--weights", "none"], check=True, capture_output=True)
    assert _extra(_json("--model", str(tiny), "--offload-gib", "4")["recipe"]["kvtier"])["chunk_tokens"] == "auto"
    given = _json("--model", str(tiny), "--offload-gib", "4", "--chunk-tokens", "4096")  # above its state block
    assert _extra(given["recipe"]["kvtier"])["chunk_tokens"] == 4096
    assert any("--chunk-tokens 4096: this model keeps Mamba" in n for n in given["notes"])
    # one shorter than the state block: a recipe the audit refuses is not printed (docs/size.md § Errors)
    refused = run("--model", str(tiny), "--offload-gib", "4", "--chunk-tokens", "128", "--json")
    assert refused.exit_code == 2 and refused.stdout == "", refused.output
    assert "(kvtier-chunk-tokens-below-state-block)" in refused.stderr, refused.stderr
    # an attention-only model keeps 128
    assert _extra(_json("--model", "meta-llama/Llama-3.1-8B", "--offload-gib", "4")["recipe"]["kvtier"])[
        "chunk_tokens"] == 128


def test_no_recipe_for_an_engine_that_would_not_start():
    for args in (("--model", "google/gemma-2-9b-it", "--gpu", "L4", "--context", "8192", "--sessions", "100",
                  "--host-ram-gib", "256"),
                 ("--model", "meta-llama/Llama-3.1-8B", "--gpu", "L4", "--context", "1000000", "--sessions", "1"),
                 ("--model", "google/gemma-2-9b-it", "--gpu", "L4", "--offload-gib", "100")):
        for fmt in ((), ("--json",)):
            result = run(*args, *fmt)
            assert result.exit_code == 2, result.output
            assert "vLLM would not start" in result.output and "--tp" in result.output
            assert "vllm serve" not in result.output and "Traceback" not in result.output
    assert _json("--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--context", "8192", "--sessions", "100")[
        "recipe"] is not None


def test_a_storage_dtype_is_read_as_vllm_reads_it_with_a_note(tmp_path: Path):
    """vLLM's dtype=auto falls back to bf16 for a dtype it does not run in (vllm/config/model.py
    _resolve_auto_dtype); size did the same silently, and the docs promised a refusal."""
    base = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    for key, name in (("torch_dtype", "int8"), ("torch_dtype", "uint8"), ("torch_dtype", "float8_e4m3fn"),
                      ("torch_dtype", "torch.int8"), ("dtype", "int8")):
        config = tmp_path / "config.json"
        config.write_text(json.dumps({**base, key: name}))
        data = _json("--model", str(config))
        assert data["kv_dtype"] == "auto (bf16)" and data["kv_bytes_per_token_tp1"] == 131072
        assert any(f"{key} {name!r}" in n and "falls back to bf16" in n for n in data["notes"]), data["notes"]
    config.write_text(json.dumps({**base, "torch_dtype": "bfloat16"}))
    assert not any("falls back" in n for n in _json("--model", str(config))["notes"])
    config.write_text(json.dumps({**base, "torch_dtype": "banana"}))
    result = run("--model", str(config))
    assert result.exit_code == 2 and "'banana'" in result.output and "Traceback" not in result.output


def test_trace_flags_without_a_trace_are_refused():
    for extra in (("--tokens-per-block", "128"), ("--trace-format", "kvtier-jsonl")):
        result = run("--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--context", "8192", "--sessions", "10",
                     *extra)
        assert result.exit_code == 2 and "describe --trace; give --trace FILE or drop them" in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_notes_state_the_tables_figures_not_whole_gib(tmp_path: Path):
    trace = tmp_path / "chat.jsonl"
    subprocess.run([sys.executable, "-m", "kvtier.cli.main", "trace", "synth", "--regime", "chat", "--out", str(trace),
                    "--requests", "300"], check=True, capture_output=True)
    data = _json("--model", "meta-llama/Llama-3.1-8B", "--gpu-memory-gib", "22", "--weights-gib", "15", "--trace",
                 str(trace), "--host-ram-gib", "33", "--nvme-gib", "100", "--disk-gb-per-s", "100")
    warm = data["warm_set_bytes"] / 2**30
    assert 1 < warm < 2 and data["disk_gib"] == round(warm, 2)  # the figure the old notes printed as "1 GiB"
    text = f"{warm:,.2f}".rstrip("0").rstrip(".")
    assert any(n.startswith(f"Disk tier {text} GiB") for n in data["notes"]), data["notes"]
    assert any(f"(the warm set is {text} GiB)" in n for n in data["notes"]), data["notes"]
