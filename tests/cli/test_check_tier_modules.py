"""``kvtier check`` of a ``tier_modules`` given as one string (fresh-user tester): its error was printed once
under ``tier_modules`` and once under every other key checked beside it (``cpu_gib``, ``write_mode``), which
were fine.  The error is named once, under ``tier_modules``, and in the same words ``kvtier audit`` uses."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvtier.cli.main import app


def _transfer(extra: dict[str, object]) -> str:
    return json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra})


def test_a_bad_tier_modules_is_named_once_and_under_its_own_key() -> None:
    for modules in ("kvtier_no_such_tier_module", "kvtier.core.config"):  # not importable; importable, not a list
        extra = {"cpu_gib": 1, "write_mode": "write-through", "tier_modules": modules}
        result = CliRunner().invoke(app, ["check", "--offline", _transfer(extra)])
        assert result.exit_code == 1, result.output
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith("error: kv_connector_extra_config.tier_modules:"), errors


def test_the_other_keys_are_still_checked_beside_a_bad_tier_modules() -> None:
    extra = {"cpu_gib": -1, "tier_modules": "kvtier_no_such_tier_module"}
    result = CliRunner().invoke(app, ["check", "--offline", _transfer(extra)])
    errors = [line.split(":")[1].strip() for line in result.output.splitlines() if line.startswith("error:")]
    assert sorted(errors) == ["kv_connector_extra_config.cpu_gib", "kv_connector_extra_config.tier_modules"], \
        result.output


def test_a_key_of_the_wrong_json_type_is_named_in_json_words_with_an_example() -> None:
    """``{"codecs": "disk"}`` said "Input should be a valid dictionary", ``{"tiers": "disk"}`` "a valid tuple"
    (JSON has none) and ``{"encryption": "disk"}`` "... or instance of EncryptionSettings" (a class of kvtier's
    code) (fresh-user tester): the line says the JSON type the key takes and gives an example of it."""
    cases = {"admission": dict, "codecs": dict, "tier_settings": dict, "encryption": dict, "tiers": list,
             "tier_modules": list}
    for key, kind in cases.items():
        value = "kvtier.core.config" if key == "tier_modules" else "disk"  # importable: its type is what is wrong
        result = CliRunner().invoke(app, ["check", "--offline", _transfer({"cpu_gib": 1, key: value})])
        assert result.exit_code == 1, result.output
        line = next(x for x in result.output.splitlines() if x.startswith(f"error: kv_connector_extra_config.{key}:"))
        assert "Input should be" not in line and "instance of" not in line, line
        word = "a JSON object" if kind is dict else "a JSON list"
        assert f"must be {word} (e.g. " in line, line
        example = line.split(f"must be {word} (e.g. ", 1)[1].split(")", 1)[0] if kind is dict else \
            line.split(f"must be {word} (e.g. ", 1)[1].split("])", 1)[0] + "]"
        assert isinstance(json.loads(example), kind), line
