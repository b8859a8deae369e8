"""A node pool smaller than the engine's own cpu tier: ``kvtier audit`` warned
(``kvtier-node-pool-below-working-set``) and ``kvtier check`` of the same JSON said "ok" with no warning
(fresh-user tester: two tools, one config, two answers).  ``check`` gives the audit's sentence, and the
audit still reports it once, under its own rule."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvtier.cli.main import app


def _transfer(extra: dict[str, object]) -> str:
    return json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra})


def test_check_and_audit_say_the_same_of_a_pool_below_the_cpu_tier(tmp_path) -> None:
    extra = {"cpu_gib": 4, "node_socket": str(tmp_path / "node.sock"), "node_gib": 0.5}
    check = CliRunner().invoke(app, ["check", "--offline", _transfer(extra)])
    assert check.exit_code == 0, check.output
    warnings = [x for x in check.output.splitlines() if x.startswith("warning: kv_connector_extra_config.node_gib:")]
    assert len(warnings) == 1, check.output
    audit = CliRunner().invoke(app, ["audit", "-", "--vllm-version", "0.32.0", "--format", "json"],
                               input=f"vllm serve m --kv-transfer-config '{_transfer(extra)}'\n")
    findings = [f for f in json.loads(audit.stdout)["findings"] if "node_gib 0.5 GiB" in f["message"]]
    assert [f["rule"] for f in findings] == ["kvtier-node-pool-below-working-set"], findings
    sentence = warnings[0].split("node_gib: ", 1)[1]
    assert sentence.startswith(findings[0]["message"].rstrip(".") + "; lower cpu_gib"), (findings[0]["message"], sentence)


def test_a_pool_at_least_the_cpu_tier_is_quiet(tmp_path) -> None:
    extra = {"cpu_gib": 4, "node_socket": str(tmp_path / "node.sock"), "node_gib": 4}
    check = CliRunner().invoke(app, ["check", "--offline", _transfer(extra)])
    assert check.exit_code == 0 and "node_gib" not in check.output, check.output
