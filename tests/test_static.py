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


def _kvtier_imports(path: Path) -> set[str]:
    """Every ``kvtier.*`` module a source file imports (top level or inside functions)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvtier"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("kvtier"))
    return names


def test_imports_point_down():
    """core imports only core; no library package imports the CLI (the arrow never runs up)."""
    src = ROOT / "src" / "kvtier"
    wrong = []
    for path in sorted(src.rglob("*.py")):
        package = path.relative_to(src).parts[0]
        for name in _kvtier_imports(path):
            if package == "core" and not name.startswith("kvtier.core"):
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
            if package != "cli" and name.startswith("kvtier.cli"):
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)
