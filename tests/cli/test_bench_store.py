"""``kvtier bench-store`` runs the real tiers and writes the documented JSON (no timing asserted)."""

import json
import re

from typer.testing import CliRunner

from kvtier.cli.main import app


def test_bench_store_json_shape(tmp_path):
    out = tmp_path / "bs.json"
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "0.25,1", "--total-mib", "4", "--repeats", "2",
                                      "--threads", "1,2", "--disk-io", "buffered,direct",
                                      "--dir", str(tmp_path), "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = report["results"]
    refused = [n for n in report["notes"] if "refuses O_DIRECT" in n]
    direct = not refused  # a filesystem refusing O_DIRECT skips those rows and says so
    split_notes = [n for n in report["notes"] if "of reads split" in n]  # what the read chooser did
    assert len(split_notes) == 4 and {n.split(":")[0] for n in split_notes} == {
        f"buffered get at {c} MiB, {t} thread(s)" for c in ("0.25", "1") for t in (1, 2)}
    want = {("cpu", "memory", 1, o, c) for o in ("put", "get") for c in (0.25, 1.0)}
    want |= {("disk", io, n, o, c) for io in (("buffered", "direct") if direct else ("buffered",))
             for n in (1, 2) for o in ("put", "get") for c in (0.25, 1.0)}
    assert {(r["tier"], r["io"], r["threads"], r["op"], r["chunk_mib"]) for r in rows} == want
    for r in rows:
        assert r["gib_per_s"] > 0 and r["reference_gib_per_s"] > 0
        assert abs(r["ratio"] - r["gib_per_s"] / r["reference_gib_per_s"]) < 1e-9
        assert 0 < r["ratio_min"] <= r["ratio_max"]
    assert len(report["load_average"]) == 3 and "load average" in result.output


import pytest


@pytest.mark.parametrize("args,needle", [
    (["--sizes", "four"], "--sizes"),
    (["--sizes", "0.00003"], "--sizes"),
    (["--sizes", "inf"], "--sizes"),
    (["--sizes", "nan"], "--sizes"),
    (["--sizes", ""], "--sizes"),
    (["--sizes", "4", "--total-mib", "1e12"], "--total-mib"),
    (["--json", "/tmp"], "--json"),
    (["--dir", "/nonexistent-kvtier"], "--dir"),
    (["--threads", "0"], "--threads"),
    (["--threads", "two"], "--threads"),
    (["--disk-io", "mmap"], "--disk-io"),
    (["--buffered-reads", "mmap"], "--buffered-reads"),
    # the same size measured twice, 0.50 parsed as 0.5 (clifix3)
    (["--sizes", "0.5,0.50", "--total-mib", "1", "--repeats", "1"],
     "--sizes lists a chunk size twice (0.5,0.50); give each chunk size once"),
    (["--sizes", "0.25", "--total-mib", "1", "--repeats", "1", "--threads", "1,2,1"],
     "--threads lists a thread count twice (1,2,1); give each thread count once"),
    # measured the cpu and disk tiers only, exit 0, the s3 / redis option ignored (tester4)
    (["--s3-endpoint-url", "https://minio:9000"], "--s3-endpoint-url needs --s3-bucket BUCKET to measure the s3 tier"),
    (["--s3-region", "eu-west-1", "--s3-in-flight", "4"], "--s3-region, --s3-in-flight need --s3-bucket BUCKET"),
    (["--redis-cluster"], "--redis-cluster needs --redis-url"),
])
def test_bench_store_bad_input_is_one_line_error(args, needle):
    result = CliRunner().invoke(app, ["bench-store", *args])
    assert result.exit_code == 2
    assert needle in result.output and "Traceback" not in result.output


