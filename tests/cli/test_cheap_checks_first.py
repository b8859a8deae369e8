"""Cheap argument checks come before heavy imports: ``kvtier demo --workdir FILE`` imported vLLM
(~25 s on a busy host) before refusing the file in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_demo_refuses_a_file_as_workdir_without_importing_vllm(tmp_path):
    workdir = tmp_path / "empty.jsonl"
    workdir.write_text("")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvtier.cli.main", "demo", "--workdir",
                          str(workdir)], capture_output=True, text=True, check=False, timeout=120, env=env)
    elapsed_s = time.monotonic() - start
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    said = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
    assert out.returncode == 2, out.stderr[-2000:]
    assert said == [f"error: --workdir {str(workdir)!r} is a file, not a directory; pass a directory"], said
    assert "vllm" not in imported and "torch" not in imported, sorted(m for m in imported if "vllm" in m)[:5]
    assert elapsed_s < 10, elapsed_s  # it was ~25 s with vLLM imported first


def test_an_output_path_under_a_file_says_the_file_is_not_a_directory(tmp_path):
    """``trace record --out FILE/x.jsonl`` said "directory FILE does not exist" of an existing file."""
    blocker = tmp_path / "empty.jsonl"
    blocker.write_text("")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "trace", "record", "--url", "http://127.0.0.1:9",
                          "--out", str(blocker / "x.jsonl")], capture_output=True, text=True, check=False, timeout=120,
                         env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr == (f"error: --out {blocker / 'x.jsonl'}: directory {blocker} is a file, not a directory; create "
                          "it or pass a path in an existing directory\n"), out.stderr
