"""``kvtier audit`` runs ``kvtier check``'s static validation on each serve line's KVTierConnector
config and says what check says (a user's scripts: chunk_tokens 100 without --block-size, a disk_path
under /proc, a cpu_gib below one chunk all passed audit while check flagged them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvtier.audit.engine import audit
from kvtier.audit.loader import load_configs
from kvtier.audit.versions import parse_version


def transfer(**extra: object) -> str:
    return json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra})


def kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args], capture_output=True, text=True,
                          check=False, timeout=120, env={**os.environ, "COLUMNS": "400"})


def findings(config: str) -> dict[str, str]:
    found = audit(load_configs(f"#!/bin/sh\nvllm serve Qwen/Qwen3-0.6B --kv-transfer-config '{config}'\n", "serve.sh",
                               parse_version("0.32.0")))
    return {f.rule: f.message for f in found if f.rule.startswith("kvtier-config")}


def test_chunk_tokens_100_without_a_block_size_is_warned_as_check_warns():
    config = transfer(cpu_gib=4, chunk_tokens=100)
    checked = kvtier("check", "--offline", config).stdout
    message = findings(config)["kvtier-config-warning"]
    assert message.startswith("chunk_tokens=100 is not a multiple of vLLM's default block size 16 (CUDA)")
    assert message.rstrip(".") in checked  # check's very sentence


def test_a_cpu_tier_below_one_chunk_is_warned_as_check_warns():
    config = transfer(cpu_gib=0.0001)
    message = findings(config)["kvtier-config-warning"]
    assert message.startswith("cpu_gib=0.0001 (107374 bytes) cannot hold one 128-token chunk")
    assert message.rstrip(".") in kvtier("check", "--offline", config).stdout


def test_a_disk_path_under_proc_is_an_error_and_says_the_check_was_static(tmp_path):
    message = findings(transfer(cpu_gib=4, disk_path="/proc/x", disk_gib=1))["kvtier-config-invalid"]
    assert message.startswith("disk_path '/proc/x' is under /proc, where every Linux host mounts a kernel interface")
    assert "static check of the path" in message
    assert "kvtier-config-invalid" not in findings(transfer(cpu_gib=4, disk_path="/dev/shm/kv", disk_gib=1))
    script = tmp_path / "serve.sh"  # and through the CLI: the script fails the audit
    script.write_text(f"vllm serve m --kv-transfer-config '{transfer(cpu_gib=4, disk_path='/proc/x', disk_gib=1)}'\n")
    proc = kvtier("audit", str(script))
    assert proc.returncode == 1 and "kvtier-config-invalid" in proc.stdout, proc.stdout + proc.stderr


def test_a_cpu_gib_in_bytes_is_an_error_in_audit_as_in_check():
    """audit let "cpu_gib": 34359738368 (32 GiB written in bytes, read as 32 EiB) pass while check refused it
    only against the host's memory (new user 5); the config itself now refuses any *_gib over 1 PiB."""
    config = transfer(cpu_gib=34359738368)
    message = findings(config)["kvtier-config-invalid"]
    assert "cpu_gib': looks like bytes; it is in GiB (32 means 32 GiB)" in message, message
    checked = kvtier("check", "--offline", config)
    assert checked.returncode != 0 and "looks like bytes; it is in GiB" in checked.stdout + checked.stderr
    assert "kvtier-config-invalid" not in findings(transfer(cpu_gib=32))
