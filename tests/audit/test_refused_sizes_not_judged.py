"""A tier size kvtier's config refuses is reported once, by ``kvtier-config-invalid``: the rules that judge
tier sizes say nothing about it, neither about the refused value nor about the default standing in for it
(as ``kvtier check``'s disk-vs-cpu warning waits for valid values).  Seen: ``cpu_gib 0`` was refused and,
with ``--gpu H100``, also warned ``cpu-tier-not-above-engine-cache`` ("kvtier's cpu_gib 0 GiB is not
larger than the engine's KV cache"), without ``--gpu`` noted ``cpu-tier-vs-engine-cache-unknown``."""

from __future__ import annotations

import json

import pytest

from tests.audit.test_cli_audit import kvtier
from tests.audit.test_deploy_findings import SHIPPED, found


def line(**extra: object) -> str:
    config = {"kv_connector": "KVTierConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_module_path": "kvtier.integrations.vllm", "kv_connector_extra_config": extra}
    return ("vllm serve meta-llama/Llama-3.1-8B --gpu-memory-utilization 0.9 --kv-transfer-config '"
            + json.dumps(config) + "'")


def rules(text: str, *flags: str) -> set[tuple[str, str]]:
    proc = kvtier("-", "--vllm-version", "0.32.0", "--format", "json", *flags, stdin=text)
    assert proc.returncode in (0, 1), proc.stderr
    return {(f["rule"], f["severity"]) for f in json.loads(proc.stdout)["findings"]}


@pytest.mark.parametrize("extra", [
    {"cpu_gib": 0},
    {"cpu_gib": -1},
    {"cpu_gib": "lots"},  # not a number: the default 4 GiB stood in for it
    {"cpu_gib": 10, "disk_path": "/mnt/nvme/kvtier", "disk_gib": "plenty"},
    # a relative socket: the 100 GiB pool judged (no larger than an H200's, B200's or MI300X's cache) is refused
    {"cpu_gib": 10, "node_socket": "node.sock", "node_gib": 100},
], ids=["cpu-0", "cpu-negative", "cpu-not-a-number", "disk-not-a-number", "node-socket-relative"])
@pytest.mark.parametrize("gpu", [(), ("--gpu", "H100")], ids=["no-gpu", "H100"])
def test_a_refused_tier_size_is_only_the_config_error(extra: dict[str, object], gpu: tuple[str, ...]) -> None:
    assert rules(line(**extra), *gpu) == {("kvtier-config-invalid", "error")}


def test_the_size_rules_still_judge_valid_sizes() -> None:
    """The same lines with valid sizes below the engine's 53 GiB KV cache (H100) are still judged."""
    assert ("cpu-tier-not-above-engine-cache", "warning") in rules(line(cpu_gib=10), "--gpu", "H100")
    assert ("cpu-tier-vs-engine-cache-unknown", "info") in rules(line(cpu_gib=10))
    pool = rules(line(cpu_gib="lots", node_socket="/dev/shm/kvtier/node.sock", node_gib=2))
    assert ("kvtier-node-pool-below-working-set", "warning") not in pool, pool  # 2 GiB against a refused cpu_gib
    assert ("kvtier-node-pool-below-working-set", "warning") in rules(
        line(cpu_gib=4, node_socket="/dev/shm/kvtier/node.sock", node_gib=2))


def test_a_refused_cpu_gib_is_not_held_against_the_memory_limit() -> None:
    """The shipped manifest with ``cpu_gib "lots"`` in an 8Gi pod: the default 4 GiB standing in for it plus
    vLLM's 8 GiB was an OOM error of its own; the refusal is the one finding about it."""
    text = SHIPPED.replace('"cpu_gib":32', '"cpu_gib":"lots"').replace("memory: 64Gi, ephemeral", "memory: 8Gi, ephemeral")
    assert text != SHIPPED
    findings = found(text)
    assert "kvtier-config-invalid" in findings and "kvtier-cpu-tier-over-memory-limit" not in findings, findings
    assert "kvtier-cpu-tier-over-memory-limit" in found(text.replace('"cpu_gib":"lots"', '"cpu_gib":4.5'))
