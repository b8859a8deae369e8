"""Static checks that keep the code and its docs from drifting: ruff over everything, mypy over
the engine-independent core (the contract every other package builds on).  Versions are pinned
in pyproject's ``dev`` extra so a new linter release cannot change the verdict."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def test_ruff_clean():
    result = run("ruff", "check", "src", "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_core_types_check():
    result = run("mypy", "src/kvtier/core")
    assert result.returncode == 0, result.stdout + result.stderr
