"""``kvtier check`` creates nothing (fresh-user tester: a check of a config whose ``disk_path`` did not
exist created the directory, parents and all, and said only "ok"): it says the directory does not exist
yet and that the engine creates it at start-up, and the engine's disk tier does create it."""

from __future__ import annotations

import json
import os

from typer.testing import CliRunner

from kvtier.cli.main import app


def _check(extra: dict[str, object]):
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    return CliRunner().invoke(app, ["check", "--offline", json.dumps(transfer)])


def test_check_of_a_disk_path_that_does_not_exist_creates_nothing_and_says_so(tmp_path):
    from prometheus_client import CollectorRegistry

    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.factory import TierContext, make_tier

    path = tmp_path / "not" / "yet"
    result = _check({"cpu_gib": 1, "disk_path": str(path), "disk_gib": 0.01})
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "not").exists() and os.listdir(tmp_path) == []
    assert (f"info: {path} does not exist yet: kvtier check created nothing; the engine creates it at start-up "
            "(its nearest existing parent was checked for room and write access).") in result.output
    # what the sentence promises: the tier, as start-up builds it, creates the directory
    config = KVTierConfig.from_dict({"disk_path": str(path), "disk_gib": 0.01, "tiers": ["cpu", "disk"]})
    tier = make_tier("disk", TierContext(config, b"\0" * 16, 4096, 1, CollectorRegistry()))
    assert tier is not None and path.is_dir()
    tier.close()
    again = _check({"cpu_gib": 1, "disk_path": str(path), "disk_gib": 0.01})
    assert again.exit_code == 0 and "does not exist yet" not in again.output
    assert not [p for p in path.iterdir() if p.name.startswith(".kvtier-write-probe")]

