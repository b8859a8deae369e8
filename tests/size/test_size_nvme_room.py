"""``kvtier size`` never prints a disk tier larger than the ``--nvme-gib`` it was given room for.

The disk tier may take ``nvme / 1.1`` (the room ``kvtier audit``'s ``kvtier-disk-volume-unfit`` asks of
its volume). Seen: rounding the recommended 1,818.18 GiB up to whole GiB per rank printed
``disk_gib`` 1820 for a 2,000 GiB drive, which the audit of a manifest with that drive refuses
(1820 + 10 % = 2,002 GiB) while LMCache's recipe, capped, said 1,818; and ``--offload-gib 300`` on
64 GiB of host RAM and a 100 GiB drive printed ``disk_gib`` 284, which no such drive holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from kvtier.cli.main import app

runner = CliRunner()
MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "local-tiers" / "vllm.yaml"


def size(*args: str):
    return runner.invoke(app, ["size", "--model", "meta-llama/Llama-3.1-8B", "--tp", "2", "--gpu", "H100", *args], env={"COLUMNS": "200"})


def test_recommended_disk_tier_fits_the_drive_the_audit_judges(tmp_path):
    result = size("--context", "32768", "--sessions", "1000", "--host-ram-gib", "256", "--nvme-gib", "2000", "--json")
    assert result.exit_code == 0, result.output
    recipe = json.loads(result.stdout)["recipe"]
    assert recipe["disk_gib"] * 1.1 <= 2000, recipe["disk_gib"]
    lmcache_disk = int(re.search(r"LMCACHE_MAX_LOCAL_DISK_SIZE=(\d+)", recipe["lmcache"]).group(1))
    assert lmcache_disk * recipe["tp"] == recipe["disk_gib"]  # the three recipes state the same bytes
    transfer = re.search(r"--kv-transfer-config '(\{.*\})'", recipe["kvtier"]).group(1)
    extra = json.loads(transfer)["kv_connector_extra_config"]
    text = MANIFEST.read_text()
    old = re.search(r"'(\{\"kv_connector\":\"KVTierConnector\".*\})'", text).group(1)
    extra.update(disk_path="/var/lib/kvtier/disk", shutdown_flush_s=30)
    new = json.dumps(dict(json.loads(transfer), kv_connector_extra_config=extra), separators=(",", ":"))
    assert "requests: {storage: 900Gi}" in text
    manifest = tmp_path / "vllm.yaml"
    manifest.write_text(text.replace(old, new).replace("requests: {storage: 900Gi}", "requests: {storage: 2000Gi}"))
    audit = runner.invoke(app, ["audit", str(manifest), "--format", "json"])
    assert audit.exit_code in (0, 1), audit.output
    rules = {f["rule"] for f in json.loads(audit.stdout)["findings"]}
    assert "kvtier-disk-volume-unfit" not in rules, audit.stdout


def test_offload_gib_past_the_drive_is_refused_with_a_size_that_is_accepted():
    result = size("--offload-gib", "300", "--host-ram-gib", "64", "--nvme-gib", "100")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.output.count("\n") == 1, result.output
    assert "--nvme-gib 100" in result.output and "give --offload-gib 106 or less" in result.output, result.output
    ok = size("--offload-gib", "106", "--host-ram-gib", "64", "--nvme-gib", "100", "--json")
    assert ok.exit_code == 0, ok.output
    recipe = json.loads(ok.stdout)["recipe"]
    assert recipe["cpu_gib"] == 16 and recipe["disk_gib"] == 90 and recipe["disk_gib"] * 1.1 <= 100


def no_room(model: str, tp: str, *args: str) -> str | None:
    result = runner.invoke(app, ["size", "--model", model, "--tp", tp, "--gpu", "H200", "--context", "32768",
                                 "--sessions", "100", "--host-ram-gib", "1", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["offload_no_room"]


def test_no_room_suggests_nvme_only_where_a_disk_tier_would_be_sized():
    """Seen: Qwen3-235B at TP 8 on 1 GiB of host RAM said 'give --nvme-gib for a disk tier', and with
    --nvme-gib 4000 it still had no room (a chunk loads from a 7 GB/s disk slower than it recomputes)."""
    slow = no_room("Qwen/Qwen3-235B-A22B", "8")
    assert slow is not None and "--nvme-gib" not in slow, slow
    assert no_room("Qwen/Qwen3-235B-A22B", "8", "--nvme-gib", "4000") is not None  # so it was no fix
    fast = no_room("meta-llama/Llama-3.1-8B", "2")
    assert fast is not None and "give --nvme-gib for a disk tier" in fast, fast
    assert no_room("meta-llama/Llama-3.1-8B", "2", "--nvme-gib", "4000") is None  # the fix it names works


def test_a_host_whose_reserves_take_all_its_ram_is_not_written_as_a_false_subtraction():
    """Seen: --host-ram-gib 40 at TP 2 (48 GiB reserved) noted 'usable host RAM (0 GiB = 40 − 48 reserved)'."""
    result = size("--offload-gib", "300", "--host-ram-gib", "40")
    assert result.exit_code == 0, result.output
    assert "0 GiB = 40 − 48 reserved" not in result.output
    assert "0 GiB = max(0, 40 − 48 reserved)" in result.output, result.output
    assert "208 GiB = 256 − 48 reserved" in size("--offload-gib", "300", "--host-ram-gib", "256").output
