"""``kvtier check`` on a --kv-transfer-config that gives a key twice (user41's review): vLLM's
``json.loads`` keeps the last value and drops the other silently, and check said ok without a word,
so ``{"cpu_gib": 1, ..., "cpu_gib": 64}`` served 64 GiB where the operator read 1."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core.config import KVTierConfig

HEAD = ('{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier.integrations.vllm",'
        '"kv_role":"kv_both","kv_load_failure_policy":"recompute",')


def _check(text: str, *flags: str):
    return CliRunner().invoke(app, ["check", "--offline", *flags, text], env={"COLUMNS": "400"})


def test_a_key_given_twice_is_warned_with_the_value_vllm_keeps(tmp_path):
    text = HEAD + '"kv_connector_extra_config":{"cpu_gib":1,"policy":"lru","cpu_gib":2}}'
    # what the engine gets: the last value (the same json.loads vLLM's argument parser runs)
    assert KVTierConfig.from_dict(json.loads(text)["kv_connector_extra_config"]).cpu_gib == 2
    for source in (text, str(tmp_path / "transfer.json")):
        (tmp_path / "transfer.json").write_text(text)
        result = _check(source)
        assert result.exit_code == 0, result.output
        assert ("warning: kv_connector_extra_config.cpu_gib: 'cpu_gib' is given twice (1, then 2); vLLM keeps the "
                "last, 2, and ignores the other without a word; remove the one you did not mean") in result.output
        assert "(1 warning(s))" in result.output
    top = _check(HEAD + '"kv_connector_extra_config":{"cpu_gib":1},"kv_role":"kv_consumer"}', "--json")
    problems = json.loads(top.stdout)["problems"]
    assert [(p["severity"], p["key"]) for p in problems] == [("warning", "kv_role")], problems
    assert '"kv_both", then "kv_consumer"' in problems[0]["message"]
    clean = _check(HEAD + '"kv_connector_extra_config":{"cpu_gib":1}}')
    assert clean.exit_code == 0 and "warning" not in clean.output, clean.output
