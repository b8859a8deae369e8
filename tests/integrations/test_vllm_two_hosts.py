"""Two hosts, one cache, at engine level: Redis and an S3 server (``rclone serve s3``) in one
network namespace, real ``vllm serve`` processes (``python -m vllm.entrypoints.openai.api_server``)
with KVTierConnector in two others, joined by veth pairs (tests/netns.py; only 127.0.0.1 inside
each namespace and the namespaces' own 10.211.x addresses are contacted).

Host A is a ``kv_producer`` (it computes and saves to Redis and to S3, never loads), host B runs
two ``kv_consumer`` servers (they load, never save), one reading Redis, one reading S3:
disaggregated prefill through each shared tier.
- A serves prompt P and prompt Q; B serves P: its KV comes from Redis (A's prefill), tokens and
  logprobs exactly those of A's own computation (a recompute: A never loads); B's S3 consumer
  serves P from the bucket, again exactly A's;
- B serves Q' (Q's first 150 words, then other words): the shared prefix is a redis hit on B;
  A, its own prefix cache reset, recomputes Q' as the reference, again exactly equal.
Both engines run float32 with one reserved core (equal compute threads).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.core.tier_harness import s3_credentials_file
from tests.engine_layout import WORKER_IN_ENGINE_CORE
from tests.netns import REDIS_ADDRESS, cannot_create, in_netns, netns_hosts
from tests.redis_servers import redis_binaries, wait_until
from tests.s3_servers import ACCESS_KEY, SECRET_KEY, rclone_binary

from .vllm_helpers import live_spec

# exact outputs and counts only, every deadline a minute: it may run beside another engine test
pytestmark = [pytest.mark.engine, pytest.mark.shares_cpu]

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 128
PORT = 8000  # each host has its own loopback: the same port on both
S3_PORT = 8001  # host B's second server (its S3 consumer)


def client(ns: str, ops: list[dict[str, Any]], workdir: Path, timeout_s: float = 900, port: int = PORT) -> list[Any]:
    """Run tests/integrations/openai_client.py inside namespace ``ns`` against its 127.0.0.1:``port``."""
    ops_file = workdir / f"ops-{uuid.uuid4().hex[:6]}.json"
    ops_file.write_text(json.dumps(ops))
    proc = subprocess.run(in_netns(ns, [sys.executable, "-m", "tests.integrations.openai_client",
                                        f"http://127.0.0.1:{port}", str(ops_file)]),
                          capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_producer_on_host_a_hands_kv_to_consumer_on_host_b(tiny_model: Path, tmp_path: Path) -> None:
    from kvtier.launch.serve import Server
    from kvtier.launch.testmodel import random_prompt

    reason = cannot_create()
    if reason:
        pytest.skip(reason)
    server_bin, cli_bin = redis_binaries()
    p, q = random_prompt(810, 200), random_prompt(811, 200)
    q_prime = " ".join(q.split()[:150] + random_prompt(812, 50).split())
    prefix = f"twohosts-{uuid.uuid4().hex[:8]}:"
    with netns_hosts() as ns:
        redis = subprocess.Popen(in_netns(ns["r"], [server_bin, "--bind", *REDIS_ADDRESS.values(), "--port", "6379",
                                                    "--save", "", "--appendonly", "no", "--protected-mode", "no",
                                                    "--dir", str(tmp_path)]),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # the S3 server, listening on the redis namespace's addresses only (a namespace of its own)
        data, bucket = tmp_path / "s3data", "kvtier-two-hosts"
        (data / bucket).mkdir(parents=True)  # rclone's local backend: a bucket is a directory
        (tmp_path / "rclone.conf").touch()
        rclone = subprocess.Popen(in_netns(ns["r"], [rclone_binary(), "serve", "s3", f":local:{data}", "--addr",
                                                     "0.0.0.0:9000", "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}",
                                                     "--config", str(tmp_path / "rclone.conf"), "--log-level", "ERROR"]),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        credentials = s3_credentials_file(tmp_path, SimpleNamespace(access_key=ACCESS_KEY, secret_key=SECRET_KEY))
        servers: list[Server] = []
        try:
            for name, host, role, tiers in (("a", "a", "kv_producer", ("redis", "s3")), ("b", "b", "kv_consumer", ("redis",)),
                                            ("b-s3", "b", "kv_consumer", ("s3",))):
                kvtier: dict[str, Any] = {"chunk_tokens": CHUNK, "cpu_gib": 0.01, "tiers": ["cpu", *tiers],
                                          "shared_deadline_s": 60.0}
                if "redis" in tiers:
                    kvtier.update(redis_key_prefix=prefix, redis_url=f"redis://{REDIS_ADDRESS[host]}:6379/0",
                                  redis_timeout_s=60.0, redis_connect_timeout_s=60.0)
                if "s3" in tiers:
                    kvtier.update(s3_bucket=bucket, s3_endpoint_url=f"http://{REDIS_ADDRESS[host]}:9000",
                                  s3_allow_http=True, s3_credentials_file=str(credentials),
                                  shared_transfer_deadline_s=60.0)
                port = S3_PORT if name == "b-s3" else PORT
                # each server's worker in its engine core: one start-up import less per server, the same
                # layout for the three servers compared bit for bit (tests/engine_layout.py)
                server = Server(live_spec(tiny_model, kvtier, role, env=WORKER_IN_ENGINE_CORE), tmp_path / f"{name}.log",
                                port=port)
                server.command = in_netns(ns[host], server.command)
                servers.append(server.launch())
            for (name, host, port), server in zip((("a", "a", PORT), ("b", "b", PORT), ("b-s3", "b", S3_PORT)), servers,
                                                  strict=True):
                assert client(ns[host], [{"op": "ready", "timeout_s": 600}], tmp_path, port=port) == [True], \
                    f"server {name} did not start: {server.exit_reason()}\n{server.log_tail(40)}"

            made_p, made_q = client(ns["a"], [{"op": "complete", "prompt": p}, {"op": "complete", "prompt": q}],
                                    tmp_path)
            saved = sum(r["prompt_tokens"] // CHUNK for r in (made_p, made_q))

            def in_redis() -> int:
                keys = subprocess.run(in_netns(ns["r"], [cli_bin, "-h", REDIS_ADDRESS["a"], "--scan", "--pattern",
                                                         f"{prefix}*"]),
                                      capture_output=True, text=True, timeout=30, check=False)
                return len(keys.stdout.split())
            assert wait_until(lambda: in_redis() >= saved, timeout_s=60), f"{in_redis()} of {saved} chunks in Redis"

            def in_s3() -> int:
                return sum(1 for f in (data / bucket).rglob("*") if f.is_file())
            assert wait_until(lambda: in_s3() >= saved, timeout_s=60), f"{in_s3()} of {saved} chunks in S3"

            before, got_q, after_q, got_p, after_p = client(
                ns["b"], [{"op": "metrics"}, {"op": "complete", "prompt": q_prime}, {"op": "metrics"},
                          {"op": "complete", "prompt": p}, {"op": "metrics"}], tmp_path)
            s3_before, s3_got_p, s3_after = client(
                ns["b"], [{"op": "metrics"}, {"op": "complete", "prompt": p}, {"op": "metrics"}], tmp_path, port=S3_PORT)
            # the exact references: A's own prefix cache holding the blocks A computed for Q and P
            # (128-token blocks, as kvtier's chunks: they end at the same token), the same tail computed
            # (a cold prefill is no exact reference: on an AMD EPYC host it differed in the last bits)
            a_before, ref_q, own_p, a_after = client(
                ns["a"], [{"op": "metrics"}, {"op": "complete", "prompt": q_prime}, {"op": "complete", "prompt": p},
                          {"op": "metrics"}], tmp_path)
            for server in servers:
                assert server.exit_reason() is None
        finally:
            with ThreadPoolExecutor(3) as pool:  # all at once: each may take its grace period
                list(pool.map(lambda server: server.stop(grace_s=20), servers))
            for proc in (redis, rclone):
                proc.kill()
                proc.wait(timeout=10)

    # Disaggregated prefill: P's KV on B is A's, and B's answer is A's over its own prefix cache, exactly.
    assert got_p["tokens"] == made_p["tokens"]
    assert (got_p["tokens"], got_p["logprobs"]) == (own_p["tokens"], own_p["logprobs"])
    # Prefix sharing across hosts: Q' on B continues Q's prefix from Redis, equal to A's own prefix cache.
    assert (got_q["tokens"], got_q["logprobs"]) == (ref_q["tokens"], ref_q["logprobs"])
    loaded_q = after_q.get("kvtier_loaded_tokens_total{redis}", 0) - before.get("kvtier_loaded_tokens_total{redis}", 0)
    loaded_p = after_p.get("kvtier_loaded_tokens_total{redis}", 0) - after_q.get("kvtier_loaded_tokens_total{redis}", 0)
    assert loaded_q == 2 * CHUNK  # Q's first 150 words (~300 tokens) hold two whole chunks
    assert loaded_p == (made_p["prompt_tokens"] - 1) // CHUNK * CHUNK  # every whole chunk but the last token
    assert after_p["vllm:external_prefix_cache_hits_total"] == loaded_q + loaded_p
    assert after_p.get("kvtier_saved_tokens_total", 0) == 0  # a consumer never saves
    # A's references came from its own prefix cache, the same prefixes B loaded
    hits = "vllm:prefix_cache_hits_total"
    assert a_after.get(hits, 0) - a_before.get(hits, 0) == loaded_q + loaded_p
    # Disaggregated prefill through S3: P's KV on B's S3 consumer is A's, exactly as through Redis.
    assert (s3_got_p["tokens"], s3_got_p["logprobs"]) == (own_p["tokens"], own_p["logprobs"])
    loaded_s3 = s3_after.get("kvtier_loaded_tokens_total{s3}", 0) - s3_before.get("kvtier_loaded_tokens_total{s3}", 0)
    assert loaded_s3 == loaded_p
    assert s3_after["vllm:external_prefix_cache_hits_total"] == loaded_s3
    assert s3_after.get("kvtier_saved_tokens_total", 0) == 0