def test_bench_store_redis_rows_against_a_real_server(tmp_path, redis_server):
    out = tmp_path / "bs-redis.json"
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "0.25,1", "--total-mib", "2", "--repeats", "2",
                                      "--redis-url", redis_server.url, "--redis-only", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    assert {(r["tier"], r["io"], r["op"], r["chunk_mib"]) for r in rows} == \
        {("redis", "network", o, c) for o in ("put", "get") for c in (0.25, 1.0)}
    for r in rows:
        assert r["gib_per_s"] > 0 and r["reference_gib_per_s"] > 0 and 0 < r["ratio_min"] <= r["ratio_max"]
    assert not redis_server.client().keys(b"kvtier-bench-*")  # the bench cleans up after itself
    assert "raw redis-py pipelined SET/GET" in result.output


def test_bench_store_reaches_a_redis_server_with_a_password_over_tls(tmp_path, redis_factory):
    """--redis-password-file, --redis-password-env and --redis-tls-ca-file come from the redis tier's
    settings model (no edit in cli/): with them the bench measures a TLS server that requires a
    password; without the password it is the one-sentence failure."""
    import redis

    from ..redis_servers import TlsFiles

    tls = TlsFiles.make(tmp_path / "tls")
    server = redis_factory(tls=tls, extra=("--requirepass", "pw-bench-4471"))
    (tmp_path / "pw").write_text("pw-bench-4471\n")
    base = ["bench-store", "--sizes", "0.25", "--total-mib", "1", "--repeats", "1", "--redis-url", server.url,
            "--redis-only", "--redis-tls-ca-file", str(tls.ca)]
    out = tmp_path / "bs.json"
    result = CliRunner().invoke(app, [*base, "--redis-password-file", str(tmp_path / "pw"), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert {(r["tier"], r["op"]) for r in json.loads(out.read_text())["results"]} == {("redis", "put"), ("redis", "get")}
    by_env = CliRunner().invoke(app, [*base, "--redis-password-env", "BENCH_PW"], env={"BENCH_PW": "pw-bench-4471"})
    assert by_env.exit_code == 0, by_env.output
    client = redis.Redis(host="127.0.0.1", port=server.port, password="pw-bench-4471", ssl=True,
                         ssl_ca_certs=str(tls.ca))
    assert not client.keys(b"kvtier-bench-*")  # the bench cleaned up after itself, through the password
    refused = CliRunner().invoke(app, base)
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert refused.output.startswith(f"error: the redis tier at {server.url} refused the credentials (the server "
                                     "requires a password and none is configured); nothing was measured"), refused.output


def test_bench_store_redis_nothing_listening_is_one_sentence():
    """A --redis-url where no server listens ended in redis-py's ConnectionError traceback (tester3)."""
    from ..redis_servers import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # a real refused connection: nothing listens there
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "0.25", "--total-mib", "1", "--repeats", "1",
                                      "--redis-url", url, "--redis-only"])
    assert result.exit_code == 2, result.output
    assert result.output == (f"error: nothing answers for the redis tier at {url} (unreachable: connection refused: "
                             "nothing listens on that port); nothing was measured: start its server, or fix "
                             "--redis-url.\n"), result.output


def test_bench_store_redis_cluster_node_without_the_flag_is_one_sentence(redis_cluster):
    """A Cluster node's --redis-url without --redis-cluster: the probe's PING was answered, so the
    bench timed a tier whose writes of two thirds of the keys were refused with MOVED."""
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "0.25", "--total-mib", "1", "--repeats", "1",
                                      "--redis-url", redis_cluster.url, "--redis-only"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: the redis tier at {redis_cluster.url} answers, but it is a Redis "
                                    "Cluster node and --redis-cluster is not set"), result.output
    assert "set --redis-cluster" in result.output
    assert result.output.rstrip().endswith("nothing was measured."), result.output


