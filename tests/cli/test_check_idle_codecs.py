"""``codecs`` for a tier this config does not run (``{"codecs": {"disk": ["aes-256-gcm"]}}`` with no
``disk_path``) was reported "ok" (fresh-user tester): nothing is ever written to that tier, so its chain,
an encryption an operator may count on, does nothing.  ``check`` and ``audit`` warn, naming the tier and
the key that would configure it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvtier.cli.main import app


def _check(extra: dict[str, object]) -> tuple[int, list[str]]:
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    result = CliRunner().invoke(app, ["check", "--offline", json.dumps(transfer)])
    return result.exit_code, [x for x in result.output.splitlines() if x.startswith(("warning:", "error:"))]


def test_codecs_of_a_tier_not_configured_are_warned_about() -> None:
    code, lines = _check({"cpu_gib": 1, "codecs": {"disk": ["blosc2-zstd-shuffle2"]}})
    assert code == 0, lines
    assert len(lines) == 1 and lines[0].startswith("warning: kv_connector_extra_config.codecs:"), lines
    assert "'disk'" in lines[0] and "disk_path" in lines[0], lines


def test_codecs_of_a_configured_tier_are_quiet(tmp_path) -> None:
    code, lines = _check({"cpu_gib": 1, "disk_path": str(tmp_path), "disk_gib": 2,
                          "codecs": {"disk": ["blosc2-zstd-shuffle2"]}})
    assert code == 0 and lines == [], lines


def test_codecs_of_a_tier_left_out_of_tiers_are_warned_about(tmp_path) -> None:
    code, lines = _check({"cpu_gib": 1, "disk_path": str(tmp_path), "disk_gib": 1, "tiers": ["cpu"],
                          "codecs": {"disk": ["blosc2-zstd-shuffle2"]}})
    assert code == 0 and any(x.startswith("warning: kv_connector_extra_config.codecs:") for x in lines), lines
