"""``bench compare --replicas``: round robin over several real HTTP servers, figures per replica and
summed per arm (against tests/bench/sse_server.py, which counts prompt tokens and prefix hits per
process), and the ``--redis`` plumbing against real redis-servers."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvtier.bench.arms import make_arm
from kvtier.bench.client import ClientOptions, run_workload
from kvtier.bench.compare import ArmOutcome, CompareResult
from kvtier.bench.meters import scrape
from kvtier.bench.prefix_repetition import prefix_repetition_workload
from kvtier.bench.replicas import replica_deltas, replica_figures, replica_log_paths, sum_deltas
from kvtier.bench.report import compare_json, markdown, replica_rows
from kvtier.bench.shared_redis import LocalRedis, check_redis_url, delete_prefix, with_run_prefix
from kvtier.bench.workload import TokenSpace
from kvtier.launch.serve import ServerSpec, free_port
from tests.bench.sse_server import launch
from tests.processes import pids_mentioning

TOKENS = TokenSpace(seed=0, low=10, high=500)


@pytest.fixture()
def sse_servers() -> Iterator[list[str]]:
    """Three fresh SSE servers (each remembers only the prompts it was sent)."""
    procs, urls = zip(*(launch("--gap", "0.005") for _ in range(3)), strict=True)
    yield list(urls)
    for proc in procs:
        proc.kill()
        proc.wait()


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _expected_hits(prompts: list[tuple[int, ...]]) -> int:
    """The SSE server's hit rule over the prompts one server received, in order."""
    return sum(min(max((_shared(p, q) for q in prompts[:i]), default=0), len(p) - 1) for i, p in enumerate(prompts))


def test_round_robin_sends_request_k_to_replica_k_mod_n_and_sums_the_meters(sse_servers: list[str]) -> None:
    # A B C A B C over two replicas: every returning prefix lands on the other replica
    w = prefix_repetition_workload(TOKENS, num_requests=6, prefix_len=40, suffix_len=5, num_prefixes=3, output_len=3)
    urls = tuple(sse_servers[:2])
    before = [scrape(u) for u in urls]
    run = run_workload(w, ClientOptions(urls[0], "m", max_concurrency=1, progress=False, replica_urls=urls))
    per_replica = replica_deltas(before, [scrape(u) for u in urls])

    assert run.aborted is None and all(r.ok for r in run.results)
    assert [r.replica for r in run.results] == [0, 1, 0, 1, 0, 1]
    for i, meters in enumerate(per_replica):
        mine = [r.prompt_token_ids for k, r in enumerate(w.requests) if k % 2 == i]
        assert meters.prefix_queries == sum(len(p) for p in mine) == 3 * 45
        assert meters.prefix_hits == _expected_hits(mine)
        assert meters.prefix_hits < 40  # no prefix came back to the replica that saw it
    total = sum_deltas(per_replica)
    assert total.prefix_queries == 6 * 45
    assert total.prefix_hits == per_replica[0].prefix_hits + per_replica[1].prefix_hits

    figures = replica_figures(run, per_replica)
    assert [f["num_requests"] for f in figures] == [3.0, 3.0]
    for i, f in enumerate(figures):
        ttfts = sorted(r.ttft_s for r in run.results if r.replica == i)
        assert f["ttft_p50_s"] == pytest.approx(ttfts[1])
        assert f["prefix_hit_rate"] == per_replica[i].prefix_hit_rate

    # the same workload on one server: each returning prefix is a hit there
    one = sse_servers[2]
    b1 = scrape(one)
    single = run_workload(w, ClientOptions(one, "m", max_concurrency=1, progress=False))
    alone = replica_deltas([b1], [scrape(one)])[0]
    assert {r.replica for r in single.results} == {0}
    assert alone.prefix_hits == _expected_hits([r.prompt_token_ids for r in w.requests]) >= 3 * 40
    assert alone.prefix_hits > total.prefix_hits

    # reports: one row per replica, per-replica JSON, the round-robin note
    arm = make_arm("kvtier", Path("/nonexistent"))
    outcome = ArmOutcome(arm, Path("kvtier-r0.log"), 1.0, run, total, None, replica_meters=tuple(per_replica),
                         replica_logs=(Path("kvtier-r0.log"), Path("kvtier-r1.log")))
    result = CompareResult(workload=w, engine=ServerSpec(model="m", cache_tokens=512), outcomes=(outcome,),
                           replicas=2)
    rows = replica_rows(result)
    assert [r.cells[:3] for r in rows] == [("kvtier", "0", "3"), ("kvtier", "1", "3")]
    data = compare_json(result)
    assert data["replicas"] == 2
    assert [r["prefix_hit_rate"] for r in data["per_replica"]["kvtier"]] == [m.prefix_hit_rate for m in per_replica]
    assert data["arms"]["kvtier"]["prefix_hit_rate"] == total.prefix_hit_rate
    page = markdown(result, None, "kvtier bench compare --replicas 2")
    assert "replica k mod 2" in page and "kvtier-r1.log" in page


