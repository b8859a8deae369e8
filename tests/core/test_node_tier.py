"""The node tier's failure behaviour with real processes (issue 38 item 2): the pool's owner
(``kvtier node serve``) killed, stopped and restarted; engines (this process, or a subprocess
SIGKILLed mid-load) holding leases; pages reused under a reader's pin.  The data-path contract
itself is the conformance suite's (tests/core/test_tier_conformance.py, the ``node`` harness)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import GetResult, PutResult, TierContext, builtin
from kvtier.core.tiers.node import protocol
from kvtier.core.tiers.node.client import NodeClient
from kvtier.core.tiers.node.tier import NodeTier
from kvtier.core.tiers.wrappers import unwrap
from tests.node_servers import SRC, NodeServer

CHUNK = 8192
NS = bytes(range(16))
DEADLINE_S = 1.0


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def data(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


def engine_tier(server: NodeServer, ns: bytes = NS, probe_s: float = 0.2):
    """The node tier as an engine builds it (the plug-in: GuardedTier over NodeTier)."""
    config = KVTierConfig.from_dict({"node_socket": server.socket, "shared_deadline_s": DEADLINE_S,
                                     "shared_transfer_deadline_s": DEADLINE_S, "node_timeout_s": DEADLINE_S,
                                     "node_breaker_failures": 2, "node_breaker_probe_s": probe_s})
    tier = builtin.NODE.build(TierContext(config, ns, CHUNK, 1, CollectorRegistry()))
    assert tier is not None
    return tier


def read(tier, k) -> tuple[GetResult, bytes]:
    out = bytearray(CHUNK)
    return tier.get_into(k, memoryview(out)), bytes(out)


def until(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_a_dead_owner_is_a_run_of_misses_within_the_deadline_and_the_pool_comes_back_warm(node_server):
    """SIGKILL of the owner: every read and write is a miss (FAILED) within the deadline, the
    breaker opens; the owner restarted on the same pool takes its values back (the heads), and the
    engine re-attaches on its own and is served the bytes it wrote before."""
    tier = engine_tier(node_server)
    try:
        assert tier.put_many([key(i) for i in range(4)], [data(i) for i in range(4)]) == [PutResult.STORED] * 4
        node_server.kill()
        for i in range(4):
            t0 = time.monotonic()
            assert read(tier, key(i))[0] is GetResult.MISS
            assert tier.put(key(10 + i), data(i)) is PutResult.FAILED
            assert time.monotonic() - t0 < 2 * DEADLINE_S + 0.5
        assert tier.wire_stats().breaker_opened >= 1
        node_server.start()
        assert until(lambda: read(tier, key(0)) == (GetResult.HIT, data(0)))
        assert [read(tier, key(i)) for i in range(4)] == [(GetResult.HIT, data(i)) for i in range(4)]
        assert unwrap(tier).client.attached >= 2  # a new connection to the new owner
        assert node_server.stats().epoch == 2
        tier.check()
    finally:
        tier.close()


def test_a_stalled_owner_is_a_miss_within_the_deadline_and_serves_again_when_it_resumes(node_server):
    """SIGSTOP of the owner: lookups are still answered, from the pool's presence table, with no
    message (a socket lookup could only time out: absent), until its heartbeat is stale; then they
    are misses, as reads are at once; it serves again when it resumes."""
    tier = engine_tier(node_server)
    try:
        assert tier.put(key(1), data(1)) is PutResult.STORED
        node_server.pause()
        try:
            assert tier.contains_many([key(1), key(2)]) == [True, False]  # answered while the owner is stopped
            t0 = time.monotonic()
            assert read(tier, key(1))[0] is GetResult.MISS
            assert time.monotonic() - t0 < DEADLINE_S + 0.5
            assert until(lambda: tier.contains_now([key(1)]) is None)  # the heartbeat went stale
            t0 = time.monotonic()
            assert tier.contains_many([key(1)]) == [False]
            assert time.monotonic() - t0 < DEADLINE_S + 0.5
        finally:
            node_server.resume()
        assert until(lambda: read(tier, key(1)) == (GetResult.HIT, data(1)))
        assert until(lambda: tier.contains_now([key(1), key(2)]) == [True, False])
    finally:
        tier.close()


def test_a_read_waits_for_a_connection_a_stalled_write_holds_no_longer_than_its_deadline(node_server):
    """A read pins on the caller's thread (no hop to the guard's: the tier bounds its own waits), so
    every wait is its own to bound: with the owner SIGSTOPped while another thread's write holds the
    connection (waiting up to ``node_timeout_s``), a read given 0.2 s gives up within them, a
    ``deadline`` miss counted against the breaker; the owner resumed, it is served again."""
    tier = engine_tier(node_server)
    try:
        assert tier.put(key(1), data(1)) is PutResult.STORED
        node_server.pause()
        try:
            writer = threading.Thread(target=tier.put, args=(key(2), data(2)))
            writer.start()
            assert until(unwrap(tier).client._lock.locked, 5.0)  # the write waits on the stopped owner
            why: dict[ChunkKey, str] = {}
            t0 = time.perf_counter()
            got = tier.get_many([key(1)], [memoryview(bytearray(CHUNK))], why=why, within_s=0.2)
            took_s = time.perf_counter() - t0
            assert got == [GetResult.MISS] and why == {key(1): "deadline"}
            assert 0.19 <= took_s < 0.4, took_s
            assert tier.wire_stats().errors["get"] == 1
            writer.join()
        finally:
            node_server.resume()
        assert until(lambda: read(tier, key(1)) == (GetResult.HIT, data(1)))
    finally:
        tier.close()


def test_a_lookup_is_answered_from_the_pool_while_the_owner_is_busy_with_a_large_put_batch(node_server):
    """The scheduler's side of a lookup never waits for the owner: while another engine's batch of
    writes holds the owner (stopped here between its alloc and its commit, the longest an owner can
    be kept from a lookup), lookups answer from the presence table, the committed values present
    and the batch's uncommitted ones absent; committed, they are present."""
    tier, writer = engine_tier(node_server), engine_tier(node_server)
    try:
        assert tier.put_many([key(i) for i in range(4)], [data(i) for i in range(4)]) == [PutResult.STORED] * 4
        inner = unwrap(writer)
        grants, _, _ = inner.client.call(protocol.Alloc(NS, [bytes(key(i)) for i in range(4, 64)],
                                                           [CHUNK] * 60, []))
        node_server.pause()
        try:
            assert tier.contains_many([key(i) for i in range(8)]) == [True] * 4 + [False] * 4
        finally:
            node_server.resume()
        assert isinstance(grants, protocol.Allocated)
        leases = [g[0] for g in grants.grants if isinstance(g, tuple)]
        assert len(leases) == 60
        done, _, _ = inner.client.call(protocol.Commit(leases, []))
        assert isinstance(done, protocol.Done) and all(done.ok)
        assert tier.contains_many([key(i) for i in range(64)]) == [True] * 64
        tier.check()
    finally:
        tier.close()
        writer.close()


