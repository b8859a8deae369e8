"""``bench compare --replicas N``: what each replica's server is started with, per arm (no vLLM starts).

- ``native``: every replica the same OffloadingConnector config, so each server allocates a CPU
  tier of its own (the arm shares nothing, as vLLM's native offload shares nothing);
- ``kvtier`` / ``kvtier-redis``: each replica its own ``disk_path`` directory, the Redis server and
  the run's key prefix shared; ``example``: one ``shared_storage_path`` (shared by design);
- ``kvtier-s3``: every replica the same bucket and run prefix on the private ``rclone serve s3``
  the bench starts (a real server here), credentials only in a 0600 file; ``kvtier check`` on a
  replica's config reaches the bucket with them, and a run's objects are removed afterwards;
- ``kvtier-node``: every replica the same ``node_socket``; each run gets a fresh ``kvtier node serve``
  owner (a real one here) on a new pool in /dev/shm, its log beside the servers', stopped and the
  pool deleted after the run, also when the run raises; an owner that cannot start fails that run
  of the arm only;
- bad combinations end in one ``error:`` line and exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench.arms import make_arm
from kvtier.bench.replicas import ReplicaSet, replica_log_paths, replica_specs
from kvtier.bench.runscope import fresh_storage, run_scope
from kvtier.bench.shared_node import LocalNode, NodePool
from kvtier.bench.shared_redis import with_run_prefix as with_key_prefix
from kvtier.bench.shared_s3 import LocalS3, delete_prefix
from kvtier.bench.shared_s3 import with_run_prefix as with_object_prefix
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import GetResult, PutResult
from kvtier.core.tiers.node.client import NodeClient
from kvtier.core.tiers.node.tier import NodeTier
from kvtier.launch.serve import ServerSpec

SPEC = ServerSpec(model="m", max_model_len=1024, cache_tokens=2048, enforce_eager=True)


def serve_line_config(spec: ServerSpec) -> dict:
    """The ``--kv-transfer-config`` value on the server's command line, parsed back."""
    argv = spec.argv(8000)
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def extra_of(spec: ServerSpec) -> dict:
    return serve_line_config(spec)["kv_connector_extra_config"]


def test_native_replicas_each_get_the_same_own_cpu_tier() -> None:
    arm = make_arm("native", Path("/unused"), {"cpu_gib": 0.5})
    spec = dataclasses.replace(SPEC, kv_transfer_config=arm.kv_transfer_config)
    specs = replica_specs(spec, 2)
    lines = [serve_line_config(s) for s in specs]
    assert lines[0] == lines[1]
    assert lines[0]["kv_connector"] == "OffloadingConnector"
    assert lines[0]["kv_connector_extra_config"] == {"cpu_bytes_to_use": 1 << 29}
    import torch

    if not torch.cuda.is_available():
        assert lines[0]["kv_connector_module_path"] == "kvtier.bench.native_cpu"
    # one server per log path, each with its own port and its spec
    logs = replica_log_paths(Path("out/native-run1.log"), 2)
    servers = ReplicaSet(specs, logs).servers
    assert [s.log_path.name for s in servers] == ["native-run1-r0.log", "native-run1-r1.log"]
    assert servers[0].port != servers[1].port and all(s.spec is p for s, p in zip(servers, specs, strict=True))
    with pytest.raises(ValueError, match="1 server specs for 2 log paths"):
        ReplicaSet(specs[:1], logs)


def test_kvtier_replicas_keep_their_own_disk_and_share_the_redis_prefix(tmp_path: Path) -> None:
    config = {"cpu_gib": 0.5, "disk_path": str(tmp_path / "disk"), "disk_gib": 1}
    arm = make_arm("kvtier-redis", tmp_path, config, "redis://127.0.0.1:7/0")
    run_arm, run_dir = fresh_storage(arm, 1)
    run_arm, prefix, _url = with_key_prefix(run_arm, "tag", 1)
    spec = dataclasses.replace(SPEC, kv_transfer_config=run_arm.kv_transfer_config)
    extras = [extra_of(s) for s in replica_specs(spec, 2)]
    assert run_dir == tmp_path / "disk" / "run-1"
    assert [e["disk_path"] for e in extras] == [str(run_dir / "r0"), str(run_dir / "r1")]
    for e in extras:
        assert e["redis_url"] == "redis://127.0.0.1:7/0" and e["redis_key_prefix"] == prefix
    assert {k: v for k, v in extras[0].items() if k != "disk_path"} == \
        {k: v for k, v in extras[1].items() if k != "disk_path"}
    # one replica: the run's directory itself; ExampleConnector's storage is shared by design
    assert extra_of(replica_specs(spec, 1)[0])["disk_path"] == str(run_dir)
    example = make_arm("example", tmp_path)
    spec = dataclasses.replace(SPEC, kv_transfer_config=example.kv_transfer_config)
    paths = [extra_of(s)["shared_storage_path"] for s in replica_specs(spec, 2)]
    assert paths == [str(tmp_path / "example-connector-storage")] * 2
    with pytest.raises(ValueError, match="at least 1"):
        replica_specs(spec, 0)


