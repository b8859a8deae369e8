"""A write-through disk tier no larger than the cpu tier (note21's leftover): the disk tier takes every
chunk the cpu tier takes (docs/size.md § Inclusive tiers), so while the engine runs it adds almost no
hits, yet ``kvtier check`` said "ok" with no warning and ``kvtier audit`` passed the serve line.  Both
now warn, with one sentence, on ``disk_gib`` (the audit under a rule of its own, not inside
``kvtier-config-warning``); write-back, a larger disk tier, or no disk tier are quiet.  ``kvtier
size``, whose own note says it of an ``--offload-gib`` split, does not repeat it as an audit note."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app


def _transfer(extra: dict[str, object]) -> str:
    return json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra})


def _audit_messages(extra: dict[str, object]) -> list[tuple[str, str]]:
    audit = CliRunner().invoke(app, ["audit", "-", "--vllm-version", "0.32.0", "--format", "json"],
                               input=f"vllm serve m --kv-transfer-config '{_transfer(extra)}'\n")
    return [(f["rule"], f["message"]) for f in json.loads(audit.stdout)["findings"]]


@pytest.mark.parametrize(("extra", "warned"), [
    ({"cpu_gib": 8, "disk_gib": 8}, True),                                 # equal: the default write-through
    ({"cpu_gib": 8, "disk_gib": 2, "write_mode": "write-through"}, True),  # smaller, said explicitly
    ({"cpu_gib": 8, "disk_gib": 8, "write_mode": "write-back"}, False),    # the disk takes the cpu tier's evictions
    ({"cpu_gib": 8, "disk_gib": 8.5}, False),                              # larger
    ({"cpu_gib": 8, "disk_gib": 8, "tiers": ["cpu"]}, False),              # the disk tier does not run
])
def test_check_and_audit_warn_on_a_write_through_disk_tier_not_above_the_cpu_tier(tmp_path, extra, warned):
    extra = {**extra, "disk_path": str(tmp_path / "kv")}
    check = CliRunner().invoke(app, ["check", "--offline", _transfer(extra)])
    assert check.exit_code == 0, check.output
    said = [x for x in check.output.splitlines() if x.startswith("warning: kv_connector_extra_config.disk_gib:")]
    found = [(rule, m) for rule, m in _audit_messages(extra) if "is not larger than cpu_gib" in m]
    if not warned:
        assert not said and not found, (check.output, found)
        return
    assert len(said) == 1, check.output
    sentence = said[0].split("disk_gib: ", 1)[1]
    assert sentence.startswith(f"disk_gib {extra['disk_gib']:g} is not larger than cpu_gib 8 with write_mode "
                               "write-through") and "write-back" in sentence, sentence
    assert [rule for rule, _m in found] == ["kvtier-disk-tier-not-above-cpu-tier"], found  # its own rule, once
    assert sentence.startswith(found[0][1].rstrip(".") + "; "), (sentence, found)
    assert f"the cache holds about 8 GiB, not {8 + extra['disk_gib']:g}" in sentence, sentence


def test_size_states_a_split_whose_disk_tier_is_not_above_the_cpu_tier_once():
    """``--offload-gib 80 --host-ram-gib 80`` splits into 48 GiB of DRAM and 32 of disk: size's own note
    says the cache is the cpu tier's; the audit's finding on its recipe is not added as a second note."""
    result = CliRunner().invoke(app, ["size", "--model", "meta-llama/Llama-3.1-8B", "--offload-gib", "80",
                                      "--host-ram-gib", "80", "--json"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    notes = json.loads(result.stdout)["notes"]
    said = [n for n in notes if "no larger than the cpu tier" in n or "is not larger than cpu_gib" in n]
    assert len(said) == 1 and said[0].startswith("The disk tier (32 GiB) is no larger than the cpu tier (48 GiB)"), notes


@pytest.mark.parametrize("bad", [{"write_mode": "writeback"}, {"cpu_gib": "lots"}])
def test_a_refused_write_mode_or_cpu_gib_is_not_judged_as_its_default(tmp_path, bad):
    """Seen: write_mode "writeback" (meaning write-back) was refused, and then warned about as "write_mode
    write-through (the default)", telling the user to set the write-back they had tried to set; the audit
    put that warning under kvtier-config-warning."""
    extra = {"cpu_gib": 4, "disk_gib": 4, "disk_path": str(tmp_path / "kv"), **bad}
    check = CliRunner().invoke(app, ["check", "--offline", _transfer(extra)])
    assert check.exit_code == 1, check.output
    assert f"kv_connector_extra_config.{next(iter(bad))}" in check.output, check.output
    assert "not larger than cpu_gib" not in check.output, check.output
    assert not [m for _, m in _audit_messages(extra) if "not larger than cpu_gib" in m]
