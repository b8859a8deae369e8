"""``kvtier check -`` with standard input closed: one sentence and exit 2, not a traceback (second tester)."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest


def test_check_with_a_closed_stdin_is_one_sentence() -> None:
    command = f"{shlex.quote(sys.executable)} -m kvtier.cli.main check - <&-"
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert "standard input is closed" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(("source", "text", "message"), [
    ("-", "", "standard input is empty; it must hold the --kv-transfer-config JSON object."),
    ("-", "{bad\n", "standard input is not valid JSON at line 1 column 2; check its braces, commas and quotes."),
    ("file", "", "'{path}' is empty; it must hold the --kv-transfer-config JSON object."),
    ("file", '{"kv_connector": "KVTierConnector",,}',
     "'{path}' is not valid JSON at line 1 column 36; check its braces, commas and quotes."),
])
def test_check_of_a_file_or_stdin_that_is_not_json_names_it(tmp_path, source, text, message) -> None:
    """Empty or broken JSON from a file or stdin was told to "quote it in single quotes on the shell line",
    advice for inline JSON only (tester3)."""
    path = tmp_path / "transfer.json"
    path.write_text(text)
    result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "check", "-" if source == "-" else str(path)],
                            input=text, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: {message.format(path=path)}\n"


SERVE = ("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=35 vllm serve Qwen/Qwen3-8B --shutdown-timeout 30 --kv-transfer-config "
         """'{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier.integrations.vllm","kv_role":"kv_both",'"""
         """'"kv_connector_extra_config":{"cpu_gib":4}}'""")


@pytest.mark.parametrize(("source", "text"), [
    ("inline", SERVE), ("inline", "vllm serve Qwen/Qwen3-8B"), ("inline", "CUDA_VISIBLE_DEVICES=0 python3 -m vllm.entrypoints.cli.main serve M"),
    ("file", "#!/bin/sh\n# the server\nexec " + SERVE + "\n"), ("-", SERVE + "\n")])
def test_check_of_a_serve_line_points_to_audit(tmp_path, source, text) -> None:
    """A whole `vllm serve ...` line, pasted or in serve.sh, was "cannot read '...' (OSError)" or "not valid JSON"
    (fresh-user tester): one sentence saying check takes the --kv-transfer-config JSON and audit takes the line."""
    path = tmp_path / "serve.sh"
    path.write_text(text)
    argument = {"inline": text, "file": str(path), "-": "-"}[source]
    result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "check", argument],
                            input=text, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert "is a vLLM serve command line, but kvtier check takes only the --kv-transfer-config JSON" in result.stderr
    assert "run kvtier audit on the whole serve line" in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_a_missing_file_named_like_vllm_is_still_a_missing_file(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "check", str(tmp_path / "vllm.json")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"error: {str(tmp_path / 'vllm.json')!r} is neither JSON nor an existing file; give the "
                             "JSON, a file holding it, or -.\n"), result.stderr


@pytest.mark.parametrize("text", ["<the --kv-transfer-config JSON>", "paste the --kv-transfer-config value here",
                                  "--kv-transfer-config"])
def test_a_placeholder_naming_the_flag_is_not_a_serve_line(text) -> None:
    """The README's placeholder, given as is, was "the argument is a vLLM serve command line" (the
    flag's name anywhere counted as a serve line); a serve line gives the flag a value."""
    result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "check", "--", text],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"error: {text!r} is neither JSON nor an existing file; give the JSON, a file holding "
                             "it, or -.\n"), result.stderr