def test_kvtier_s3_replicas_share_one_bucket_and_run_prefix_on_the_private_server(tmp_path: Path) -> None:
    import obstore
    from obstore.store import S3Store

    server = LocalS3.start(tmp_path / "s3")
    with server:
        target = server.target
        # the config's own endpoint and bucket are replaced by the private server's; other s3 keys stay
        mine = {"cpu_gib": 0.5, "s3_bucket": "elsewhere", "s3_endpoint_url": "https://s3.example:9000",
                "s3_concurrency": 4}
        arm = make_arm("kvtier-s3", tmp_path, mine, None, target.extra_config())
        assert "elsewhere" not in arm.description and "s3.example" not in arm.description
        assert target.endpoint_url in arm.description
        run0, prefix0 = with_object_prefix(arm, "tag", 0)
        _run1, prefix1 = with_object_prefix(arm, "tag", 1)
        assert prefix0 == "kvtier/bench-tag-kvtier-s3-run0/" != prefix1
        assert with_object_prefix(make_arm("kvtier", tmp_path), "tag", 0)[1] is None
        spec = dataclasses.replace(SPEC, kv_transfer_config=run0.kv_transfer_config)
        specs = replica_specs(spec, 2)
        lines = [serve_line_config(s) for s in specs]
        assert lines[0] == lines[1]
        extra = lines[0]["kv_connector_extra_config"]
        assert extra["s3_bucket"] == target.bucket and extra["s3_endpoint_url"] == target.endpoint_url
        assert extra["s3_key_prefix"] == prefix0 and extra["s3_concurrency"] == 4 and extra["s3_allow_http"] is True
        # the credentials are in a file only the owner reads, never on a serve line or in the label
        creds = Path(extra["s3_credentials_file"])
        assert stat.S_IMODE(creds.stat().st_mode) == 0o600
        keys = dict(line.split(" = ") for line in creds.read_text().splitlines() if " = " in line)
        secret = keys["aws_secret_access_key"]
        assert len(secret) >= 32 and all(secret not in " ".join(s.argv(8000)) for s in specs)
        assert secret not in arm.description
        # a replica's config, as vLLM's preflight reads it: the bucket answers with those credentials
        check = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "check", json.dumps(lines[0])],
                               capture_output=True, text=True, timeout=60, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        assert f"shared tier {target.endpoint_url}/{target.bucket}/{prefix0} is reachable" in check.stdout
        # a run's objects go afterwards; another run's stay
        store = S3Store(target.bucket, endpoint=target.endpoint_url, access_key_id=keys["aws_access_key_id"],
                        secret_access_key=secret, region="us-east-1", virtual_hosted_style_request=False,
                        client_options={"allow_http": True, "timeout": "10s"})
        for key in (f"{prefix0}ns/a", f"{prefix0}ns/b", f"{prefix1}ns/a"):
            obstore.put(store, key, b"x" * 10)
        assert delete_prefix(target, prefix0) == 2
        assert delete_prefix(target, prefix0) == 0
        assert sorted(m["path"] for m in obstore.list(store).collect()) == [f"{prefix1}ns/a"]
        port = server.port
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
        pass


def _pool_stats(socket_path: str):
    from kvtier.core.tiers.node import protocol as p

    client = NodeClient(socket_path, 5.0, "test")
    try:
        reply, _, _ = client.call(p.Stats())
        assert isinstance(reply, p.StatsReply)
        return reply
    finally:
        client.close()


