"""kvtier doctor on a real api_server whose cpu tier is too small for its traffic (issue 35, "Done
when"): it names the evictions as the cause and a size that would hold the working set.

The tiny test model (2 layers, 2 KV heads of 64; its fp32 checkpoint runs in bfloat16 on vLLM's CPU
backend, as the connector's layout line in the serve log says: 256 KiB per 256-token chunk), a cpu tier of
12 chunks under the ``lru`` policy, an engine cache of 20 blocks of 128 tokens; six prompts of three
chunks each (18 chunks: 1.5 × the tier, so the tier's ghost list, as long as the tier, still
remembers what it evicted) requested in turn, three rounds: each request finds its chunks evicted.

Needs the receipts' metrics (``kvtier_missed_tokens_total``, ``kvtier_ghost_hit_distance_bytes``):
skipped on a kvtier whose connector does not export them."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine_layout import WORKER_IN_ENGINE_CORE

# exact counts only (evictions, the doctor's reading of two metric files), no deadline under two minutes:
# it may run beside another engine test (make test's second phase)
pytestmark = [pytest.mark.engine, pytest.mark.shares_cpu]

CHUNK_BYTES = 2 * 2 * 2 * 64 * 2 * 256  # layers × (K, V) × KV heads × head size × bf16 × chunk tokens
TIER_CHUNKS = 12


def test_doctor_names_evictions_and_the_size_on_a_too_small_cpu_tier(tmp_path: Path):
    from kvtier.launch.serve import start_server
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="random", seed=0)
    kvtier = {"chunk_tokens": 256, "cpu_gib": TIER_CHUNKS * CHUNK_BYTES / 2**30, "policy": "lru"}
    server = start_server(model, kvtier, tmp_path / "serve.log", engine_id=f"causes-{uuid.uuid4().hex[:8]}",
                          extra_args=["--num-gpu-blocks-override", "20", "--block-size", "128"],
                          env=WORKER_IN_ENGINE_CORE)  # one start-up import less (tests/engine_layout.py)
    try:
        server.wait_ready()
        server.complete("warm up", max_tokens=2)
        (tmp_path / "before.txt").write_text(httpx.get(server.base_url + "/metrics", timeout=120).text)
        prefixes = [" ".join(f"w{p}x{i}" for i in range(140)) for p in range(6)]  # ~880 tokens: 3 chunks + a tail
        for round_ in range(3):
            for p, prefix in enumerate(prefixes):
                server.complete(f"{prefix} question {round_}-{p}", max_tokens=2)
        (tmp_path / "after.txt").write_text(httpx.get(server.base_url + "/metrics", timeout=120).text)
    finally:
        server.stop()
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "doctor", "--from-files", str(tmp_path / "before.txt"),
                           str(tmp_path / "after.txt"), "--json"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode in (0, 1), proc.stderr
    evicted = sum(s.value for f in text_string_to_metric_families((tmp_path / "after.txt").read_text())
                  for s in f.samples if s.name == "kvtier_evictions_total" and s.labels.get("tier") == "cpu")
    assert evicted > 0, "the cpu tier evicted nothing: it holds more than the 12 chunks this test means"
    causes = json.loads(proc.stdout)["causes"]
    assert causes["reported"], "the server exported no kvtier_missed_tokens_total"
    lead = causes["misses"][0]
    assert (lead["reason"], lead["tier"]) == ("evicted", "cpu"), causes["misses"]
    size = causes["sizes"]["cpu"]
    assert size["ghost_hits"] > 0
    assert size["capacity_bytes"] < size["recommended_bytes"] <= 4 * size["capacity_bytes"], size
    text = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "doctor", "--from-files",
                           str(tmp_path / "before.txt"), str(tmp_path / "after.txt")], capture_output=True,
                          text=True, timeout=120, check=False, env={"COLUMNS": "300", "PATH": "/usr/bin",
                                                                    "PYTHONPATH": ":".join(sys.path)}).stdout
    assert "Miss reason #1: evicted (cpu)" in text and "would hold its working set" in text and "set cpu_gib" in text
