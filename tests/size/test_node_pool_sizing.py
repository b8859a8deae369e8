"""The node pool and the cpu tier share the host's DRAM (nu5).

``kvtier size --node-socket --node-gib 128 --host-ram-gib 512`` put a 464 GiB cpu tier (all the host
RAM less reserves) beside the 128 GiB pool, 592 GiB of a 512 GiB host, and the audit rule
``kvtier-node-pool-below-working-set`` then asked node_gib >= cpu_gib, which no pool that fits could
give.  The rule now: the pool comes out of host RAM less reserves, and the cpu tier stays no larger
than the pool (docs/node.md § Sizing, docs/size.md).
"""

from __future__ import annotations

import json

import pytest

from tests.audit.test_cli_audit import kvtier as audit
from tests.size.test_size_hardening import _json
from tests.size.test_size_new_user import _extra

SIZE = ("--model", "Qwen/Qwen3-8B", "--tp", "2", "--gpu", "H100", "--context", "32768", "--sessions", "200",
        "--host-ram-gib", "512", "--nvme-gib", "2000", "--node-socket", "/dev/shm/kvtier-node/node.sock")
USABLE = 512 - 48  # 16 GiB for the OS + 16 per worker of TP 2


@pytest.mark.parametrize("node_gib, cpu_gib", [(128, 128), (232, 232), (300, USABLE - 300)])
def test_the_cpu_tier_and_the_pool_fit_host_ram_and_audit_clean(node_gib: int, cpu_gib: int):
    data = _json(*SIZE, "--node-gib", str(node_gib))
    extra = _extra(data["recipe"]["kvtier"])
    assert extra["cpu_gib"] == cpu_gib and extra["node_gib"] == node_gib
    assert extra["cpu_gib"] + extra["node_gib"] <= USABLE and extra["cpu_gib"] <= extra["node_gib"]
    assert not any("kvtier-node-pool-below-working-set" in note for note in data["notes"])
    proc = audit("-", "--vllm-version", "0.32.0", "--format", "json", stdin=data["recipe"]["kvtier"])
    assert "kvtier-node-pool-below-working-set" not in proc.stdout, proc.stdout


def test_a_pool_below_half_the_ram_says_what_pool_would_use_it_all():
    notes = _json(*SIZE, "--node-gib", "128")["notes"]
    assert any("a 232 GiB pool, kvtier node serve --node-gib 232, would use it all" in note for note in notes)


def test_a_chosen_offload_size_spills_past_the_pool_to_disk():
    data = _json(*SIZE, "--node-gib", "128", "--offload-gib", "600")
    assert data["recipe"]["cpu_gib"] == 128 and data["recipe"]["disk_gib"] == 472


def test_without_host_ram_the_pool_alone_bounds_the_cpu_tier():
    args = [a for a in SIZE if a not in ("--host-ram-gib", "512")]
    extra = _extra(_json(*args, "--node-gib", "200")["recipe"]["kvtier"])
    assert extra["cpu_gib"] == 200  # above the engine's 120 GiB KV cache, so worth its DRAM


def test_the_rule_still_flags_a_cpu_tier_larger_than_the_pool_and_its_fix_is_the_sizes_rule():
    line = ("vllm serve m --kv-transfer-config '" + json.dumps({
        "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_gib": 464, "node_socket": "/dev/shm/kvtier-node/node.sock",
                                      "node_gib": 128}}) + "'")
    found = json.loads(audit("-", "--vllm-version", "0.32.0", "--format", "json", stdin=line).stdout)
    (finding,) = [f for f in found["findings"] if f["rule"] == "kvtier-node-pool-below-working-set"]
    assert "Lower cpu_gib to node_gib" in finding["fix"] and "host RAM − reserves" in finding["fix"]


@pytest.mark.parametrize("node_gib", ["256", "500"])
def test_a_node_pool_not_smaller_than_host_ram_is_refused_in_one_sentence(node_gib: str):
    """fresh-eyes probe: --node-gib 500 --host-ram-gib 256 answered "no room … (0 GiB = max(0, 256 − 32
    reserved − 500 node pool))" and never said that no 500 GiB pool fits a 256 GiB host.  Now one line,
    exit 2, naming both flags; a pool below host RAM is sized as before."""
    from typer.testing import CliRunner

    from kvtier.cli.main import app

    args = ["size", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--context", "32768", "--sessions", "100",
            "--node-socket", "/dev/shm/kvtier/node.sock", "--host-ram-gib", "256"]
    refused = CliRunner().invoke(app, [*args, "--node-gib", node_gib])
    assert refused.exit_code == 2 and refused.stdout == "", refused.output
    line, = refused.stderr.strip().splitlines()
    assert line.startswith(f"error: --node-gib {node_gib} is not less than --host-ram-gib 256"), line
    assert CliRunner().invoke(app, [*args, "--node-gib", "64", "--json"]).exit_code == 0
