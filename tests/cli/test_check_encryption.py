"""``kvtier check`` on encryption at rest (issue 36): the master key file and variable are read as
start-up reads them (a missing file, an unset variable, a short key: one sentence, exit 1, no
traceback, never the key), a chain is validated, and a good setup prints the key ids only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvtier.core.encryption import key_id_of

KEY = "check-test-master-key-0123456789abcdef0123"
OLD = "check-test-older-master-key-0123456789abcdef"


def kvtier(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args], capture_output=True, text=True,
                          check=False, timeout=120,
                          env={"COLUMNS": "200", "PATH": "/usr/bin", **(env or {}),
                               **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})})


def transfer(tmp_path: Path, **extra: object) -> str:
    return json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"cpu_gib": 1, "disk_path": str(tmp_path / "d"), "disk_gib": 0.01,
                                                     "codecs": {"disk": ["aes-256-gcm"]}, **extra}})


def test_a_good_key_ring_passes_and_only_its_ids_are_printed(tmp_path: Path) -> None:
    (tmp_path / "key").write_text(KEY)
    (tmp_path / "old").write_text(OLD)
    proc = kvtier("check", "--offline", transfer(tmp_path, encryption={
        "master_key_file": str(tmp_path / "key"), "previous_key_files": [str(tmp_path / "old")]}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"master key {key_id_of(KEY.encode()).hex()} seals new values" in proc.stdout
    assert f"{key_id_of(OLD.encode()).hex()} still open older ones" in proc.stdout
    assert KEY not in proc.stdout + proc.stderr and OLD not in proc.stdout + proc.stderr


def test_an_unreadable_file_an_unset_variable_and_a_short_key_each_fail_in_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "short").write_text("too-short")
    cases = [({"master_key_file": str(tmp_path / "missing")}, {}, "cannot read encryption master key file"),
             ({"master_key_env": "KV_TEST_MASTER_KEY"}, {}, "environment variable KV_TEST_MASTER_KEY"),
             ({"master_key_file": str(tmp_path / "short")}, {}, "fewer than 32 characters")]
    for settings, env, words in cases:
        proc = kvtier("check", "--offline", transfer(tmp_path, encryption=settings), env=env)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert words in proc.stdout and "Traceback" not in proc.stderr
    good = kvtier("check", "--offline", transfer(tmp_path, encryption={"master_key_env": "KV_TEST_MASTER_KEY"}),
                  env={"KV_TEST_MASTER_KEY": KEY})
    assert good.returncode == 0 and KEY not in good.stdout


def test_a_chain_without_keys_or_out_of_order_is_refused(tmp_path: Path) -> None:
    proc = kvtier("check", "--offline", transfer(tmp_path))
    assert proc.returncode == 1 and "include aes-256-gcm but encryption is not set" in proc.stdout
    proc = kvtier("check", "--offline", transfer(tmp_path, codecs={"disk": ["aes-256-gcm", "identity"]}))
    assert proc.returncode == 1 and "must come last in a chain" in proc.stdout
    proc = kvtier("check", "--offline", transfer(tmp_path, codecs={"cpu": ["identity"]}))
    assert proc.returncode == 1 and "which writes no codec chain" in proc.stdout


def test_a_chain_for_the_node_tier_which_writes_none_is_refused(tmp_path: Path) -> None:
    """The node tier stores values as the engine wrote them (no codec chain): ``codecs: {node:
    [aes-256-gcm]}`` was accepted and ignored, so an operator asking for encryption got the pool's
    values in the clear in /dev/shm.  Start-up (the configuration) and ``kvtier check`` refuse it."""
    import pytest

    from kvtier.core.config import KVTierConfig
    from kvtier.core.errors import ConfigError
    from kvtier.core.tiers import registry

    (tmp_path / "key").write_text(KEY)
    node = {"tiers": ["cpu", "node"], "node_socket": str(tmp_path / "node.sock"),
            "encryption": {"master_key_file": str(tmp_path / "key")}}
    for chain in (["aes-256-gcm"], ["blosc2-zstd-shuffle2"]):
        with pytest.raises(ConfigError, match="codecs is set for tier 'node', which writes no codec chain"):
            KVTierConfig.from_dict({"cpu_gib": 1, **node, "codecs": {"node": chain}})
    proc = kvtier("check", "--offline", transfer(tmp_path, **node, codecs={"node": ["aes-256-gcm"]}))
    assert proc.returncode == 1 and "'node', which writes no codec chain" in proc.stdout, proc.stdout + proc.stderr
    assert KVTierConfig.from_dict({"cpu_gib": 1, **node, "codecs": {}}).codecs == {}
    # a tier from outside kvtier writes no chain unless its record says so (the toy dict tier does not)
    plugin = {"cpu_gib": 1, "tier_modules": ["tests.dict_tier_plugin"], "tiers": ["cpu", "dict"],
              "encryption": node["encryption"]}
    try:
        with pytest.raises(ConfigError, match="codecs is set for tier 'dict', which writes no codec chain"):
            KVTierConfig.from_dict({**plugin, "codecs": {"dict": ["aes-256-gcm"]}})
        assert KVTierConfig.from_dict({**plugin, "codecs": {"disk": ["aes-256-gcm"]}}).codecs == {"disk": ("aes-256-gcm",)}
    finally:  # the plug-in registered its tier in this process: the next test's default tiers must not name it
        registry.unregister("dict")
        sys.modules.pop("tests.dict_tier_plugin", None)
