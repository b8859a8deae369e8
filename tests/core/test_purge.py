"""``kvtier purge`` as a library (kvtier.core.purge and the tiers' purge hooks), on real chunk files
and a real redis-server: a dry run says exactly what the purge then removes, and nothing outside
the selector is touched (issue 22 item 3)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
import redis

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import UserError
from kvtier.core.purge import PurgeFailed, PurgeSelector, parse_duration, parse_namespace, purge
from kvtier.core.store import TieredStore
from kvtier.core.tenant import TenantId
from kvtier.core.tiers.sharedvalue import HEADER_BYTES

from .helpers import CHUNK_BYTES, NS, chain_of, make_store, payload

OTHER_NS = dataclasses.replace(NS, model="other-model")


def put(store: TieredStore, chain, tenant: TenantId | None) -> None:
    assert store.put(chain, [payload(k) for k in chain], tenant=tenant) == len(chain)


def files(directory: Path) -> dict[str, int]:
    """``relative path -> size`` of every chunk file under ``directory``."""
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.glob("*/*/*.kvc"))}


def disk_config(tmp_path: Path) -> KVTierConfig:
    return KVTierConfig.from_dict({"disk_path": str(tmp_path / "disk")})


@pytest.fixture
def populated(tmp_path):
    """A disk directory with chunks of salts A and B, no salt, an unknown tenant, and another namespace."""
    store = make_store(tmp_path, cpu_chunks=64, disk_chunks=64, write_mode="write-through")
    chains = {"A": chain_of(1, 3, "A"), "B": chain_of(2, 4, "B"), "none": chain_of(3, 2), "unknown": chain_of(4, 2, "B")}
    put(store, chains["A"], TenantId.of("A", None))
    put(store, chains["B"], TenantId.of("B", None))
    put(store, chains["none"], TenantId.of(None, None))
    put(store, chains["unknown"], None)  # written by a store that did not say (as every file before records)
    store.flush()
    other = TieredStore(KVTierConfig.from_dict({"chunk_tokens": 4, "cpu_gib": 64 * CHUNK_BYTES / 2**30,
                                                "disk_path": str(tmp_path / "disk"), "disk_gib": 1e-3,
                                                "write_mode": "write-through"}), OTHER_NS, CHUNK_BYTES)
    put(other, chain_of(5, 3, "B"), TenantId.of("B", None))
    other.flush()
    yield store, other, chains
    store.close()
    other.close()


def test_salt_purge_removes_exactly_what_the_dry_run_said_and_nothing_else(tmp_path, populated):
    store, other, chains = populated
    disk = tmp_path / "disk"
    ns, other_ns = store.tier("disk").dir.name, other.tier("disk").dir.name
    before = files(disk)
    assert len(before) == 3 + 4 + 2 + 2 + 3
    selector = PurgeSelector(cache_salt="B")

    dry = purge(disk_config(tmp_path), selector, dry_run=True)
    assert files(disk) == before  # a dry run removes nothing
    by_ns = {r.namespace.hex(): r for r in dry}
    assert set(by_ns) == {ns, other_ns}
    b_files = {k: v for k, v in before.items() if k.split("/")[-1][:-4] in {c.hex() for c in chains["B"]}}
    assert (by_ns[ns].chunks, by_ns[ns].bytes) == (4, sum(b_files.values()))
    assert by_ns[ns].unknown_tenant == 2  # the record-less files: never matched by --salt, and said so
    assert (by_ns[other_ns].chunks, by_ns[other_ns].unknown_tenant) == (3, 0)  # salt B of the other model

    done = purge(disk_config(tmp_path), selector, dry_run=False)
    assert [(r.namespace, r.chunks, r.bytes, r.unknown_tenant) for r in done] == \
        [(r.namespace, r.chunks, r.bytes, r.unknown_tenant) for r in dry]
    after = files(disk)
    gone = set(before) - set(after)
    assert len(gone) == 7 and sum(before[g] for g in gone) == sum(r.bytes for r in done)
    kept = {c.hex() for name in ("A", "none", "unknown") for c in chains[name]}
    assert {k.split("/")[-1][:-4] for k in after} == kept
    assert purge(disk_config(tmp_path), selector, dry_run=True)[0].chunks == 0  # idempotent


def test_a_purged_chunk_is_a_miss_for_the_live_store_never_served(tmp_path, populated):
    store, _other, chains = populated
    b = chains["B"]
    store.clear(["cpu"])  # only the disk tier holds them now: a live engine's cpu tier is out of a purge's reach
    assert store.lookup(b) == 4  # the index still says so ...
    purge(disk_config(tmp_path), PurgeSelector(cache_salt="B"), dry_run=False)
    handle = store.prepare_load(b)  # ... but the file is gone: a miss, the engine recomputes
    assert handle.num_chunks == 0
    store.complete_load(handle, False)
    assert store.rescan() >= 0 and store.lookup(b) == 0  # the next rescan drops it from the index
    assert store.get(chains["A"]) == [payload(k) for k in chains["A"]]


def test_lora_selector_and_no_salt_record(tmp_path):
    store = make_store(tmp_path, cpu_chunks=16, disk_chunks=16, write_mode="write-through")
    put(store, chain_of(1, 2), TenantId.of(None, "sql-adapter"))
    put(store, chain_of(2, 2, "B"), TenantId.of("B", "sql-adapter"))
    put(store, chain_of(3, 2), TenantId.of(None, None))
    store.flush()
    config = disk_config(tmp_path)
    assert sum(r.chunks for r in purge(config, PurgeSelector(lora_name="sql-adapter"), True)) == 4
    assert sum(r.chunks for r in purge(config, PurgeSelector(lora_name="other"), True)) == 0
    assert sum(r.chunks for r in purge(config, PurgeSelector(cache_salt="B", lora_name="sql-adapter"), True)) == 2
    assert sum(r.chunks for r in purge(config, PurgeSelector(cache_salt="B"), True)) == 2  # no-salt chunks never match
    store.close()


def test_a_damaged_tenant_record_on_disk_is_kept_and_a_problem(tmp_path, populated):
    """A record that fails its own checksum is never trusted: not matched, not "unknown", a problem."""
    from kvtier.core.tiers.disk.chunkfile import TENANT_OFFSET

    store, _other, chains = populated
    path = store.tier("disk").path(chains["B"][0])
    raw = bytearray(path.read_bytes())
    raw[TENANT_OFFSET + 10] ^= 0x01
    path.write_bytes(bytes(raw))
    done = purge(disk_config(tmp_path), PurgeSelector(cache_salt="B"), dry_run=False)
    (mine,) = [r for r in done if r.namespace.hex() == store.tier("disk").dir.name]
    assert (mine.chunks, mine.unknown_tenant, mine.damaged_tenant) == (3, 2, 1)
    assert len(mine.problems) == 1 and str(path) in mine.problems[0] and "fails its checksum" in mine.problems[0]
    assert path.exists()


def test_namespace_and_age_selectors(tmp_path, populated):
    store, other, _chains = populated
    disk = tmp_path / "disk"
    other_dir = other.tier("disk").dir
    old = sorted(store.tier("disk").dir.glob("*/*.kvc"))[:5]
    week_ago = time.time() - 7 * 86400
    for path in old:
        os.utime(path, (week_ago, week_ago))
    config = disk_config(tmp_path)
    aged = purge(config, PurgeSelector(older_than_s=parse_duration("1d")), dry_run=False)
    assert sum(r.chunks for r in aged) == 5 and not any(p.exists() for p in old)
    assert len(files(disk)) == 14 - 5
    only = purge(config, PurgeSelector(namespaces=frozenset({bytes.fromhex(other_dir.name)})), dry_run=False)
    assert [(r.namespace.hex(), r.chunks) for r in only] == [(other_dir.name, 3)]
    assert len(files(disk)) == 14 - 5 - 3 and not list(other_dir.glob("*/*.kvc"))


def test_bad_selectors_are_one_sentence():
    for text in ("7 days", "-1h", "0", "h", "0s"):
        with pytest.raises(UserError, match="--older-than"):
            parse_duration(text)
    # A bare number is refused: "--older-than 7" read as seconds purged nearly everything (new user 5).
    for text in ("7", "90", "1.5"):
        with pytest.raises(UserError, match=r"give a number with s, m, h, d or w, e\.g\. 12h or 7d"):
            parse_duration(text)
    assert parse_duration("90s") == 90 and parse_duration("12h") == 43200 and parse_duration("1.5m") == 90
    with pytest.raises(UserError, match="32 hex digits"):
        parse_namespace("xyz")
    with pytest.raises(UserError, match="/nonexistent/kvtier does not exist"):
        purge(KVTierConfig.from_dict({"disk_path": "/nonexistent/kvtier"}), PurgeSelector(cache_salt="B"), True)
    with pytest.raises(UserError, match="/etc/passwd is not a directory"):
        purge(KVTierConfig.from_dict({"disk_path": "/etc/passwd"}), PurgeSelector(cache_salt="B"), True)


# ---- redis ------------------------------------------------------------------------------------
def redis_store(url: str, prefix: str, namespace=NS, cluster: bool = False) -> TieredStore:
    config = KVTierConfig.from_dict({"chunk_tokens": 4, "cpu_gib": 64 * CHUNK_BYTES / 2**30, "redis_url": url,
                                     "redis_key_prefix": prefix, "redis_cluster": cluster, "shared_deadline_s": 2.0,
                                     "shared_transfer_deadline_s": 2.0, "redis_timeout_s": 2.0})
    return TieredStore(config, namespace, CHUNK_BYTES)


@pytest.mark.parametrize("server", ["redis_server", "redis_cluster"])
def test_redis_purge_by_namespace_and_age(server, request, key_prefix):
    srv = request.getfixturevalue(server)
    url = srv.url
    cluster = server == "redis_cluster"
    a, b = redis_store(url, key_prefix, cluster=cluster), redis_store(url, key_prefix, OTHER_NS, cluster=cluster)
    put(a, chain_of(1, 4, "B"), TenantId.of("B", None))
    put(b, chain_of(2, 3), None)
    a.flush()
    b.flush()
    config = KVTierConfig.from_dict({"redis_url": url, "redis_key_prefix": key_prefix, "redis_cluster": cluster})
    ns_a = a.tier("redis").prefix[len(key_prefix):].split(b":")[0].decode()

    dry = purge(config, PurgeSelector(), dry_run=True)
    assert sorted(r.chunks for r in dry) == [3, 4]
    value_bytes = HEADER_BYTES + CHUNK_BYTES  # the shared value's header (with its tenant record) and the payload
    assert all(r.bytes == r.chunks * value_bytes for r in dry)
    salted = purge(config, PurgeSelector(cache_salt="B"), dry_run=True)  # tests/core/test_shared_tenant_purge.py
    assert sum(r.chunks for r in salted) == 4 and sum(r.unknown_tenant for r in salted) == 3

    client = redis.RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    try:
        keys_a = [a.tier("redis").rkey(k) for k in chain_of(1, 4, "B")]
        client.pexpire(keys_a[0], (86400 - 7200) * 1000)  # written two hours ago, by its remaining TTL
        aged = purge(config, PurgeSelector(older_than_s=3600), dry_run=False)
        assert [(r.namespace.hex(), r.chunks, r.bytes) for r in aged if r.chunks] == [(ns_a, 1, value_bytes)]
        assert client.exists(keys_a[0]) == 0 and client.exists(keys_a[1]) == 1

        done = purge(config, PurgeSelector(namespaces=frozenset({parse_namespace(ns_a)})), dry_run=False)
        assert [(r.namespace.hex(), r.chunks, r.bytes) for r in done] == [(ns_a, 3, 3 * value_bytes)]
        assert sum(client.exists(k) for k in keys_a) == 0
        left = purge(config, PurgeSelector(), dry_run=True)
        assert [r.chunks for r in left] == [3]  # the other namespace is untouched
    finally:
        client.close()
        a.close()
        b.close()


def test_a_ttl_longer_than_the_purge_assumes_is_a_problem_not_a_quiet_zero(redis_server, key_prefix):
    """Engines with a week's redis_ttl_s and a purge assuming the default day: every age read negative,
    so --older-than removed nothing and said only "0 chunks" (tester3)."""
    store = redis_store(redis_server.url, key_prefix)
    put(store, chain_of(1, 2), None)
    store.flush()
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = [store.tier("redis").rkey(k) for k in chain_of(1, 2)]
        client.pexpire(keys[0], 7 * 86400 * 1000)  # as an engine with redis_ttl_s one week writes it
        config = KVTierConfig.from_dict({"redis_url": redis_server.url, "redis_key_prefix": key_prefix})
        (result,) = purge(config, PurgeSelector(older_than_s=60), dry_run=False)
        assert result.chunks == 0 and client.exists(keys[0]) == 1
        (problem,) = result.problems  # "604,800 s" or a second less: the clock runs between the two calls
        assert problem.startswith("a value has 604,") and problem.endswith(
            " s left to live, more than redis_ttl_s 86,400 s: the engines use a longer redis_ttl_s, so ages cannot "
            "be told; pass theirs with --redis-ttl-s (values kept)")
        week = KVTierConfig.from_dict({"redis_url": redis_server.url, "redis_key_prefix": key_prefix,
                                       "redis_ttl_s": 7 * 86400})
        (right,) = purge(week, PurgeSelector(older_than_s=60), dry_run=True)
        assert right.problems == []  # the week-long key is fresh; the day-long one reads six days old
        assert right.chunks == 1
    finally:
        client.close()
        store.close()


def test_a_cluster_node_without_redis_cluster_is_refused_not_purged_in_part(redis_cluster, key_prefix):
    config = KVTierConfig.from_dict({"redis_url": redis_cluster.url, "redis_key_prefix": key_prefix})
    with pytest.raises(UserError, match="add --redis-cluster"):
        purge(config, PurgeSelector(), dry_run=True)


def test_unreachable_redis_is_one_sentence_and_the_disk_purge_before_it_is_still_reported(tmp_path, key_prefix):
    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=8, write_mode="write-through")
    chain = chain_of(1, 2)
    store.put(chain, [payload(k) for k in chain])
    store.close()
    for url, cluster in (("redis://127.0.0.1:1/0", False), ("redis://127.0.0.1:1/0", True)):
        config = KVTierConfig.from_dict({"disk_path": str(tmp_path / "disk"), "disk_gib": 0.01, "redis_url": url,
                                         "redis_cluster": cluster, "redis_key_prefix": key_prefix})
        disk, failed = purge(config, PurgeSelector(), dry_run=True)
        assert (disk.tier, disk.chunks, disk.problems) == ("disk", 2, [])
        assert (failed.tier, failed.namespace, failed.chunks) == ("redis", b"", 0)
        (problem,) = failed.problems
        assert "could not be reached" in problem or "did not answer the purge" in problem
        assert "Traceback" not in problem and "\n" not in problem
    from kvtier.core.purge import purge_tier

    with pytest.raises(PurgeFailed, match="could not be reached"):  # one tier's purge raises; purge() reports
        purge_tier("redis", config, PurgeSelector(), True)