def test_kvtier_node_replicas_share_one_fresh_owner_per_run(tmp_path: Path) -> None:
    pool = NodePool.make(0.01, page_kib=16)
    try:
        assert pool.dir.parent == Path("/dev/shm") and stat.S_IMODE(pool.dir.stat().st_mode) == 0o700
        # the config's own node_socket is replaced by the bench's pool; other keys stay
        arm = make_arm("kvtier-node", tmp_path, {"cpu_gib": 0.5, "node_socket": "/run/elsewhere.sock",
                                                 "node_timeout_s": 5.0}, node_config=pool.extra_config())
        assert "/run/elsewhere.sock" not in arm.description and pool.socket in arm.description
        with pytest.raises(ValueError, match="kvtier-node arm needs the pool"):
            make_arm("kvtier-node", tmp_path, {"cpu_gib": 0.5})
        spec = dataclasses.replace(SPEC, kv_transfer_config=arm.kv_transfer_config)
        lines = [serve_line_config(s) for s in replica_specs(spec, 2)]
        assert lines[0] == lines[1]
        extra = lines[0]["kv_connector_extra_config"]
        assert extra["node_socket"] == pool.socket and extra["node_gib"] == 0.01 and extra["node_timeout_s"] == 5.0
        for k in range(2):
            log = tmp_path / f"kvtier-node-run{k}.node.log"
            with run_scope(arm, k, "tag", node_pool=pool, node_log=log) as run_arm:
                assert run_arm == arm
                assert pool.pool_path.stat().st_size == int(0.01 * (1 << 30))  # the pool's size is the arm's node_gib
                # a real owner answers on the replicas' socket, with a fresh pool (no run starts warm) ...
                assert (_pool_stats(pool.socket).epoch, _pool_stats(pool.socket).num_values) == (1, 0)
                # ... that one replica writes and the other reads, as the run's servers do
                writer = NodeTier(NodeClient(pool.socket, 5.0, "r0"), bytes(16), None, 5.0)
                reader = NodeTier(NodeClient(pool.socket, 5.0, "r1"), bytes(16), None, 5.0)
                try:
                    assert writer.put(ChunkKey(bytes(16)), b"kv" * 4096) is PutResult.STORED
                    out = bytearray(8192)
                    assert reader.get_into(ChunkKey(bytes(16)), memoryview(out)) is GetResult.HIT
                    assert bytes(out) == b"kv" * 4096 and _pool_stats(pool.socket).num_values == 1
                finally:
                    writer.close()
                    reader.close()
            assert log.is_file() and "node" in log.read_text().lower()  # the owner's log, beside the servers'
            assert not pool.pool_path.exists() and not Path(pool.socket).exists()  # stopped, pool deleted
        # an arm that does not name the pool gets no owner
        with run_scope(make_arm("kvtier", tmp_path), 0, "tag", node_pool=pool, node_log=tmp_path / "x.log"):
            assert not Path(pool.socket).exists()
        assert not (tmp_path / "x.log").exists()
        # the owner goes when the run raises, too
        with pytest.raises(RuntimeError, match="engine died"), \
                run_scope(arm, 2, "tag", node_pool=pool, node_log=tmp_path / "r2.log"):
            raise RuntimeError("engine died")
        assert not pool.pool_path.exists() and not Path(pool.socket).exists()
    finally:
        pool.remove()
    assert not pool.dir.exists()


def test_a_node_owner_that_cannot_start_fails_in_one_line_naming_its_log(tmp_path: Path) -> None:
    from kvtier.core.errors import ServerStartError

    pool = NodePool.make(1 << 19)  # 512 TiB: more than any /dev/shm, refused by the owner at start
    try:
        with pytest.raises(ServerStartError, match=r"kvtier node serve exited with code 2 at start-up; see .*node.log"):
            LocalNode(pool, tmp_path / "node.log").start()
        # a run of the arm raises it before any vLLM server starts (bench compare records that run as
        # failed, naming the log, and goes on with the others); nothing is left in the pool's directory
        arm = make_arm("kvtier-node", tmp_path, {"cpu_gib": 0.5}, node_config=pool.extra_config())
        log = tmp_path / "out" / "kvtier-node-run1.node.log"
        with pytest.raises(ServerStartError, match="does not fit|cannot create the node pool"), \
                run_scope(arm, 1, "tag", node_pool=pool, node_log=log):
            pytest.fail("the run went on without its owner")
        assert log.is_file() and list(pool.dir.iterdir()) == []
    finally:
        pool.remove()


def _ram_gib() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30))


