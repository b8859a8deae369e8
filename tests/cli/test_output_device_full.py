"""A command whose output goes to a full device (``> out.json`` on a full file system) ends with one
sentence and exit 2, never a traceback. Linux's /dev/full is a real device on which every write
fails with ENOSPC (tester3: ``kvtier size --json > /dev/full`` ended in an OSError traceback from
print, ``kvtier audit`` in one from rich)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DOCTOR = Path(__file__).resolve().parents[1] / "doctor" / "data" / "kvtier-cpu"


@pytest.mark.parametrize("args", [
    ["size", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--json"],
    ["size", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--offload-gib", "100"],
    ["audit", "-", "--vllm-version", "0.32.0"],
    ["doctor", "--from-files", str(DOCTOR / "before.txt"), str(DOCTOR / "after.txt")],
])
def test_stdout_on_a_full_device_is_one_sentence_exit_2(args):
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args], stdout=full, stderr=subprocess.PIPE,
                              input="vllm serve Qwen/Qwen3-8B --cpu-offload-gb 40\n" if args[0] == "audit" else None,
                              text=True, check=False, timeout=120, env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("error: a write failed: No space left on device; free space on that device (or send the "
                           "output elsewhere) and run it again\n")