def test_the_schedulers_lookup_is_answered_at_its_first_poll_while_the_owner_is_stopped(node_server):
    """The scheduler's lookups (RemoteLookups) take the node tier's answer on the scheduler's own
    thread: with the owner stopped, the first poll already has the answer (no lookup thread, no
    message), and none is counted as timed out."""
    from kvtier.integrations.vllm.scheduler.remote import RemoteLookups

    tier = engine_tier(node_server)
    lookups = RemoteLookups(KVTierConfig.from_dict({"node_socket": node_server.socket, "tiers": ["cpu", "node"],
                                                    "shared_deadline_s": DEADLINE_S}))
    try:
        assert tier.put(key(1), data(1)) is PutResult.STORED
        assert lookups.bind([NS])
        assert until(lambda: lookups.poll_pages("first", [bytes(key(3))]) is not None)  # the pool mapped
        node_server.pause()
        try:
            assert lookups.poll_pages("r", [bytes(key(1)), bytes(key(2))]) == frozenset({bytes(key(1))})
        finally:
            node_server.resume()
        counts = lookups.counters()
        assert (counts["shared_lookups"], counts["shared_lookups_answered"], counts["shared_lookups_timed_out"]) \
            == (2, 2, 0)
        assert lookups.outcome("r") is None
    finally:
        lookups.close()
        tier.close()