def test_replica_logs_and_run_prefixes() -> None:
    assert replica_log_paths(Path("out/kvtier.log"), 1) == [Path("out/kvtier.log")]
    assert replica_log_paths(Path("out/kvtier-run1.log"), 2) == [Path("out/kvtier-run1-r0.log"),
                                                                  Path("out/kvtier-run1-r1.log")]
    plain = make_arm("kvtier", Path("/tmp"), {"cpu_gib": 0.5})
    assert with_run_prefix(plain, "t", 0) == (plain, None, None)
    with pytest.raises(ValueError, match="needs --redis"):
        make_arm("kvtier-redis", Path("/tmp"), {"cpu_gib": 0.5})
    shared = make_arm("kvtier-redis", Path("/tmp"), {"cpu_gib": 0.5}, "redis://u:pw@127.0.0.1:7/0")
    assert "pw" not in shared.description
    # secrets from --kvtier-config never reach the label (printed and written into the reports), and the
    # config's own redis_url, which --redis replaces, is not named beside the one in use
    secret = {"cpu_gib": 0.5, "redis_url": "redis://u:cfgpw@10.0.0.9:6379/0", "shared_secret": "s3cr3t-0123456789ab"}
    for arm in (make_arm("kvtier", Path("/tmp"), secret),
                make_arm("kvtier-redis", Path("/tmp"), secret, "redis://127.0.0.1:7/0")):
        assert "cfgpw" not in arm.description and "s3cr3t" not in arm.description
    assert "10.0.0.9" not in make_arm("kvtier-redis", Path("/tmp"), secret, "redis://127.0.0.1:7/0").description
    arm0, prefix0, url = with_run_prefix(shared, "abc", 0)
    _, prefix1, _ = with_run_prefix(shared, "abc", 1)
    extra = arm0.kv_transfer_config["kv_connector_extra_config"]  # type: ignore[index]
    assert url == "redis://u:pw@127.0.0.1:7/0" and extra["cpu_gib"] == 0.5
    assert extra["redis_key_prefix"] == prefix0 == "kvtier:bench-abc-kvtier-redis-run0:" != prefix1


def test_local_redis_starts_answers_deletes_one_prefix_and_stops(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    with pytest.raises(ValueError, match="no Redis answered PING at redis://127.0.0.1"):
        check_redis_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0)
    with pytest.raises(ValueError, match="redis:// or rediss://"):
        check_redis_url("http://127.0.0.1:6379")
    server = LocalRedis.start(tmp_path)
    with server:
        check_redis_url(server.url)
        client = redis.Redis.from_url(server.url)
        client.mset({"kvtier:bench-x-run0:a": b"1", "kvtier:bench-x-run0:b": b"2", "kvtier:other": b"3"})
        assert delete_prefix(server.url, "kvtier:bench-x-run0:") == 2
        assert client.keys("*") == [b"kvtier:other"]
    with pytest.raises(ValueError, match="no Redis answered"):
        check_redis_url(server.url, timeout_s=1.0)


@pytest.mark.parametrize(("args", "message"), [
    (["--replicas", "0"], "--replicas 0 must be at least 1"),
    (["--replicas", "100000"], "--replicas 100000 is more than the"),
    (["--replicas", "2", "--memory-fraction", "0.5"], "--replicas 2 x --memory-fraction 0.5 would reserve 100%"),
    (["--arms", "kvtier,kvtier-redis"], "the kvtier-redis arm needs --redis"),
    (["--arms", "kvtier", "--redis", "auto"], "--redis is used by the kvtier-redis arm only"),
    (["--arms", "kvtier-redis", "--redis", "http://127.0.0.1:6379"], "must be 'auto' or a redis:// or rediss:// URL"),
    (["--arms", "kvtier-redis", "--redis", "redis://:secret@127.0.0.1:{port}/0"],
     "no Redis answered PING at redis://***@127.0.0.1:{port}/0"),
])
def test_bad_replica_or_redis_input_is_one_sentence_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from kvtier.cli.main import app
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="none")
    port = str(free_port())
    args = [a.replace("{port}", port) for a in args]
    result = CliRunner().invoke(app, ["bench", "compare", "--model", str(model), "--out", str(tmp_path / "out"),
                                      *args])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message.replace("{port}", port) in lines[0]
    assert "secret" not in result.output and "Traceback" not in result.output


@pytest.mark.shares_cpu
@pytest.mark.engine  # launches a real vLLM api_server (stopped while it starts)
def test_sigterm_stops_the_vllm_servers_and_the_private_redis(tmp_path: Path) -> None:
    """A CI timeout or ``kill`` sends SIGTERM: bench compare stops what it started (its servers run in
    sessions of their own, so nothing else would), and exits 143."""
    import re
    import signal

    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="none")
    proc = subprocess.Popen([sys.executable, "-u", "-m", "kvtier.cli.main", "bench", "compare", "--model", str(model),
                             "--arms", "kvtier-redis", "--redis", "auto", "--no-progress", "--out", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("arm kvtier-redis"):
                break
        url = re.search(r"redis-server on (redis://\S+)", "".join(lines))
        assert url, lines
        server = f"api_server\0--model\0{model}\0"  # the vLLM server's argv, not kvtier's own
        deadline = time.monotonic() + 60
        while not pids_mentioning(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids_mentioning(server), "the vLLM server was never launched"
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM
        assert "kvtier: stopped by SIGTERM; stopping what it started, then exiting with 143" in rest
        assert "Traceback" not in rest
    finally:
        if proc.poll() is None:
            proc.kill()
    assert pids_mentioning(server) == []
    with pytest.raises(redis.RedisError):
        redis.Redis.from_url(url.group(1), socket_connect_timeout=1.0).ping()
