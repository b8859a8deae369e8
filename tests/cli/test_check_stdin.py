"""``kvtier check -`` with standard input closed: one sentence and exit 2, not a traceback (second tester)."""

from __future__ import annotations

import shlex
import subprocess
import sys


def test_check_with_a_closed_stdin_is_one_sentence() -> None:
    command = f"{shlex.quote(sys.executable)} -m kvtier.cli.main check - <&-"
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert "standard input is closed" in result.stderr and "Traceback" not in result.stderr