def _reuse_the_page(server: NodeServer, victim: ChunkKey, new_key: ChunkKey, new_value: bytes) -> None:
    """Delete ``victim`` and write ``new_value`` until it lands on the freed page (another engine)."""
    other = NodeTier(NodeClient(server.socket, 5.0, "other"), NS, None, 5.0)
    try:
        assert other.delete(victim)
        assert other.put(new_key, new_value) is PutResult.STORED
    finally:
        other.close()


def test_a_page_reused_under_a_readers_pin_is_a_miss_never_the_new_bytes(tmp_path):
    """A reader's pin outlived (its lease expired, or the owner restarted and lost it), the page
    granted to another value: the reader's copy is a miss, never the other value's bytes (the
    generation stamped on the pages differs from the pin's)."""
    server = NodeServer(tmp_path, lease_s=0.5, page_kib=16).start()
    try:
        reader = NodeTier(NodeClient(server.socket, 5.0, "reader"), NS, None, 5.0)
        assert reader.put(key(1), data(1)) is PutResult.STORED
        fetched = reader.fetch_many([key(1)])  # pinned: the wire half of a read
        page = fetched[0][0][1]
        assert until(lambda: server.stats().leases == 0, 10.0)  # the pin expired (a stalled reader)
        _reuse_the_page(server, key(1), key(2), data(2))
        again = reader.fetch_many([key(2)])
        assert again[0][0][1] == page  # the new value sits on the very page the old pin named
        out = bytearray(CHUNK)
        assert reader.finish_get([key(1)], fetched, [memoryview(out)]) == [GetResult.MISS]
        assert reader.corrupt == 0
        # the same after an owner restart: the restarted owner knows nothing of the old pins
        fetched = reader.fetch_many([key(2)])
        server.kill()
        server.start()
        _reuse_the_page(server, key(2), key(3), data(3))
        assert reader.finish_get([key(2)], fetched, [memoryview(out)]) == [GetResult.MISS]
        assert read(reader, key(3)) == (GetResult.HIT, data(3))
        reader.close()
    finally:
        server.stop()


ENGINE = """
import sys, time
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.node.client import NodeClient
from kvtier.core.tiers.node.tier import NodeTier
tier = NodeTier(NodeClient(sys.argv[1], 5.0, "doomed"), bytes(range(16)), None, 5.0)
keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(8)]
tier.put_many(keys, [bytes(8192)] * 8)
print("ready", flush=True)
while True:  # loads that never release: pins held, and writes granted but never published
    tier.fetch_many(keys)
    tier.client.call(lambda rel: __import__("kvtier.core.tiers.node.protocol", fromlist=["x"]).Alloc(
        bytes(range(16)), [ChunkKey(bytes(16))], [8192], []))
"""


def test_an_engine_killed_during_loads_leaves_no_lease(node_server):
    """SIGKILL of an engine holding pins and an unpublished write: the owner ends every lease of
    its connection, the values it pinned can be evicted again, and the pages it was granted are free."""
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, node_server.socket], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": SRC})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        assert until(lambda: node_server.stats().leases > 8, 20.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert until(lambda: node_server.stats().leases == 0, 10.0)
    stats = node_server.stats()
    assert stats.problem == "" and stats.num_values == 8
    assert stats.used_bytes == 8 * 3 * 4096  # 8 values of 3 pages: no granted page left behind


def test_an_engine_restart_finds_the_pool_warm_and_usage_is_counted_once(node_server):
    """Two engines on one pool: each is counted for what it wrote, so the sum is the pool's usage
    (once); an engine that restarts reads what its earlier life and its neighbour wrote, and the
    values of an engine gone are counted by the oldest live writer."""
    first, second = engine_tier(node_server), engine_tier(node_server)
    try:
        assert first.put_many([key(i) for i in range(3)], [data(i) for i in range(3)]) == [PutResult.STORED] * 3
        assert second.put_many([key(i) for i in range(2, 5)], [data(i) for i in range(2, 5)]) == \
            [PutResult.PRESENT, PutResult.STORED, PutResult.STORED]
        pool = node_server.stats()
        assert pool.num_values == 5
        assert first.usage().used_bytes + second.usage().used_bytes == pool.used_bytes
        assert first.usage().num_chunks == 3 and second.usage().num_chunks == 2
        first.close()
        restarted = engine_tier(node_server)
        try:
            assert [read(restarted, key(i)) for i in range(5)] == [(GetResult.HIT, data(i)) for i in range(5)]
            assert second.usage().used_bytes < pool.used_bytes  # as of its last reply: no I/O in usage()
            assert second.refresh_usage().used_bytes == pool.used_bytes  # the oldest live writer inherits the rest
            assert restarted.usage().used_bytes == 0  # it wrote nothing (its reads' replies say so)
        finally:
            restarted.close()
    finally:
        second.close()


