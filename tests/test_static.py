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


# What starts a real vLLM engine in a test (directly or through a fixture of the same module).
ENGINE_STARTS = {"run_engine", "start_server", "LLM", "run_compare", "run_restart_demo", "_serve_refused", "probe"}
"""Calls that start vLLM; kvtier's ``Server`` launcher counts where the same function starts it."""
ENGINE_SCRIPTS = ("engine_runner.py", "native_runner.py", "hybrid_probe.py", "vllm.entrypoints.openai.api_server")


def _starts_engine(node: object) -> bool:
    import ast

    names = set()
    for sub in ast.walk(node):  # type: ignore[arg-type]
        if isinstance(sub, ast.Call):
            f = sub.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    if names & ENGINE_STARTS or ("Server" in names and names & {"start", "launch"}):
        return True
    for sub in ast.walk(node):  # type: ignore[arg-type]
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value.endswith(ENGINE_SCRIPTS):
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "with_name" \
                and sub.args and isinstance(sub.args[0], ast.Constant) and str(sub.args[0].value).endswith(ENGINE_SCRIPTS):
            return True
    return False


def _marked_engine(decorators: list[object]) -> bool:
    import ast

    return any("mark.engine" in ast.unparse(d) for d in decorators)  # type: ignore[arg-type]


def test_every_test_that_starts_a_vllm_engine_carries_the_engine_marker():
    """``make test-fast`` (-m "not engine") must never start vLLM, and the engine lock rule relies
    on the marker: a test that starts an engine itself or through a fixture of its module is marked."""
    import ast

    unmarked = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                            and "mark.engine" in ast.unparse(n.value) for n in tree.body)
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        starters = {name for name, fn in functions.items() if _starts_engine(fn)}
        for name, fn in functions.items():
            if not name.startswith("test_") or module_marked or _marked_engine(fn.decorator_list):
                continue
            uses = {a.arg for a in fn.args.args} | {
                getattr(c.func, "id", "") for c in ast.walk(fn) if isinstance(c, ast.Call)}
            if name in starters or uses & starters:
                unmarked.append(f"{path.relative_to(ROOT)}::{name}")
    assert unmarked == [], f"these tests start vLLM without @pytest.mark.engine: {unmarked}"