@pytest.mark.parametrize(("args", "config", "message"), [
    (["--arms", "native,kvtier-s3"], "tiers: [cpu, disk]\n",
     ("the kvtier-s3 arm adds the s3 tier, but --kvtier-config sets tiers to ['cpu', 'disk'], which leaves it out; "
     "add 's3' to tiers or drop the tiers key")),
    (["--arms", "kvtier-redis", "--redis", "auto"], "tiers: [cpu]\n",
     "the kvtier-redis arm adds the redis tier, but --kvtier-config sets tiers to ['cpu']"),
    (["--arms", "native", "--replicas", "2"], f"cpu_gib: {_ram_gib()}\n",
     f"--replicas 2 x (--memory-fraction 0.25 of RAM + a {_ram_gib()} GiB cpu tier) would hold"),
    (["--arms", "kvtier-node"], "tiers: [cpu, disk]\n",
     "the kvtier-node arm adds the node tier, but --kvtier-config sets tiers to ['cpu', 'disk']"),
    (["--arms", "native", "--node-gib", "1"], "cpu_gib: 0.5\n",
     "--node-gib sizes the kvtier-node arm's pool only; add kvtier-node to --arms"),
    (["--arms", "kvtier-node", "--node-gib", "500000"], "cpu_gib: 0.5\n",
     "the kvtier-node arm's pool of 500000 GiB does not fit in /dev/shm"),
    # a planned restart needs another replica to take the requests, and a point inside the workload
    (["--arms", "native", "--restart-replica-at", "0.5"], "cpu_gib: 0.5\n",
     "--restart-replica-at needs --replicas 2 or more (it is 1): while one replica restarts, the others take"),
    (["--arms", "native", "--replicas", "2", "--restart-replica-at", "1.5"], "cpu_gib: 0.5\n",
     "--restart-replica-at 1.5 must be a share of the workload's requests strictly between 0 and 1"),
    (["--arms", "native", "--replicas", "2", "--restart-replica-at", "0"], "cpu_gib: 0.5\n",
     "--restart-replica-at 0 must be a share of the workload's requests strictly between 0 and 1"),
    # a quarter of RAM fits in /dev/shm (half of RAM by default) but not beside two servers' 40 % each
    (["--arms", "kvtier-node", "--replicas", "2", "--memory-fraction", "0.4"],
     f"cpu_gib: 0.5\nnode_gib: {max(1, _ram_gib() // 4)}\n",
     f"+ a 0.5 GiB cpu tier) + a {max(1, _ram_gib() // 4)} GiB node pool would hold"),
])
def test_bad_replica_arm_combinations_are_one_sentence_and_exit_2(tmp_path: Path, args: list[str], config: str,
                                                                   message: str) -> None:
    from typer.testing import CliRunner

    from kvtier.cli.main import app
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="none")
    (tmp_path / "kvtier.yaml").write_text(config)
    result = CliRunner().invoke(app, ["bench", "compare", "--model", str(model), "--out", str(tmp_path / "out"),
                                      "--kvtier-config", str(tmp_path / "kvtier.yaml"), *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out" / "s3").exists() and not (tmp_path / "out" / "redis").exists()  # nothing started


def test_each_replica_computes_on_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.bench.replicas import replica_cores

    # vLLM would bind every server to the same cores; the replicas split them, leaving one per replica free
    assert replica_cores(2, 1, range(2)) == ["0", "1"]
    assert replica_cores(2, 1, range(64)) == [",".join(map(str, range(31))), ",".join(map(str, range(31, 62)))]
    assert replica_cores(3, 0, [4, 5, 6, 7, 8, 9]) == ["4,5", "6,7", "8,9"]
    assert replica_cores(3, 1, range(2)) == ["0", "1", "0"]  # more replicas than cores: wrap around
    assert replica_cores(1, 1, range(8)) is None
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    binds = replica_cores(2, 1)
    assert binds is not None and len(set(binds)) == min(2, len(os.sched_getaffinity(0)))
    specs = replica_specs(SPEC, 2)
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs] == binds
    assert all(s.environment()["VLLM_CPU_OMP_THREADS_BIND"] == b for s, b in zip(specs, binds, strict=True))
    # a binding chosen by the operator (spec, environment) or tensor parallel ranks are left alone
    own = dataclasses.replace(SPEC, env={"VLLM_CPU_OMP_THREADS_BIND": "0-3"})
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in replica_specs(own, 2)] == ["0-3", "0-3"]
    tp = dataclasses.replace(SPEC, extra_args=("--tensor-parallel-size", "2"))
    assert all("VLLM_CPU_OMP_THREADS_BIND" not in s.env for s in replica_specs(tp, 2))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    assert all("VLLM_CPU_OMP_THREADS_BIND" not in s.env for s in replica_specs(SPEC, 2))
    assert replica_specs(SPEC, 1) == [SPEC]