def test_an_idle_engines_count_follows_the_owners_after_a_neighbours_connection_fault(node_server):
    """Engine B wrote first (the oldest live writer), then A; A's connection is cut (a fault: the
    owner drops it and counts A's values for B) and A serves again on a new connection (counted
    afresh).  B sends nothing meanwhile (idle), yet what both report (``usage()``, what the store
    reads each step, without waiting) sums to the pool's usage again within B's max age: B's read
    asks the owner again in the background (the CI run J defect: B's count stayed stale until it
    served)."""
    b, a = engine_tier(node_server), engine_tier(node_server)
    a_client, b_client = unwrap(a).client, unwrap(b).client
    try:
        assert b.put_many([key(0)], [data(0)]) == [PutResult.STORED]
        assert a.put_many([key(i) for i in range(1, 4)], [data(i) for i in range(1, 4)]) == [PutResult.STORED] * 3
        pool = node_server.stats()
        assert (b.usage().num_chunks, a.usage().num_chunks) == (1, 3)
        assert a.usage().used_bytes + b.usage().used_bytes == pool.used_bytes
        for client in (a_client, b_client):
            client.usage_max_age_s = 0.5
        assert a_client._sock is not None
        a_client._sock.shutdown(socket.SHUT_RDWR)  # the fault: the owner sees A's connection end
        assert until(lambda: read(a, key(1)) == (GetResult.HIT, data(1)), timeout_s=10.0)  # A on a new connection
        assert a_client.attached == 2 and b_client.attached == 1
        assert until(lambda: a.usage().used_bytes + b.usage().used_bytes == node_server.stats().used_bytes,
                     timeout_s=10.0), (a.usage(), b.usage(), node_server.stats())
        assert (b.usage().num_chunks, a.usage().num_chunks) == (4, 0)  # B, the oldest live writer, has A's
        assert b_client.attached == 1  # B asked on its connection, sent no load or save
    finally:
        a.close()
        b.close()


def test_values_a_restarted_owner_took_back_are_counted_once_by_engines_that_only_read(node_server):
    """The owner SIGKILLed and restarted warm: the values it takes back have no live writer, and the
    engines, on new connections, only read them (every prefix they ask is in the pool).  What the
    engines report still sums to the pool's usage: the oldest live engine connection inherits them,
    a reader as well as a writer (sh57: two vLLM engines under load after an owner restart each
    reported ``kvtier_usage_bytes{node}`` 0 against the pool's 2,621,440 bytes)."""
    a, b = engine_tier(node_server), engine_tier(node_server)
    try:
        assert a.put_many([key(i) for i in range(3)], [data(i) for i in range(3)]) == [PutResult.STORED] * 3
        node_server.kill()
        node_server.start()
        pool = node_server.stats()
        assert pool.num_values == 3
        for tier in (a, b):  # each re-attaches and reads what the pool holds; neither writes
            assert until(lambda t=tier: read(t, key(0)) == (GetResult.HIT, data(0)), timeout_s=10.0)
            assert [read(tier, key(i)) for i in range(3)] == [(GetResult.HIT, data(i)) for i in range(3)]
        used = [unwrap(t).refresh_usage().used_bytes for t in (a, b)]
        assert sum(used) == pool.used_bytes > 0, (used, pool)
    finally:
        a.close()
        b.close()


def test_namespaces_are_isolated_in_the_pool(node_server):
    mine, theirs = engine_tier(node_server), engine_tier(node_server, ns=bytes(range(1, 17)))
    try:
        assert mine.put(key(1), data(1)) is PutResult.STORED
        assert read(theirs, key(1))[0] is GetResult.MISS and theirs.keys() == []
        assert theirs.put(key(1), data(2)) is PutResult.STORED
        assert read(mine, key(1)) == (GetResult.HIT, data(1)) and read(theirs, key(1)) == (GetResult.HIT, data(2))
    finally:
        mine.close()
        theirs.close()


