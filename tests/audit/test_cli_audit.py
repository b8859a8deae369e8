"""``kvtier audit`` through the real CLI: formats, exit codes, bad input, the generated rule doc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.audit.report import rules_markdown
from kvtier.audit.rules import RULES

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[2]


def kvtier(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "audit", *args], input=stdin,
                          capture_output=True, text=True, check=False,
                          env={"COLUMNS": "200", "PATH": "/usr/bin",  # the kvtier under test, not another install
                               **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})})


def test_json_format_is_exactly_the_issue_shape_and_errors_exit_1():
    proc = kvtier(str(DATA / "deployment.yaml"), "--format", "json")
    assert proc.returncode == 1
    data = json.loads(proc.stdout)
    assert list(data) == ["findings"]
    assert data["findings"], "the manifest has known problems"
    for finding in data["findings"]:
        assert list(finding) == ["rule", "severity", "message", "fix", "source"]
        assert finding["severity"] in ("error", "warning", "info")
    assert "lmcache-size-mismatch" in {f["rule"] for f in data["findings"]}


def test_warnings_only_exit_0():
    proc = kvtier("-", "--vllm-version", "0.32.0", "--format", "json",
                  stdin="vllm serve Qwen/Qwen3-8B --cpu-offload-gb 40\n")
    assert proc.returncode == 0
    assert [f["rule"] for f in json.loads(proc.stdout)["findings"]] == ["cpu-offload-gb-is-weights"]


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "0", "-2", "0.5", "two"])
def test_a_parallel_size_vllm_refuses_is_a_finding_not_a_traceback(tmp_path, value):
    """--tensor-parallel-size inf / nan ended in an OverflowError / ValueError traceback (exit 1, no
    output); 0, -2 and 0.5 passed silently although vLLM refuses them (tester3)."""
    line = tmp_path / "serve.sh"
    line.write_text(f"vllm serve m --tensor-parallel-size {value} --kv-offloading-backend native "
                    "--kv-offloading-size 64 -pp 2\n")
    proc = kvtier(str(line), "--vllm-version", "0.32.0", "--format", "json")
    assert "Traceback" not in proc.stderr and proc.returncode == 1, proc.stderr
    findings = {f["rule"]: f for f in json.loads(proc.stdout)["findings"]}
    assert findings["parallel-size-invalid"]["message"].startswith(
        f"--tensor-parallel-size {value!r} is not a whole number of at least 1")
    # the sizing rules read the bad TP as 1: 64 GiB over the 2 pipeline ranks only
    assert "32 GiB per rank over 2 ranks" in findings["kv-offloading-size-is-total"]["message"]


@pytest.mark.parametrize(("env", "flags", "rule", "message"), [
    ("", "--kv-offloading-size inf", "kv-offloading-size-invalid",
     "--kv-offloading-size 'inf' is not a positive, finite size in GiB."),
    ("", "--kv-offloading-size nan", "kv-offloading-size-invalid",
     "--kv-offloading-size 'nan' is not a positive, finite size in GiB."),
    ("", "--kv-offloading-size 1e400 -tp 2", "kv-offloading-size-invalid",
     "--kv-offloading-size '1e400' is not a positive, finite size in GiB."),
    ("", "--kv-offloading-size 8 --cpu-offload-gb nan", "cpu-offload-gb-invalid",
     "--cpu-offload-gb 'nan' is not a finite size in GiB of at least 0."),
    ("", "--kv-offloading-size 8 --cpu-offload-gb inf", "cpu-offload-gb-invalid",
     "--cpu-offload-gb 'inf' is not a finite size in GiB of at least 0."),
    ("", "--kv-offloading-size 8 --cpu-offload-gb -4", "cpu-offload-gb-invalid",
     "--cpu-offload-gb '-4' is not a finite size in GiB of at least 0."),
    ("LMCACHE_MAX_LOCAL_CPU_SIZE=nan ", "--kv-offloading-size 8 -tp 2", "lmcache-size-mismatch",
     "LMCACHE_MAX_LOCAL_CPU_SIZE='nan' is not a finite size in GB."),
])
def test_a_non_finite_offload_size_is_an_error(tmp_path, env, flags, rule, message):
    """inf and nan sizes passed with no finding and exit 0 (nan compares false to every bound), or
    printed "inf GiB in total" (tester3)."""
    line = tmp_path / "serve.sh"
    line.write_text(f"{env}vllm serve m --kv-offloading-backend lmcache {flags}\n")
    proc = kvtier(str(line), "--vllm-version", "0.32.0", "--format", "json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    findings = {f["rule"]: f["message"] for f in json.loads(proc.stdout)["findings"]}
    assert findings[rule] == message
    assert "inf GiB" not in proc.stdout and "nan GiB" not in proc.stdout


def test_text_format_lists_rule_fix_and_source():
    proc = kvtier(str(DATA / "serve.sh"), "--vllm-version", "0.32.0")
    assert proc.returncode == 1
    assert "lmcache-inprocess-on-hybrid" in proc.stdout and "fix:" in proc.stdout and "LMCache#3106" in proc.stdout


def test_clean_config_says_no_findings():
    proc = kvtier("-", "--vllm-version", "0.32.0",
                  stdin="vllm serve Qwen/Qwen3-8B --kv-offloading-size 256\n")  # above the engine's cache on any GPU
    assert proc.returncode == 0 and "No findings" in proc.stdout


def test_sarif_is_a_valid_2_1_0_log_with_rules_and_located_results():
    proc = kvtier(str(DATA / "deployment.yaml"), "--format", "sarif")
    assert proc.returncode == 1
    log = json.loads(proc.stdout)
    assert log["version"] == "2.1.0" and "sarif-2.1.0" in log["$schema"]
    (run,) = log["runs"]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == [r.id for r in RULES]
    assert all(r["defaultConfiguration"]["level"] in ("error", "warning", "note") for r in rules)
    assert run["results"]
    for result in run["results"]:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
        assert result["level"] in ("error", "warning", "note") and result["message"]["text"]
        location = result["locations"][0]["physicalLocation"]
        assert location["artifactLocation"]["uri"].endswith("deployment.yaml")
        if "region" in location:
            assert location["region"]["startLine"] >= 1
    assert any("region" in r["locations"][0]["physicalLocation"] for r in run["results"])


@pytest.mark.parametrize("args, stdin, words", [
    (["{data}/missing.yaml"], None, "cannot read"),
    (["-"], "kind: Deployment\nspec: [oops\n", "not valid YAML"),
    (["-", "--vllm-version", "banana"], "vllm serve m\n", "not a version"),
    (["-", "--format", "xml"], "vllm serve m\n", "--format"),
    (["-"], "hello world\n", "neither"),
])
def test_bad_input_is_one_line_and_exit_2(args, stdin, words):
    proc = kvtier(*[a.format(data=DATA) for a in args], stdin=stdin)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_help_has_examples():
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "audit", "--help"], capture_output=True,
                          text=True, check=False, env={"COLUMNS": "200", "PATH": "/usr/bin"})
    assert "Examples" in proc.stdout and "kvtier audit deploy.yaml --format sarif" in proc.stdout


def test_committed_rule_doc_matches_the_rule_data():
    committed = (ROOT / "docs" / "audit-rules.md").read_text()
    assert committed == rules_markdown(), "regenerate with: kvtier audit --rules-markdown > docs/audit-rules.md"
    for r in RULES:
        assert f"`{r.id}`" in committed


def test_every_rule_count_in_the_docs_is_the_registrys():
    """A hand-written "N rules" in the docs went stale (docs/audit.md said 59 while the tool checked
    63): any count of audit rules in README.md or docs/ must be the registry's."""
    import re

    stale = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for n in re.findall(r"\b(\d+) (?:audit )?rules\b", path.read_text()):
            if int(n) != len(RULES):
                stale.append(f"{path.relative_to(ROOT)}: {n} rules")
    assert stale == [], f"the registry has {len(RULES)} rules: {stale}"


