"""Static checks that keep the code and its docs from drifting: ruff over everything, mypy over
the whole package (issue 20: the core is the contract every other package builds on, and the
integrations and tools are checked against it).  Versions are pinned
in pyproject's ``dev`` extra so a new linter release cannot change the verdict."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def test_ruff_clean():
    result = run("ruff", "check", "src", "tests", "scripts")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_whole_package_types_check():
    result = run("mypy", "src/kvtier")
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


def _module_name(path: Path, root: Path) -> str:
    """Dotted name of a source file under ``root`` (``root/a/b.py`` -> ``a.b``; a package's ``__init__`` -> the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, for every ``*.py`` under ``root`` (the
    directory holding ``package``), read from the AST.

    Every ``import`` statement counts, wherever it stands: at module level, under ``if
    TYPE_CHECKING:`` and inside functions.  A lazy or type-only import is still an arrow a reader
    follows and a layer the importer leans on; a circle of them is a design circle even when Python
    happens to run it.  ``from a import b`` counts as importing ``a.b`` when that is a module, else
    ``a``; a module's parent packages are not added (Python imports them, but their ``__init__``
    modules are kept free of imports that would close a circle).  Imports by string
    (``importlib.import_module``, the tier registry's ``"module:function"`` records) are not
    imports here: they are the plug-in points.
    """
    import ast

    modules = {_module_name(p, root): p for p in (root / package).rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                candidates = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            targets.update(t for c in candidates if c.split(".")[0] == package and (t := known(c)) and t != name)
        graph[name] = targets
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (``[a, b, ..., a]``: a imports b ... imports a), or None."""
    import graphlib

    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(reversed(exc.args[1]))  # graphlib lists it against the arrows
    return None


def test_kvtier_has_no_import_circles():
    """Arrows point down (issue 20 item 4): no kvtier module imports, however indirectly, a module
    that imports it back.  See :func:`import_graph` for what counts as an import."""
    cycle = import_cycle(import_graph(ROOT / "src", "kvtier"))
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_import_circle_check_finds_a_circle(tmp_path):
    """The check above sees a circle closed by a lazy import and one closed under TYPE_CHECKING,
    and passes a package without one."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "sub" / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "a.py").write_text("from pkg.sub import b\n", encoding="utf-8")
    (pkg / "sub" / "b.py").write_text("import os\n", encoding="utf-8")
    assert import_cycle(import_graph(tmp_path, "pkg")) is None
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import X\n", encoding="utf-8")
    assert import_cycle(import_graph(tmp_path, "pkg")) in (["pkg.a", "pkg.sub.b", "pkg.a"],
                                                            ["pkg.sub.b", "pkg.a", "pkg.sub.b"])
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
                                      encoding="utf-8")
    assert import_cycle(import_graph(tmp_path, "pkg")) is not None


TIER_MODULES = ("src/kvtier/core/tiers/cpu/", "src/kvtier/core/tiers/disk/", "src/kvtier/core/tiers/redis/",
                "src/kvtier/core/tiers/s3/", "src/kvtier/core/tiers/node/", "src/kvtier/core/tiers/registry.py")
"""A tier's own package (every module under it) and the registry: the only places that may name a tier."""

TIER_NAME_ALLOWED = {
    "src/kvtier/integrations/vllm/worker/registration.py": ({"cpu"}, "a torch device type, not a tier"),
    "src/kvtier/bench/storebench.py": ({"cpu", "disk"}, ("bench-store's report rows (user-facing output) "
                                       "name the tier each measures")),
    "src/kvtier/bench/redisbench.py": ({"redis"}, "bench-store's redis report row (user-facing output)"),
    "src/kvtier/bench/s3bench.py": ({"s3"}, "bench-store's s3 report row (user-facing output)"),
    "src/kvtier/cli/bench_compare.py": ({"redis", "s3"}, "directory names of the bench's own redis-server and S3 server"),
    "src/kvtier/bench/shared_s3.py": ({"s3"}, "rclone's subcommand `rclone serve s3`, not a tier"),
    "src/kvtier/simulate/recommend.py": ({"cpu", "disk"}, "the simulator's hardware model"),
    "src/kvtier/simulate/report.py": ({"cpu", "disk"}, "the simulator's hardware model (report keys)"),
    "src/kvtier/cli/node.py": ({"node"}, "the `kvtier node` command's name (the node tier's owner)"),
    "src/kvtier/size/compression.py": ({"disk"}, "the disk tier --compression-ratio disk=R names (user-facing input)"),
    "src/kvtier/size/recipe.py": ({"redis"}, "the size recipe's redis-server section (user-facing output)"),
}
"""Files that may hold a built-in tier's name as a string, with what it means there."""


def _string_literals(path: Path) -> list[tuple[int, str]]:
    """``(line, value)`` of the string constants of a source file, docstrings excluded (docs text)."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_tier_names_appear_only_in_their_modules_and_the_registry():
    """Everything that differs per tier is read from the registry (issue 20 item 1): a string equal to a
    built-in tier's name is allowed only in the tier's own modules, the registry and the allow-list above."""
    from kvtier.core.tiers.registry import BUILTIN

    names = {s.name for s in BUILTIN}
    wrong = []
    for path in sorted((ROOT / "src" / "kvtier").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel.startswith(TIER_MODULES):
            continue
        allowed = TIER_NAME_ALLOWED.get(rel, (set(), ""))[0]
        wrong += [f"{rel}:{line}: {value!r}" for line, value in _string_literals(path)
                  if value in names and value not in allowed]
    assert not wrong, "tier names outside their modules and the registry (read them from the registry):\n" + \
        "\n".join(wrong)
    stale = [rel for rel, (allowed, _why) in TIER_NAME_ALLOWED.items()
             if not any(v in allowed for _line, v in _string_literals(ROOT / rel))]
    assert not stale, f"allow-list entries no longer needed: {stale}"


def test_the_tier_name_check_finds_a_literal(tmp_path):
    """The scan above sees a tier name in code (and not in a docstring)."""
    probe = tmp_path / "probe.py"
    probe.write_text('"""the "disk" tier."""\nTIER = "disk"\n', encoding="utf-8")
    assert _string_literals(probe) == [(2, "disk")]


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
    # a Server whose argv the test replaces (``server.command = [...]``: a toy process) starts no vLLM
    toy = any(isinstance(sub, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "command"
                                                   for t in sub.targets) for sub in ast.walk(node))  # type: ignore[arg-type]
    if names & ENGINE_STARTS or ("Server" in names and names & {"start", "launch"} and not toy):
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


MAX_LINES = 400
"""The longest a source file may be (issue 33: no file in src/kvtier over 400 lines)."""

SIZE_CHECKED = ("src/kvtier",)
"""The whole package is held to :data:`MAX_LINES` (issue 33: "no file in src/kvtier over 400 lines";
until 2026-12-06 only ``core`` and ``integrations/vllm`` were, and ``cli/size.py`` had grown to 404)."""


def test_files_of_the_checked_packages_stay_under_the_line_limit():
    """A file that outgrows the limit is split by concept (the vLLM integration: a scheduler and a
    worker package), not arbitrarily."""
    long = [f"{path.relative_to(ROOT)}: {n} lines" for package in SIZE_CHECKED
            for path in sorted((ROOT / package).rglob("*.py"))
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)


def _files_with_engine_tests() -> set[str]:
    """Test files where ``pytest.mark.engine`` appears (module mark, decorator or ``pytest.param`` marks)."""
    import ast

    return {str(path.relative_to(ROOT)) for path in sorted((ROOT / "tests").rglob("test_*.py"))
            if any(isinstance(n, ast.Attribute) and n.attr == "engine" and ast.unparse(n).endswith("mark.engine")
                   for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))}


def _makefile_engine_tests() -> list[str]:
    """The Makefile's ``ENGINE_TESTS`` list (the files ``make test``'s engine phases collect)."""
    import re

    text = (ROOT / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    found = re.search(r"^ENGINE_TESTS :=(.*)$", text, re.MULTILINE)
    assert found, "the Makefile has no ENGINE_TESTS list"
    return found.group(1).split()


def test_every_ordering_entry_names_a_test():
    """tests/conftest.py's ``PHASE_2_SECONDS`` and ``PHASE_1_SECONDS`` order ``make test``'s first two
    phases: an entry whose test was renamed or moved would silently lose its place, so each must name a
    test function in its file (one of the Makefile's ``ENGINE_TESTS`` files for the second phase)."""
    from tests.conftest import PHASE_1_SECONDS, PHASE_2_SECONDS

    listed = set(_makefile_engine_tests())
    for nodeid in [*PHASE_2_SECONDS, *PHASE_1_SECONDS]:
        path, name = nodeid.split("::")
        assert nodeid in PHASE_1_SECONDS or path in listed, f"{nodeid}: not in an ENGINE_TESTS file"
        assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text(encoding="utf-8"), f"no test {nodeid}"
        # the second phase runs only `engine and shares_cpu`: an entry for a test that left it orders the third
        assert nodeid in PHASE_1_SECONDS or _shares_cpu(path, name.split("[")[0]), \
            f"{nodeid}: not marked shares_cpu, so not in make test's second phase; remove it from PHASE_2_SECONDS"


def _shares_cpu(path: str, name: str) -> bool:
    """Whether test ``name`` of ``path`` is marked ``shares_cpu``: by its module's ``pytestmark`` or its own
    decorators."""
    import ast

    def marked(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Attribute) and ast.unparse(n).endswith("mark.shares_cpu") for n in ast.walk(node))

    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    for node in tree.body:
        module_mark = isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                           for t in node.targets)
        if module_mark and marked(node):
            return True
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return any(marked(d) for d in node.decorator_list)
    return False


def test_the_engine_phases_collect_every_file_that_holds_an_engine_test():
    """``make test``'s second and third phases collect only the Makefile's ``ENGINE_TESTS``: an
    engine test in a file left out there would never run in CI, and a listed file without one only
    costs collection time."""
    listed = _makefile_engine_tests()
    marked = _files_with_engine_tests()
    assert len(marked) > 10, f"the scan found too few engine test files: {sorted(marked)}"
    assert not marked - set(listed), f"add these to the Makefile's ENGINE_TESTS: {sorted(marked - set(listed))}"
    assert not set(listed) - marked, f"no engine test in these ENGINE_TESTS files: {sorted(set(listed) - marked)}"
    assert len(listed) == len(set(listed)), "a file is listed twice in ENGINE_TESTS"