def test_a_second_owner_of_one_pool_and_bad_flags_are_one_sentence(node_server, tmp_path):
    """A second owner of a live pool is refused before it touches it (even with another size, which
    would recreate the file), and so is a second owner on a live socket; bad flags: one sentence."""
    tier = engine_tier(node_server)
    runner = CliRunner()
    try:
        assert tier.put(key(1), data(1)) is PutResult.STORED
        before = node_server.pool.read_bytes()[:32]
        taken = runner.invoke(app, ["node", "serve", "--pool", str(node_server.pool), "--node-gib", "0.125",
                                    "--socket", str(tmp_path / "b.sock"), "--page-kib", "4"])
        assert taken.exit_code == 2 and "another kvtier node owner serves the pool" in taken.output
        busy = runner.invoke(app, ["node", "serve", "--pool", str(tmp_path / "other"), "--node-gib", "0.0625",
                                   "--socket", node_server.socket])
        assert busy.exit_code == 2 and "another kvtier node owner listens on" in busy.output
        # a refusal leaves nothing it created: no pool, no lock file beside it (fresh-user tester: other.lock)
        assert not (tmp_path / "other").exists() and not (tmp_path / "other.lock").exists()
        assert not (tmp_path / "b.sock").exists()
        assert node_server.pool.read_bytes()[:32] == before and read(tier, key(1)) == (GetResult.HIT, data(1))
    finally:
        tier.close()
    for args, words in ((["--node-gib", "0"], "--node-gib 0 is out of range"),
                        (["--node-gib", "1", "--page-kib", "3"], "--page-kib 3 must be a power of two"),
                        (["--node-gib", "1", "--lease-s", "0"], "--lease-s 0 must be above 0")):
        bad = runner.invoke(app, ["node", "serve", "--pool", str(tmp_path / "p"), "--socket",
                                  str(tmp_path / "s.sock"), *args])
        assert bad.exit_code == 2 and words in bad.output and "Traceback" not in bad.output
        assert len(bad.output.strip().splitlines()) == 1


def test_a_relative_socket_is_refused_as_engines_refuse_it_and_a_disk_backed_pool_is_warned_about(tmp_path):
    """``--socket relative.sock`` is refused in the engines' words (their node_socket must be absolute);
    a pool file on a disk filesystem (not tmpfs/hugetlbfs, docs/node.md) is warned about, not refused."""
    import tempfile
    from pathlib import Path

    from kvtier.core.tiers.disk.check import mount_of

    runner = CliRunner()
    relative = runner.invoke(app, ["node", "serve", "--pool", str(tmp_path / "p"), "--node-gib", "0.0625",
                                   "--socket", "relative.sock"])
    assert relative.exit_code == 2 and "Traceback" not in relative.output, relative.output
    assert relative.output.strip() == ("error: --socket must be an absolute path (engines refuse a relative "
                                       "node_socket), got 'relative.sock'; e.g. --socket /dev/shm/kvtier-node/node.sock")
    assert not os.path.exists("relative.sock") and os.listdir(tmp_path) == []
    with pytest.raises(Exception, match="must be an absolute path"):
        KVTierConfig.from_dict({"node_socket": "relative.sock"})
    disk = Path(tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(__file__))))
    try:
        fstype = mount_of(disk)
        if fstype is None or fstype[0] in ("tmpfs", "hugetlbfs"):
            pytest.skip(f"the test directory {disk} is on {fstype}, not a disk filesystem")
        # the socket's directory is missing: the warning comes first, then the refusal, which leaves nothing
        warned = runner.invoke(app, ["node", "serve", "--pool", str(disk / "pool"), "--node-gib", "0.0625",
                                     "--socket", str(disk / "no" / "s.sock"), "--page-kib", "4"])
        assert warned.exit_code == 2, warned.output
        assert (f"warning: --pool {disk / 'pool'} is on the {fstype[0]} filesystem mounted at {fstype[1]}, not in "
                "memory") in warned.output and "directory" in warned.output.splitlines()[-1]
        assert os.listdir(disk) == []
        in_memory = runner.invoke(app, ["node", "serve", "--pool", f"/dev/shm/{disk.name}", "--node-gib", "0.0625",
                                        "--socket", str(disk / "no" / "s.sock"), "--page-kib", "4"])
        assert in_memory.exit_code == 2 and "warning" not in in_memory.output, in_memory.output
    finally:
        for leftover in disk.iterdir():
            leftover.unlink()
        disk.rmdir()


