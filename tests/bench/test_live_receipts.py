"""``kvtier bench run --receipt-log`` against a real api_server (issue 35 item 4): the server logs a
receipt per streamed request (``receipt_log_path``), the bench reads back the ones its run added,
and their tokens per tier and miss reasons equal the metric deltas: no disagreement.

Six prefixes of 600 tokens (five full 128-token blocks each with its suffix: 30 blocks) in round robin
through an engine cache of 20 blocks: vLLM's own cache has let a prefix go by the time it comes again
(three prefixes would all stay in it), so the repeats are served by the cpu tier.

Needs the receipts wired into the connector (``kvtier_missed_tokens_total``, the scheduler emitting
to :func:`kvtier.core.receiptsinks.build_receipt_sinks`): skipped before."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.engine_layout import WORKER_IN_ENGINE_CORE

# exact counts only (receipts vs metric deltas), no deadline under two minutes (the bench's stall
# timeout is 300 s): it may run beside another engine test (make test's second phase)
pytestmark = [pytest.mark.engine, pytest.mark.shares_cpu]


def test_bench_run_reads_the_runs_receipts_and_they_agree_with_the_metrics(tmp_path: Path):
    from kvtier.launch.serve import start_server
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="random", seed=0)
    log = tmp_path / "receipts.jsonl"
    server = start_server(model, {"chunk_tokens": 256, "cpu_gib": 0.5, "receipt_log_path": str(log)},
                          tmp_path / "serve.log", engine_id=f"receipts-{uuid.uuid4().hex[:8]}",
                          extra_args=["--num-gpu-blocks-override", "20", "--block-size", "128"],
                          env=WORKER_IN_ENGINE_CORE)  # one start-up import less (tests/engine_layout.py)
    try:
        server.wait_ready()
        server.complete("warm up", max_tokens=2)  # a receipt before the run: not the run's
        proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "run", "--url", server.base_url,
                               "--workload", "prefix-repetition", "--prefix-len", "600", "--suffix-len", "100",
                               "--num-prefixes", "6", "--num-requests", "12", "--output-len", "2",
                               "--max-concurrency", "2", "--vocab-size", "2048", "--no-progress",
                               "--receipt-log", str(log), "--out", str(tmp_path / "run")],
                              capture_output=True, text=True, timeout=600, check=False)
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    receipts = summary["receipts"]
    assert receipts["sent"] == 12 and receipts["receipts"]["requests"] == 12
    assert receipts["notes"] == [], receipts["notes"]
    prompt_tokens = sum(r["prompt_tokens"] for r in json.loads((tmp_path / "run" / "requests.json").read_text())
                        ["requests"])
    assert sum(receipts["receipts"]["tokens"].values()) == prompt_tokens
    assert receipts["receipts"]["tokens"].get("cpu", 0) > 0  # the repeated prefixes came back from the cpu tier
    assert "receipts (12 of 12 requests) vs metrics" in proc.stdout
