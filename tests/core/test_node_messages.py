"""The node tier's messages name it as the host's node pool (not a "shared tier" behind a network
path), and a bad node_socket is named once (not "got 'rel.sock' (got 'rel.sock')")."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.integrations.vllm.preflight import probe_shared_tiers


def test_a_relative_node_socket_is_named_once():
    with pytest.raises(ConfigError) as raised:
        KVTierConfig.from_dict({"cpu_gib": 1, "node_socket": "rel.sock", "node_gib": 1})
    assert str(raised.value).count("'rel.sock'") == 1, str(raised.value)


def test_an_absent_node_pool_is_called_a_node_pool(tmp_path):
    socket = tmp_path / "none.sock"  # no owner listens: the pool is unreachable
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"cpu_gib": 1, "node_socket": str(socket), "node_gib": 1}}
    (probe,) = probe_shared_tiers(transfer)
    message = probe.result.message
    assert message.startswith(f"node pool {socket} is unreachable (") and "shared tier" not in message
    assert "every node-pool lookup would be a miss" in message and "network path" not in message
    assert "kvtier node serve --socket" in message


def test_a_pool_too_small_for_one_page_says_the_size_it_needs():
    """Below one page after the huge-page-aligned header the refusal names the size that works
    (it said only "no room for one page", while the pool held 2 MiB and the page 256 KiB)."""
    from kvtier.core.tiers.node.pool import ALIGN_BYTES, pages_for

    page = 256 << 10
    with pytest.raises(ValueError) as raised:
        pages_for(ALIGN_BYTES, page)
    least = ALIGN_BYTES + page
    assert f"needs at least {least} bytes" in str(raised.value) and "huge page" in str(raised.value)
    assert pages_for(least, page) == (1, ALIGN_BYTES)  # the size named is enough


def test_a_pool_larger_than_its_mount_names_its_size_in_gib_and_the_room_there(tmp_path):
    """``kvtier node serve --node-gib 100000`` answered "cannot create the node pool … of
    107374182400000 bytes: [Errno 28] No space left on device": a byte count nobody reads at a
    glance and no word of what would fit.  Its error line names GiB and the mount's free room."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    shm = Path("/dev/shm")
    where = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() else tmp_path  # where pools live (docs/node.md)
    try:
        pool = where / "pool"
        out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "node", "serve", "--pool", str(pool),
                              "--socket", str(tmp_path / "node.sock"), "--node-gib", "100000"],
                             check=False, capture_output=True, text=True, timeout=60)
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert out.returncode != 0 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
        (line,) = errors
        vfs = os.statvfs(where)
        free_gib = vfs.f_bavail * vfs.f_frsize / (1 << 30)
        assert "of 100,000.0 GiB (107,374,182,400,000 bytes)" in line, line
        said = float(line.split(f"{where} has ")[1].split(" GiB free")[0].replace(",", ""))
        assert abs(said - free_gib) < max(1.0, 0.05 * free_gib), (said, free_gib)
        assert not pool.exists() and not list(where.glob(".pool.*"))  # nothing half-made left behind
    finally:
        if where != tmp_path:
            shutil.rmtree(where, ignore_errors=True)
