"""A ``KVTIER_<KEY>`` variable whose key the JSON also gives is never read (the JSON overrides it,
docs/vllm.md), and ``kvtier check`` said nothing of it, even of ``KVTIER_CPU_GIB=abc`` (fresh-user tester:
an operator who sets the pod's variable to resize the tier gets the JSON's size, silently).  ``check`` and
``audit`` now warn, naming the variable and the key, never its value."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvtier.cli.main import app

TRANSFER = json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"cpu_gib": 1}})


def test_check_warns_of_a_variable_the_json_overrides() -> None:
    for value in ("3", "abc"):
        result = CliRunner().invoke(app, ["check", "--offline", TRANSFER], env={"KVTIER_CPU_GIB": value})
        assert result.exit_code == 0, result.output
        warnings = [x for x in result.output.splitlines() if x.startswith("warning:")]
        assert len(warnings) == 1 and "KVTIER_CPU_GIB" in warnings[0] and "cpu_gib" in warnings[0], result.output
        assert value not in warnings[0].replace("KVTIER_CPU_GIB", ""), warnings[0]


def test_a_variable_the_json_does_not_give_is_read_without_a_warning() -> None:
    result = CliRunner().invoke(app, ["check", "--offline", TRANSFER], env={"KVTIER_SPILL_WATERMARK": "0.2"})
    assert result.exit_code == 0 and "warning:" not in result.output, result.output


def test_audit_warns_of_an_exported_variable_the_json_overrides() -> None:
    line = f"export KVTIER_CPU_GIB=64\nvllm serve m --kv-transfer-config '{TRANSFER}'\n"
    result = CliRunner().invoke(app, ["audit", "-", "--vllm-version", "0.32.0", "--format", "json"], input=line)
    findings = json.loads(result.stdout)["findings"]
    assert any("KVTIER_CPU_GIB" in f["message"] and f["severity"] == "warning" for f in findings), findings