def test_check_warns_when_node_gib_differs_from_the_live_pools_size(node_server):
    """docs/node.md: node_gib is for kvtier size, check and audit; check compares it with the live
    pool's STATS reply (fresh-user tester: node_gib 64 against a 1 GiB pool said ok, no warning)."""
    import json

    def check(node_gib: float, *flags: str):
        # a cpu tier no larger than the fixture's pool: a larger one is a warning of its own (check and audit)
        extra = {"cpu_gib": 0.0625, "node_socket": node_server.socket, "node_gib": node_gib}
        transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
        return CliRunner().invoke(app, ["check", *flags, json.dumps(transfer)])

    capacity_gib = node_server.stats().capacity_bytes / 2**30
    wrong = check(64)
    assert wrong.exit_code == 0, wrong.output
    (line,) = [w for w in wrong.output.splitlines() if "node_gib" in w]
    assert line == (f"warning: kv_connector_extra_config.node_gib: node_gib=64 but the pool at {node_server.socket} "
                    f"holds {capacity_gib:.3g} GiB (its owner's --node-gib); set node_gib to the owner's --node-gib, "
                    "which kvtier size, check and audit go by")
    assert "1 warning(s)" in wrong.output
    right = check(0.0625)  # the fixture's --node-gib
    assert right.exit_code == 0 and "warning" not in right.output, right.output
    offline = check(64, "--offline")  # no probe, no comparison
    assert offline.exit_code == 0 and "warning" not in offline.output, offline.output
    # the vllm serve plugin's probe says it too, once per process (vLLM builds the config more than once)
    from kvtier.integrations.vllm.plugin import warn_unreachable_shared_tier

    transfer = {"kv_connector": "KVTierConnector", "kv_connector_extra_config": {
        "cpu_gib": 1, "node_socket": node_server.socket, "node_gib": 32}}
    (warned,) = warn_unreachable_shared_tier(transfer)
    assert warned.startswith("WARNING kvtier: node_gib=32 but the pool at ") and "holds" in warned
    assert warn_unreachable_shared_tier(transfer) == []


def test_the_socket_carries_no_payload():
    """Every message is keys, numbers and lease ids: a batch of 64 chunk pins is under 2 KiB
    whatever the chunks' size (the payload moves through the mapped pool)."""
    pin = protocol.frame(protocol.Pin(NS, [bytes(key(i)) for i in range(64)], []))
    grants = protocol.frame(protocol.Pinned([(i, i * 64, 4 << 20, i) for i in range(64)]))
    assert len(pin) < 1300 and len(grants) < 2048
    assert protocol.frame_length(protocol.MAX_FRAME_BYTES.to_bytes(4, "little")) == protocol.MAX_FRAME_BYTES
    with pytest.raises(ValueError):
        protocol.frame_length((protocol.MAX_FRAME_BYTES + 1).to_bytes(4, "little"))


def test_the_mapped_pool_is_registered_memory_where_cuda_is_and_says_why_not_elsewhere(node_server):
    """RegistersMemory on the node tier: its record says so, the engine's (wrapped) tier has it, and
    pinning registers the mapped pool itself (on a CUDA machine); on the CPU backend one sentence
    says why not and the tier serves straight from the mapped pages as before."""
    from kvtier.core import pinned
    from kvtier.core.tiers.base import RegistersMemory, capabilities
    from kvtier.core.tiers.registry import spec
    from tests.core.test_tier_memory import cuda_usable

    tier = engine_tier(node_server)
    try:
        assert isinstance(tier, RegistersMemory) and "registers_memory" in capabilities(tier)
        assert "registers_memory" in spec("node").capabilities
        inner = unwrap(tier)
        pinned_now = inner.pin_host_memory()
        pool = inner.client.pool
        assert pool is not None
        if cuda_usable():
            assert pinned_now and pinned.is_pinned(pool.data)
            assert (pool.data.ctypes.data, pool.data.nbytes) in tier.registered_memory()
        else:
            assert not pinned_now and tier.registered_memory() == [] and not pinned.is_pinned(pool.data)
        assert tier.put(key(1), data(1)) is PutResult.STORED and read(tier, key(1)) == (GetResult.HIT, data(1))
    finally:
        tier.close()