def test_bench_store_node_with_no_owner_says_so_not_short_of_room(tmp_path):
    """--node-socket where no owner listens was "the node tier did not store every chunk of a round
    (2 of 1 MiB); give it room for --total-mib" (a server that is down read as a full one)."""
    socket = tmp_path / "nothere.sock"
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "1", "--total-mib", "1", "--node-socket", str(socket),
                                      "--node-only"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: nothing answers for the node tier at {socket} (unreachable: "), \
        result.output
    assert result.output.endswith(f"nothing was measured: start its owner, kvtier node serve --socket {socket}, or "
                                  "fix --node-socket.\n"), result.output


def test_bench_store_node_short_of_room_counts_the_chunks_truly(node_server):
    """A real owner of a 64 MiB pool asked for 96 MiB rounds of 32 MiB chunks: the sentence counts
    what was stored of the round's three chunks (it said "(2 of 1 MiB)" for two 1 MiB chunks)."""
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "32", "--total-mib", "96", "--repeats", "1",
                                      "--node-socket", node_server.socket, "--node-only"])
    assert result.exit_code == 2, result.output
    said = re.fullmatch(r"error: the node tier stored (\d) of the 3 chunks of 32 MiB of a round \(96 MiB; a round "
                        r"holds at least two chunks\); give it room for 96 MiB or lower --total-mib\.\n",
                        result.output)
    assert said is not None and int(said.group(1)) < 3, result.output


def test_bench_store_redis_only_needs_a_url():
    result = CliRunner().invoke(app, ["bench-store", "--redis-only"])
    assert result.exit_code == 2 and "--redis-url" in result.output and "Traceback" not in result.output


def test_bench_store_measures_forced_buffered_read_ways_beside_auto(tmp_path):
    out = tmp_path / "bs.json"
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "0.5", "--total-mib", "2", "--repeats", "1",
                                      "--disk-io", "buffered", "--buffered-reads", "serial,split,auto",
                                      "--dir", str(tmp_path), "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert {(r["io"], r["op"]) for r in report["results"] if r["tier"] == "disk"} == {
        (io, op) for io in ("buffered:serial", "buffered:split", "buffered") for op in ("put", "get")}
    assert len([n for n in report["notes"] if "of reads split" in n]) == 1  # the measured way only


def test_bench_store_s3_rows_against_a_real_server(tmp_path, s3_server):
    import obstore

    from tests.core.tier_harness import s3_credentials_file

    out = tmp_path / "bs-s3.json"
    bucket = s3_server.make_bucket()
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "0.25", "--total-mib", "1", "--repeats", "1",
                                      "--s3-bucket", bucket, "--s3-endpoint-url", s3_server.url, "--s3-allow-http",
                                      "--s3-credentials-file", str(s3_credentials_file(tmp_path, s3_server)),
                                      "--s3-in-flight", "1,4", "--s3-only", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    assert {(r["tier"], r["op"], r["threads"]) for r in rows} == \
        {("s3", o, n) for o in ("put", "get") for n in (1, 4)}
    for r in rows:
        assert r["gib_per_s"] > 0 and r["reference_gib_per_s"] > 0 and 0 < r["ratio_min"] <= r["ratio_max"]
    assert [m for page in obstore.list(s3_server.client(bucket)) for m in page] == []  # cleaned up
    assert "raw obstore put/get" in result.output
    # rclone serve s3 ignores If-None-Match: the tier found that out and HEADs before each PUT
    assert json.loads(out.read_text())["notes"] == [("s3 put: a HEAD then a PUT per chunk (the server ignores "
                                                    "If-None-Match: *)")]


def test_bench_store_s3_through_a_server_answering_412_puts_without_head(tmp_path, s3_server):
    from tests.core.tier_harness import s3_credentials_file
    from tests.s3_servers import ConditionalPutProxy

    front = ConditionalPutProxy(s3_server)
    try:
        out = tmp_path / "bs-s3.json"
        result = CliRunner().invoke(app, ["bench-store", "--sizes", "0.25", "--total-mib", "0.5", "--repeats", "1",
                                          "--s3-bucket", s3_server.make_bucket(), "--s3-endpoint-url", front.url,
                                          "--s3-allow-http", "--s3-in-flight", "2", "--s3-only", "--json", str(out),
                                          "--s3-credentials-file", str(s3_credentials_file(tmp_path, s3_server))])
        assert result.exit_code == 0, result.output
        assert json.loads(out.read_text())["notes"] == [("s3 put: one PUT per chunk, no HEAD (the server honours "
                                                        "If-None-Match: *)")]
        assert "HEAD" not in front.methods()
    finally:
        front.close()


