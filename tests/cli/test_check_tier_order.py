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


def test_a_second_shared_tier_is_only_written_and_check_says_so(tmp_path, redis_server, s3_server, key_prefix):
    """``tiers: [cpu, redis, s3]``: both shared tiers receive the writes, but only the first is looked up
    and read, so a chunk redis no longer holds is a miss although s3 holds it (tier-stack probe: store.md
    said so, s3.md and ``kvtier check`` did not)."""
    from redis import Redis

    from tests.core.helpers import payload, shared_prefix
    from tests.core.tier_harness import s3_credentials_file

    bucket = s3_server.make_bucket()
    settings = {"redis_url": redis_server.url, "redis_key_prefix": key_prefix, "s3_endpoint_url": s3_server.url,
                "s3_bucket": bucket, "s3_allow_http": True,
                "s3_credentials_file": str(s3_credentials_file(tmp_path, s3_server))}
    chain = chain_of(7, 3)
    writer = make_store(None, cpu_chunks=8, write_mode="write-through", tiers=["cpu", "redis", "s3"], **settings)
    try:
        writer.put(chain, [payload(k) for k in chain])
        assert writer.flush(10)
        assert writer.tier("s3").usage().num_chunks == 3  # s3 received the writes
    finally:
        writer.close()
    client = Redis.from_url(redis_server.url)
    client.delete(*client.keys(f"{key_prefix}*"))  # redis lost them (eviction, TTL, a restart); s3 holds them
    reader = make_store(None, cpu_chunks=8, tiers=["cpu", "redis", "s3"], **settings)
    try:
        assert [t.name for t in reader.index.shared] == ["redis", "s3"] and reader.tier("s3").contains(chain[0])
        assert shared_prefix(reader, chain) == 0  # only redis is asked: a miss
    finally:
        reader.close()
    result = _check({"cpu_gib": 1, **settings, "tiers": ["cpu", "redis", "s3"]})
    assert result.exit_code == 0, result.output
    line = " ".join(result.output.split())
    assert ("warning: kv_connector_extra_config.tiers: tiers lists 2 shared tiers, but kvtier looks up and reads "
            "only the first, 'redis': 's3' only receives writes") in line, line
    assert "keep one shared tier in tiers" in line
    defaulted = " ".join(_check({"cpu_gib": 1, **settings}).output.split())  # the default tiers name both
    assert "tiers has (by default) 2 shared tiers, but kvtier looks up and reads only the first, 'redis'" in defaulted
    for quiet in ({"cpu_gib": 1, **settings, "tiers": ["cpu", "s3"]}, {"cpu_gib": 1, "redis_url": redis_server.url}):
        assert "shared tiers, but" not in _check(quiet).output, quiet
    producer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_producer", "kv_connector_extra_config": {"cpu_gib": 1, **settings}}
    written = CliRunner().invoke(app, ["check", "--offline", json.dumps(producer)], env={"COLUMNS": "400"})
    assert written.exit_code == 0 and "shared tiers, but" not in written.output, written.output  # it only writes
