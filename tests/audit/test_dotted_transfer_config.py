"""vLLM's dotted ``--kv-transfer-config.KEY=VALUE`` flags (break test s5-2, F-audit-dotted).

vLLM 0.32 (vllm/utils/argparse_utils.py ``FlexibleArgumentParser.parse_args``) merges the dotted
keys into a new JSON appended after every other argument, so they replace a ``--kv-transfer-config
'{...}'`` JSON given anywhere on the line (checked against vLLM's own parser:
``make_arg_parser(FlexibleArgumentParser()).parse_args([...])`` gives ``kv_connector=None,
kv_connector_extra_config={'chunk_tokens': 0}`` for the first line below).  The audit reads the
same effective config and reports on it.
"""

from __future__ import annotations

import json

from kvtier.audit.engine import audit
from kvtier.audit.loader import load_configs
from kvtier.audit.model import Finding
from kvtier.audit.versions import parse_version

KVTIER = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"cpu_gib": 1}}
JSON_FLAG = "--kv-transfer-config '" + json.dumps(KVTIER) + "'"
ALL_DOTTED = ("--kv-transfer-config.kv_connector=KVTierConnector --kv_transfer_config.kv_role kv_both "
              "--kv-transfer-config.kv_connector_module_path=kvtier.integrations.vllm "
              "--kv-transfer-config.kv_load_failure_policy=recompute")


def findings(line: str) -> dict[str, Finding]:
    configs = load_configs(line, "serve.sh", parse_version("0.32.0"))
    return {f.rule: f for f in audit(configs)}


def test_a_dotted_key_after_the_json_drops_the_connector():
    line = f"vllm serve m {JSON_FLAG} --kv-transfer-config.kv_connector_extra_config.chunk_tokens=0"
    found = findings(line)
    dotted = found["kv-transfer-config-dotted"]
    assert dotted.severity == "error"
    assert dotted.message == (
        "--kv-transfer-config.kv_connector_extra_config.chunk_tokens=0 replaces the whole --kv-transfer-config "
        "JSON (vLLM builds a new config from the dotted keys), so the server runs with no KV connector instead "
        "of KVTierConnector: without kvtier, nothing is offloaded or loaded.")
    assert dotted.line == 1
    # the JSON is gone, so nothing is validated as a kvtier config
    assert "kvtier-config-invalid" not in found


def test_a_dotted_key_before_the_json_replaces_it_too():
    line = f"vllm serve m --kv-transfer-config.kv_connector_extra_config.cpu_gib=2 {JSON_FLAG}"
    dotted = findings(line)["kv-transfer-config-dotted"]
    assert dotted.severity == "error"
    assert "instead of KVTierConnector: without kvtier" in dotted.message


def test_dotted_keys_without_a_connector_are_ignored_by_vllm():
    dotted = findings("vllm serve m --kv-transfer-config.kv_connector_extra_config.cpu_gib=2")["kv-transfer-config-dotted"]
    assert dotted.severity == "error"
    assert dotted.message == ("--kv-transfer-config.kv_connector_extra_config.cpu_gib=2 sets no kv_connector, so "
                              "vLLM runs with no KV connector and ignores these keys.")


def test_an_invalid_kvtier_value_through_a_dotted_key_gets_the_validator_finding():
    found = findings(f"vllm serve m {ALL_DOTTED} --kv-transfer-config.kv_connector_extra_config.cpu_gib -1")
    assert set(found) >= {"kvtier-config-invalid"} and "kv-transfer-config-dotted" not in found
    invalid = found["kvtier-config-invalid"]
    assert invalid.severity == "error"
    # the same text as the JSON form gives
    same = findings("vllm serve m --kv-transfer-config '" + json.dumps(
        {**KVTIER, "kv_connector_extra_config": {"cpu_gib": -1}}) + "'")["kvtier-config-invalid"]
    assert invalid.message == same.message
    assert "'cpu_gib': must be above 0: every chunk passes through the cpu tier" in invalid.message


def test_nested_dotted_keys_merge_and_read_values_as_vllm_does():
    line = (f"vllm serve m --block-size 16 {ALL_DOTTED} --kv-transfer-config.kv_connector_extra_config.cpu_gib=1 "
            "--kv-transfer-config.kv_connector_extra_config.chunk_tokens=100")
    configs = load_configs(line, "serve.sh", parse_version("0.32.0"))
    assert configs[0].kv_transfer_config == {**KVTIER, "kv_connector_extra_config": {"cpu_gib": 1, "chunk_tokens": 100}}
    invalid = {f.rule: f for f in audit(configs)}["kvtier-config-invalid"]
    assert "chunk_tokens" in invalid.message
    # vLLM's human-readable integers: 1k is 1000, 1K is 1024 (a multiple of 16): a complete dotted config is clean
    assert load_configs(line.replace("=100", "=1k"), "s", None)[0].connector_extra["chunk_tokens"] == 1000
    ok = line.replace("chunk_tokens=100", "chunk_tokens=1K")
    assert load_configs(ok, "s", None)[0].connector_extra["chunk_tokens"] == 1024
    assert not [f for f in findings(ok).values() if f.severity == "error"]


def test_a_dotted_connector_named_again_keeps_the_json_quiet():
    # every key dotted and the JSON dropped on purpose: vLLM runs the dotted config; no dotted finding
    line = f"vllm serve m {JSON_FLAG} {ALL_DOTTED} --kv-transfer-config.kv_connector_extra_config.cpu_gib=1"
    assert "kv-transfer-config-dotted" not in findings(line)