def test_kvtier_size_puts_the_node_pool_in_a_recipe_that_kvtier_check_accepts(tmp_path):
    """The tier's settings mark node_socket and node_gib for ``kvtier size`` (no edit in kvtier.cli):
    the recipe's connector config carries them and passes the connector's own validator; node_gib
    without the socket is one sentence."""
    import json
    import re

    runner = CliRunner()
    sock = str(tmp_path / "node.sock")  # checked as start-up would: its directory exists, the owner may come later
    sized = runner.invoke(app, ["size", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--offload-gib", "2",
                                "--node-socket", sock, "--node-gib", "128"])
    assert sized.exit_code == 0, sized.output
    (ktc,) = re.findall(r"--kv-transfer-config '(\{\"kv_connector\":\"KVTierConnector\".*?\})'", sized.output)
    extra = json.loads(ktc)["kv_connector_extra_config"]
    assert extra["node_socket"] == sock and extra["node_gib"] == 128
    checked = runner.invoke(app, ["check", ktc, "--offline"])
    assert checked.exit_code == 0, checked.output
    stray = runner.invoke(app, ["size", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--node-gib", "128"])
    assert stray.exit_code == 2 and "--node-socket" in stray.output and "Traceback" not in stray.output


def test_the_owner_serves_a_bounded_number_of_connections(tmp_path):
    """--max-clients bounds the owner's connections (each has at most one request in flight, so it
    bounds its queue): one more is refused in one sentence, and served once a slot is free."""
    from kvtier.core.tiers.node.client import NodeUnavailable

    server = NodeServer(tmp_path, max_clients=1).start()
    first = NodeTier(NodeClient(server.socket, 5.0, "first"), NS, None, 5.0)
    second = NodeTier(NodeClient(server.socket, 5.0, "second"), NS, None, 5.0)
    try:
        assert first.put(key(1), data(1)) is PutResult.STORED
        with pytest.raises(NodeUnavailable, match="serves 1 connections already; raise --max-clients"):
            second.contains(key(1))
        first.close()
        assert until(lambda: _answers(second), 10.0)
        assert second.contains(key(1))
    finally:
        first.close()
        second.close()
        server.stop()


def _answers(tier: NodeTier) -> bool:
    try:
        tier.contains(key(0))
    except ConnectionError:
        return False
    return True


def test_purge_and_the_probe_reach_the_pool_through_its_blob_store(node_server):
    """The plug-in's blob store (list, stat, delete over the owner's messages): ``kvtier purge
    --node-socket`` removes one namespace's values and never another's, and ``kvtier check`` probes
    the owner (reachable; unreachable once it is killed) with no code of their own."""
    import json

    other_ns = bytes(range(1, 17))
    mine, theirs = engine_tier(node_server), engine_tier(node_server, ns=other_ns)
    runner = CliRunner()
    try:
        assert mine.put_many([key(i) for i in range(3)], [data(i) for i in range(3)]) == [PutResult.STORED] * 3
        assert theirs.put(key(1), data(1)) is PutResult.STORED
        dry = runner.invoke(app, ["purge", "--node-socket", node_server.socket, "--all", "--dry-run", "--json"])
        assert dry.exit_code == 0, dry.output
        assert node_server.stats().num_values == 4
        gone = runner.invoke(app, ["purge", "--node-socket", node_server.socket, "--namespace", NS.hex(), "--json"])
        assert gone.exit_code == 0, gone.output
        assert json.loads(gone.output)["total"]["chunks"] == 3
        assert json.loads(dry.output)["total"]["chunks"] == 4
        assert [read(mine, key(i))[0] for i in range(3)] == [GetResult.MISS] * 3
        assert read(theirs, key(1)) == (GetResult.HIT, data(1)) and node_server.stats().num_values == 1
        ktc = json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                          "kv_connector_extra_config": {"cpu_gib": 1, "tiers": ["cpu", "node"],
                                                        "node_socket": node_server.socket}})
        up = runner.invoke(app, ["check", ktc])
        assert up.exit_code == 0 and "is reachable" in up.output, up.output
        node_server.kill()
        down = runner.invoke(app, ["check", ktc])
        assert "is unreachable" in down.output and "Traceback" not in down.output, down.output
    finally:
        mine.close()
        theirs.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_batch_verifies_every_value_it_serves_on_the_helper_thread_or_inline(node_server, overlap):
    """A batch of 6 values with one payload byte changed in the pool: that value is a counted miss
    (deleted), the other 5 are served exactly; with ``overlap`` the digests ran on the helper thread
    (:mod:`kvtier.core.tiers.node.readcopy`), without it on the caller's; the same for a batch whose
    only value is the changed one (verified inline)."""
    tier = engine_tier(node_server)
    inner = unwrap(tier)
    assert isinstance(inner, NodeTier)
    inner.verifier.overlap = overlap
    try:
        keys = [key(i) for i in range(6)]
        assert tier.put_many(keys, [data(i) for i in range(6)]) == [PutResult.STORED] * 6
        reply, pool, serial = inner.client.call(protocol.Pin(NS, [bytes(keys[3])], []))
        lease, page, nbytes, _gen = reply.leases[0]
        pool.value(page, nbytes)[nbytes - 5] ^= 0x40  # a payload byte near the end (the last block)
        inner.client.release_later(serial, [lease])
        outs = [bytearray(CHUNK) for _ in keys]
        got = tier.get_many(keys, [memoryview(o) for o in outs])
        assert got == [GetResult.HIT] * 3 + [GetResult.CORRUPT] + [GetResult.HIT] * 2
        assert [bytes(o) for i, o in enumerate(outs) if i != 3] == [data(i) for i in range(6) if i != 3]
        helper = inner.verifier._helper
        assert (helper is not None) is overlap
        assert until(lambda: node_server.stats().num_values == 5)  # the corrupt value was deleted
        # one value alone is verified on the caller's thread: a changed byte is caught there too
        assert tier.put(key(9), data(9)) is PutResult.STORED
        reply, pool, serial = inner.client.call(protocol.Pin(NS, [bytes(key(9))], []))
        lease, page, nbytes, _gen = reply.leases[0]
        pool.value(page, nbytes)[nbytes - CHUNK] ^= 0x01  # the first payload byte
        inner.client.release_later(serial, [lease])
        assert read(tier, key(9))[0] is GetResult.CORRUPT
        assert tier.get_many(keys[:2], [memoryview(bytearray(CHUNK)) for _ in range(2)]) == [GetResult.HIT] * 2
    finally:
        tier.close()
    assert inner.verifier._helper is None  # closed with the tier


