"""``tiers`` with a shared tier above a local one (user41's review): the store keeps local tiers first
and asks a shared tier only for what they lack, whatever the order written, and ``kvtier check`` said ok
without a word.  The store half runs the real store on a real redis-server; the check half the CLI."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvtier.cli.main import app
from tests.core.helpers import chain_of, make_store
from tests.core.test_store import put_chain


def _check(extra: dict[str, object]):
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    return CliRunner().invoke(app, ["check", "--offline", json.dumps(transfer)], env={"COLUMNS": "400"})


def test_a_shared_tier_listed_above_a_local_one_is_served_below_it_and_check_says_so(tmp_path, redis_server):
    store = make_store(tmp_path, cpu_chunks=8, disk_chunks=32, write_mode="write-through",
                       redis_url=redis_server.url, redis_key_prefix="user41-order", tiers=["cpu", "redis", "disk"])
    try:
        chain = chain_of(1, 4)
        put_chain(store, chain)
        store.flush()
        # what the store does with that list: the disk tier is its local tier, redis the shared one below it
        assert [lt.name for lt in store.index.local] == ["disk"] and [lt.name for lt in store.index.shared] == ["redis"]
        assert store.lookup(chain) == 4 and store.tier("disk").usage().num_chunks == 4  # local hits
    finally:
        store.close()
    given = {"cpu_gib": 1, "redis_url": redis_server.url, "disk_path": str(tmp_path / "d"), "disk_gib": 1}
    result = _check({**given, "tiers": ["cpu", "redis", "disk"]})
    assert result.exit_code == 0, result.output
    line = " ".join(result.output.split())
    assert ("warning: kv_connector_extra_config.tiers: tiers lists the shared tier 'redis' above the local tier "
            "'disk', but kvtier always serves from local tiers first") in line, line
    assert "so the order used is ['cpu', 'disk', 'redis']; list the local tiers first" in line
    for quiet in ({**given, "tiers": ["cpu", "disk", "redis"]}, given, {**given, "tiers": ["cpu", "redis"]}):
        assert "tiers lists the shared tier" not in _check(quiet).output, quiet
