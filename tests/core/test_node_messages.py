"""The node tier's messages name it as the host's node pool (not a "shared tier" behind a network
path), and a bad node_socket is named once (not "got 'rel.sock' (got 'rel.sock')")."""

from __future__ import annotations

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