def test_the_way_a_batch_is_verified_is_measured_and_never_overlapped_without_a_spare_core(node_server):
    """Left to measure (``overlap`` None), the verifier never overlaps a batch on 2 CPUs (the helper
    thread is never made), and on 8 it tries both ways and keeps timing them; every batch is served
    exactly either way."""
    from kvtier.core.tiers.disk.tier import ReadChooser

    tier = engine_tier(node_server)
    inner = unwrap(tier)
    assert isinstance(inner, NodeTier) and inner.verifier.overlap is None
    keys = [key(i) for i in range(40)]  # 320 KiB: a batch large enough to be worth splitting (SPLIT_MIN_BYTES)
    try:
        assert tier.put_many(keys, [data(i) for i in range(40)]) == [PutResult.STORED] * 40
        for cpus in (2, 8):
            inner.verifier.chooser = ReadChooser(cpus=cpus)
            for _ in range(8):
                outs = [bytearray(CHUNK) for _ in keys]
                assert tier.get_many(keys, [memoryview(o) for o in outs]) == [GetResult.HIT] * 40
                assert [bytes(o) for o in outs] == [data(i) for i in range(40)]
            chooser = inner.verifier.chooser
            assert chooser.running == 0 and chooser.splits + chooser.serials == 8
            if cpus == 2:
                assert chooser.splits == 0 and inner.verifier._helper is None
            else:
                assert chooser.splits >= 3 and chooser.serials >= 3 and inner.verifier._helper is not None
    finally:
        tier.close()