@pytest.mark.parametrize(("args", "needle"), [
    (["--s3-only"], "--s3-bucket"),
    (["--s3-in-flight", "0"], "--s3-in-flight"),
    (["--s3-only", "--redis-only", "--s3-bucket", "b", "--redis-url", "redis://127.0.0.1:1/0"], "exclude each other"),
    (["--s3-bucket", "kvcache", "--s3-endpoint-url", "http://127.0.0.1:9", "--s3-only"], "set --s3-allow-http"),
    (["--s3-bucket", "kvcache", "--s3-endpoint-url", "ftp://127.0.0.1:9", "--s3-only"],
     "--s3-endpoint-url must start with https://"),
])
def test_bench_store_s3_bad_input_is_one_line_error(args, needle):
    result = CliRunner().invoke(app, ["bench-store", *args])
    assert result.exit_code == 2
    assert needle in result.output and "Traceback" not in result.output
    assert "s3_allow_http" not in result.output and "s3_endpoint_url" not in result.output  # the flags typed


def test_bench_store_s3_on_a_dead_endpoint_says_unreachable(s3_factory, monkeypatch):
    server = s3_factory()
    url = server.url
    server.kill9()
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["bench-store", "--s3-only", "--s3-bucket", "kvcache", "--s3-endpoint-url", url,
                                      "--s3-allow-http", "--sizes", "1", "--total-mib", "4", "--s3-in-flight", "1"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: nothing answers for the s3 tier at {url}/kvcache/kvtier/ (unreachable: "), \
        result.output
    assert result.output.endswith(f"(unreachable: connection refused to {url}); nothing was measured: start its "
                                  "server, or fix --s3-endpoint-url or --s3-bucket.\n"), result.output  # the short cause
    assert "Traceback" not in result.output and result.output.count("\n") == 1


def test_bench_store_json_on_a_full_device_is_one_sentence():
    """--json on a device that is full (Linux's /dev/full: every write ENOSPC) ended in an OSError
    traceback after the whole run (tester3)."""
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "0.25", "--total-mib", "1", "--repeats", "1",
                                      "--disk-io", "buffered", "--json", "/dev/full"])
    assert result.exit_code == 2, result.output
    assert ("error: cannot write --json /dev/full (No space left on device); free space or pass a path in a "
            "writable directory (the table above has the results)") in result.output
    assert "Traceback" not in result.output


def test_bench_store_codec_chains_against_identity_on_disk_and_redis(tmp_path, redis_server):
    """``--codecs``: each chain's rows beside identity's on the same tier (disk in --dir, and the
    redis tier given), and a note of the bytes stored per payload byte (compression below 1)."""
    out = tmp_path / "codecs.json"
    chains = "aes-256-gcm;blosc2-zstd-shuffle2,aes-256-gcm"
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "0.25", "--total-mib", "2", "--repeats", "2",
                                      "--disk-io", "buffered", "--dir", str(tmp_path), "--json", str(out),
                                      "--redis-url", redis_server.url, "--codecs", chains])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    coded = {(r["tier"], r["io"], r["op"]) for r in report["results"] if "aes-256-gcm" in r["io"]}
    assert coded == {(t, c, o) for t in ("disk", "redis") for c in ("aes-256-gcm", "blosc2-zstd-shuffle2+aes-256-gcm")
                     for o in ("put", "get")}
    stored = {n.split(" at ")[0]: float(n.split(": ")[1].split()[0]) for n in report["notes"] if "bytes stored" in n}
    assert stored["disk aes-256-gcm"] > 1 and stored["disk blosc2-zstd-shuffle2+aes-256-gcm"] < 0.9
    bad = CliRunner().invoke(app, ["bench-store", "--sizes", "0.25", "--total-mib", "1", "--codecs", "aes-256-gcm,lz5"])
    assert bad.exit_code == 2 and "lz5" in bad.output and "Traceback" not in bad.output
