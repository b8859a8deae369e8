"""An engine configured with cpu + s3 tiers (no disk): a real vLLM process, a real ``rclone serve s3``.

Engine A serves a prompt twice: the first time computes it (and saves every chunk to S3), the
second is served by vLLM's own prefix cache: the reference.  Engine B, another process (a
restart: its own empty cpu tier, nothing but the bucket in common; it starts beside A, so that
their start-ups overlap, and takes its first step once A has stopped), serves the same prompt first:
loaded from S3, with the tokens and logprobs of A's prefix-cache hit exactly (equal compute
threads, same KV bytes), counted as a hit by kvtier and by vLLM.

Then, on engine B, the S3 server is stalled (``SIGSTOP``: connections are accepted, nothing
answers) while a second prompt that A saved is asked for: its lookup and any read give up at the
deadline (counted), and the request finishes by recompute (A's cold tokens and logprobs
exactly).  Once the server answers again (``SIGCONT``), a third prompt
A saved is a hit from S3 again, exact against A's prefix-cache hit of it.  The server is a
private one (the stall would hang every other test's calls).

The bucket is encrypted at rest (issue 36: ``codecs: {s3: [aes-256-gcm]}``, the master key in a
file): every object A wrote is sealed, and B's loads decrypt them with no failure.  (The same
restart over an encrypted disk tier, and a restart with another master key, is
:func:`test_a_restart_served_from_an_encrypted_tier_is_exact`.)
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import obstore
import pytest

from tests.core.tier_harness import s3_credentials_file
from tests.engine_layout import WORKER_IN_RUNNER
from tests.integrations.vllm_helpers import PROMPT_WORDS, result_of, run_engine
from tests.s3_servers import S3Server

pytestmark = pytest.mark.engine

LOADABLE = 6 * 64
# vLLM reserves one more core when a connector is set: pin it, so that every engine compared runs
# its forward passes on the same number of threads.
EQUAL_THREADS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def test_a_restarted_engine_serves_from_s3_exactly_recomputes_while_s3_stalls_and_hits_again_after(
        tiny_model: Path, tmp_path: Path) -> None:
    from kvtier.launch.testmodel import random_prompt

    s3_server = S3Server(tmp_path / "s3").start()
    try:
        _run(tiny_model, tmp_path, s3_server, [random_prompt(740 + i, PROMPT_WORDS) for i in range(3)])
    finally:
        s3_server.resume()  # never leave a stopped process behind
        s3_server.stop()


def _run(tiny_model: Path, tmp_path: Path, s3_server: S3Server, prompts: list[str]) -> None:
    bucket = s3_server.make_bucket()
    key_file = tmp_path / "master-key"
    key_file.write_text("engine-test-master-key-0123456789abcdef\n", encoding="utf-8")
    kvtier = {"chunk_tokens": 64, "cpu_gib": 0.01, "tiers": ["cpu", "s3"], "s3_bucket": bucket,
              "s3_endpoint_url": s3_server.url, "s3_allow_http": True,
              "s3_credentials_file": str(s3_credentials_file(tmp_path, s3_server)),
              "shared_deadline_s": 5.0, "shared_transfer_deadline_s": 10.0, "s3_breaker_probe_s": 1.0,
              "codecs": {"s3": ["aes-256-gcm"]}, "encryption": {"master_key_file": str(key_file)}}
    p, q, r = ({"op": "generate", "prompts": [prompt]} for prompt in prompts)
    # 64-token engine blocks, as the chunks: vLLM's own prefix cache (the exact reference) then ends
    # where kvtier's hit does (with 32-token blocks it could hold one block more, and compute another tail)
    engine = {"block_size": 64}
    # A computes, saves and is the reference, its worker in its process; B, which loads, keeps its
    # connector halves in separate processes (tests/engine_layout.py)
    made_proc = run_engine({"model": str(tiny_model), "steps": [p, p, q, r, r], "kvtier": kvtier,
                            "engine": {**engine, **WORKER_IN_RUNNER}}, tmp_path, "a", env=EQUAL_THREADS)
    # B starts beside A (its start-up overlaps A's run) and takes its first step once A is done
    a_done, ready, stalled, recomputed, resumed = (tmp_path / n for n in ("a-done", "b-ready", "stalled",
                                                                         "recomputed", "resumed"))
    steps = [{"op": "wait", "path": str(a_done), "timeout_s": 600}, p, {"op": "metrics"},
             {"op": "touch", "path": str(ready)}, {"op": "wait", "path": str(stalled), "timeout_s": 300}, q,
             {"op": "metrics"}, {"op": "touch", "path": str(recomputed)},
             {"op": "wait", "path": str(resumed), "timeout_s": 300}, r]
    proc = run_engine({"model": str(tiny_model), "steps": steps, "kvtier": kvtier, "engine": engine}, tmp_path, "b",
                      timeout_s=900, env=EQUAL_THREADS)
    try:
        made = result_of(made_proc, tmp_path, "a")
        _check_producer(made, s3_server, bucket)
    except BaseException:  # no engine left waiting at its gate
        proc.kill()
        raise
    a_done.write_text("done")
    try:
        _wait_for(ready, proc, 420)
        s3_server.pause()
        stalled.write_text("done")
        _wait_for(recomputed, proc, 300)  # the stalled prompt finished (by recompute) while S3 hung
    finally:
        s3_server.resume()
        time.sleep(1.5)  # past s3_breaker_probe_s: the next call probes the server
        stalled.write_text("done")
        resumed.write_text("done")
    served = result_of(proc, tmp_path, "b")

    (_p_cold,), (p_cached,), (q_cold,), (_r_cold,), (r_cached,) = made["results"]
    (p_loaded,), (q_recomputed,), (r_loaded,) = served["results"]
    # exact: same KV bytes (or the same cold compute), same compute threads
    assert (p_loaded["tokens"], p_loaded["logprobs"]) == (p_cached["tokens"], p_cached["logprobs"])
    assert (q_recomputed["tokens"], q_recomputed["logprobs"]) == (q_cold["tokens"], q_cold["logprobs"])
    assert (r_loaded["tokens"], r_loaded["logprobs"]) == (r_cached["tokens"], r_cached["logprobs"])
    hit, during = served["snapshots"]
    assert hit["kvtier_loaded_tokens_total{s3}"] == LOADABLE
    assert hit["vllm:external_prefix_cache_hits_total"] == LOADABLE
    assert hit["kvtier_shared_lookup_hit_chunks_total"] == LOADABLE // 64
    # the stall: nothing loaded, the request recomputed, the calls that hung counted as failed or skipped
    assert during["kvtier_loaded_tokens_total{s3}"] == LOADABLE
    assert during["vllm:external_prefix_cache_hits_total"] == LOADABLE
    assert hit["kvtier_shared_lookups_timed_out_total"] == 0
    assert during["kvtier_shared_lookups_timed_out_total"] >= 1  # the lookup gave up at shared_deadline_s
    assert q_recomputed["cached"] == 0
    # back: the third prompt is a hit from S3 again (its whole chunks: A's two runs of it may have
    # completed one more chunk with generated tokens)
    end = served["metrics"]
    assert r_loaded["cached"] >= LOADABLE
    assert end["kvtier_loaded_tokens_total{s3}"] == LOADABLE + r_loaded["cached"]
    assert end["vllm:external_prefix_cache_hits_total"] == LOADABLE + r_loaded["cached"]
    assert end["kvtier_load_failed_blocks_total"] == 0
    assert end.get("kvtier_decrypt_failures_total{s3}", 0) == 0  # every value B loaded decrypted


def _check_producer(made: dict[str, Any], s3_server: S3Server, bucket: str) -> None:
    """Engine A saved every chunk once in S3 (its repeats were vLLM's own hits), each value sealed."""
    from kvtier.core.envelope import decode_header

    saved = made["metrics"]["kvtier_saved_tokens_total"]
    assert saved >= 3 * LOADABLE  # the prompts' chunks (and any the generated tokens completed)
    assert made["metrics"]["vllm:external_prefix_cache_hits_total"] == 0  # the repeats were vLLM's own hits
    listed = [m for page in obstore.list(s3_server.client(bucket)) for m in page]
    assert len(listed) == saved // 64  # one object per saved chunk (TP 1)
    sealed = made["metrics"]["kvtier_codec_bytes_after_total{s3}"] - made["metrics"]["kvtier_codec_bytes_before_total{s3}"]
    assert sealed > 0 and sealed % 32 == 0  # each value 32 bytes longer: key id, nonce, tag (A's writes)
    stored = [bytes(obstore.get(s3_server.client(bucket), m["path"]).bytes()) for m in listed]
    assert {decode_header(v).codecs for v in stored} == {(16,)}  # every value sealed: aes-256-gcm


def _wait_for(path: Path, proc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert path.exists(), f"engine B did not reach {path.name} (exit code {proc.poll()})"


@pytest.mark.parametrize("tier", ["disk", "s3"])  # s3: the wrong-key engine C reads no object (its lookups read key ids)
@pytest.mark.shares_cpu  # exact outputs and counts only, no deadline: it may run beside another engine test
def test_a_restart_served_from_an_encrypted_tier_is_exact(tiny_model: Path, tmp_path: Path, tier: str) -> None:
    """Issue 36: the same restart over a tier encrypted at rest (``codecs: {tier: [aes-256-gcm]}``,
    the master key in a file): engine A computes a prompt and serves its repeat from vLLM's own
    prefix cache (the reference); engine B, restarted on the same disk directory or bucket, loads
    the prompt from the encrypted values with A's tokens and logprobs exactly.  (That no stored
    value holds a run of plain KV is tests/core/test_encryption_at_rest.py's search.)"""
    from kvtier.core.envelope import decode_header
    from kvtier.launch.testmodel import random_prompt

    key_file = tmp_path / "master-key"
    key_file.write_text("engine-test-master-key-0123456789abcdef\n", encoding="utf-8")
    p = {"op": "generate", "prompts": [random_prompt(760, PROMPT_WORDS)]}
    server = S3Server(tmp_path / "s3").start() if tier == "s3" else None
    started: list[subprocess.Popen[bytes]] = []  # engines B and C, once started
    try:
        if server is not None:
            bucket = server.make_bucket()
            storage = {"tiers": ["cpu", "s3"], "s3_bucket": bucket, "s3_endpoint_url": server.url, "s3_allow_http": True,
                       "s3_credentials_file": str(s3_credentials_file(tmp_path, server)),
                       "shared_deadline_s": 5.0, "shared_transfer_deadline_s": 10.0}
        else:
            storage = {"disk_path": str(tmp_path / "disk"), "disk_gib": 0.05, "write_mode": "write-through"}
        kvtier = {"chunk_tokens": 64, "cpu_gib": 0.01, **storage, "codecs": {tier: ["aes-256-gcm"]},
                  "encryption": {"master_key_file": str(key_file)}}
        engine = {"block_size": 64, **WORKER_IN_RUNNER}  # one start-up import less per engine (tests/engine_layout.py)
        # a lower tier's write lands after the request that made it (S3: a write-behind); A steps until its codec
        # counter shows one, so the metrics A reports are taken after that write
        sealed_once = {"op": "until", "metric": f"kvtier_codec_bytes_after_total{{{tier}}}", "at_least": 1}
        made_proc = run_engine({"model": str(tiny_model), "steps": [p, p, sealed_once], "kvtier": kvtier, "engine": engine},
                               tmp_path, "a", env=EQUAL_THREADS)
        # B and C start before they step (their start-ups overlap what runs before them), and each takes its
        # first step only once the engine before it is done: the engines step one after the other, A, B, C.
        # Over S3 both start beside A (nothing reads the bucket at start-up); over disk they start once A
        # is done, C beside B: the disk tier indexes its directory at start-up, and that restart's scan
        # of A's files is what B and C exercise
        a_done, b_done = tmp_path / "a-done", tmp_path / "b-done"

        def start_b_and_c() -> None:
            started.append(run_engine({"model": str(tiny_model), "steps": [_after(a_done), p], "kvtier": kvtier,
                                       "engine": engine}, tmp_path, "b", timeout_s=600, env=EQUAL_THREADS))
            started.append(_start_with_another_master_key(tiny_model, tmp_path, p, kvtier, engine, b_done))

        if tier == "s3":
            start_b_and_c()
        made = result_of(made_proc, tmp_path, "a")
        assert made["metrics"]["kvtier_saved_tokens_total"] >= LOADABLE
        a_done.write_text("done")
        if tier == "disk":
            start_b_and_c()
        served = result_of(started[0], tmp_path, "b")
        (_cold,), (cached,) = made["results"]
        (loaded,) = served["results"][0]
        assert (loaded["tokens"], loaded["logprobs"]) == (cached["tokens"], cached["logprobs"])
        # its whole chunks (A's two runs may have completed one more chunk with generated tokens), all loaded
        assert loaded["cached"] >= LOADABLE
        assert served["metrics"][f"kvtier_loaded_tokens_total{{{tier}}}"] == loaded["cached"]
        assert served["metrics"]["vllm:external_prefix_cache_hits_total"] == loaded["cached"]
        assert served["metrics"].get(f"kvtier_decrypt_failures_total{{{tier}}}", 0) == 0
        sealed = made["metrics"][f"kvtier_codec_bytes_after_total{{{tier}}}"] - \
            made["metrics"][f"kvtier_codec_bytes_before_total{{{tier}}}"]
        assert sealed > 0 and sealed % 32 == 0  # each value 32 bytes longer: key id, nonce, tag (A's writes)
        def stored_values() -> dict[str, bytes]:  # every value in the tier's raw storage, by object or file
            if server is not None:
                client = server.client(bucket)
                return {m["path"]: bytes(obstore.get(client, m["path"]).bytes()) for page in obstore.list(client)
                        for m in page}
            return {str(f): f.read_bytes() for f in (tmp_path / "disk").rglob("*.kvc")}
        stored = stored_values()
        assert stored and {decode_header(v).codecs for v in stored.values()} == {(16,)}  # every value sealed
        _check_another_master_key(started[1], tmp_path, tier, _cold, stored_values, b_done)
    finally:
        for proc in started:  # a failed check: no engine is left waiting at its gate (done ones have exited)
            if proc.poll() is None:
                proc.kill()
        if server is not None:
            server.stop()


def _after(gate: Path) -> dict[str, object]:
    """A first step that waits until the test writes ``gate`` (the engine before this one is done)."""
    return {"op": "wait", "path": str(gate), "timeout_s": 600}


def _start_with_another_master_key(tiny_model: Path, tmp_path: Path, p: dict, kvtier: dict, engine: dict,
                                   gate: Path) -> subprocess.Popen[bytes]:
    """Engine C (see :func:`_check_another_master_key`), its first step once the test writes ``gate``."""
    wrong_key = tmp_path / "wrong-master-key"
    wrong_key.write_text("another-master-key-fedcba9876543210\n", encoding="utf-8")
    return run_engine({"model": str(tiny_model), "steps": [_after(gate), p],
                       "kvtier": {**kvtier, "encryption": {"master_key_file": str(wrong_key)}},
                       "engine": engine}, tmp_path, "c", timeout_s=600, env=EQUAL_THREADS)


def _check_another_master_key(proc: subprocess.Popen[bytes], tmp_path: Path, tier: str, cold: dict, stored_values,
                              gate: Path) -> None:
    """Issue 36's done-when: engine C, restarted on the same values with another master key, offers
    none of them (vLLM counts no external prefix-cache hit, no load is planned or fails), loads 0
    tokens, counts every value exactly once, leaves every value as it was, and recomputes (A's cold
    tokens and logprobs exactly).  The disk tier's start-up scan reads each file's key id and indexes
    none, counting each in ``kvtier_decrypt_failures_total{disk}``; nothing scans the bucket, so the
    scheduler's lookups read each value's header and key id and answer absent, counting each in
    ``kvtier_shared_lookup_sealed_away_chunks_total`` (the workers read none: no decrypt failure).
    C steps once the test writes ``gate``."""
    sealed = stored_values()  # the prompt's chunks A wrote under the right key
    gate.write_text("done")
    refused = result_of(proc, tmp_path, "c")
    (recomputed,) = refused["results"][0]
    end = refused["metrics"]
    assert (recomputed["tokens"], recomputed["logprobs"]) == (cold["tokens"], cold["logprobs"]), end
    assert recomputed["cached"] == 0, recomputed
    assert end.get(f"kvtier_loaded_tokens_total{{{tier}}}", 0) == 0, end
    # nothing offered: vLLM saw no external hit (B, with the key, saw the prompt's chunks), no block failed
    assert end["vllm:external_prefix_cache_hits_total"] == 0, end
    assert end["kvtier_load_failed_blocks_total"] == 0, end
    # every value counted once, not just those a load happened to read (on main: 2 of 7, after 448 offered tokens)
    if tier == "disk":
        assert end["kvtier_decrypt_failures_total{disk}"] == len(sealed), (len(sealed), end)
    else:
        assert end["kvtier_shared_lookup_sealed_away_chunks_total"] == len(sealed), (len(sealed), end)
        assert end["kvtier_shared_lookup_hit_chunks_total"] == 0, end
        assert end.get(f"kvtier_decrypt_failures_total{{{tier}}}", 0) == 0, end
    assert {k: v for k, v in stored_values().items() if k in sealed} == sealed  # left in place, unchanged