def _quickstart_serve_script() -> str:
    """Steps 2 and 3 of docs/quickstart.md as written: CONFIG='{…}' then --kv-transfer-config "$CONFIG"."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "quickstart.md").read_text()
    start = text.index("CONFIG='{")
    end = text.index("SERVER=$!", start)
    return text[start:end]


def test_the_quick_starts_serve_script_audits_with_its_config_variable_expanded(tmp_path):
    from typer.testing import CliRunner

    from kvtier.cli.main import app

    script = tmp_path / "serve.sh"
    script.write_text(_quickstart_serve_script())
    result = CliRunner().invoke(app, ["audit", str(script), "--vllm-version", "0.32.0", "--format", "json"])
    assert result.exit_code == 0, result.output
    rules = {f["rule"] for f in json.loads(result.stdout)["findings"]}
    assert "kv-transfer-config-invalid" not in rules and "shell-variable-unresolved" not in rules, rules
    # the JSON was read: a kvtier rule that needs the connector's config sees it
    from kvtier.audit.loader import load_configs

    (config,) = load_configs(script.read_text(), "serve.sh")
    assert config.kv_transfer_config["kv_connector_extra_config"]["disk_gib"] == 2


def test_a_variable_the_script_does_not_assign_is_a_note_not_an_error():
    from typer.testing import CliRunner

    from kvtier.cli.main import app

    line = 'vllm serve m --kv-transfer-config "$CONFIG"\n'
    result = CliRunner().invoke(app, ["audit", "-", "--vllm-version", "0.32.0", "--format", "json"], input=line)
    assert result.exit_code == 0, result.output
    found = {f["rule"]: f for f in json.loads(result.stdout)["findings"]}
    assert "kv-transfer-config-invalid" not in found
    assert found["shell-variable-unresolved"]["severity"] == "info"
    assert "cannot see the value of $CONFIG" in found["shell-variable-unresolved"]["message"]
    export = "export CONFIG=not-json\nvllm serve m --kv-transfer-config ${CONFIG}\n"  # assigned: judged as the value
    result = CliRunner().invoke(app, ["audit", "-", "--vllm-version", "0.32.0", "--format", "json"], input=export)
    assert result.exit_code == 1 and "'not-json' does not parse" in result.stdout


def test_a_dockerfile_built_on_the_vllm_image_holds_no_serve_line_to_audit():
    from typer.testing import CliRunner

    from kvtier.cli.main import app

    dockerfile = Path(__file__).resolve().parents[2] / "deploy" / "Dockerfile"
    result = CliRunner().invoke(app, ["audit", str(dockerfile)])
    assert result.exit_code == 2, result.output
    assert "No findings" not in result.output
    assert "holds no vLLM serve line to audit (FROM vllm/vllm-openai:" in " ".join(result.output.split())
    assert "Traceback" not in result.output
