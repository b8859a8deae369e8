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
