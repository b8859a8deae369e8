"""Record a live server's traffic as a Mooncake trace: block ids, lengths and times, never text.

``kvtier trace record --url http://SERVER:8000 --listen 127.0.0.1:8100 --out trace.jsonl`` runs a
small HTTP proxy: point clients at ``--listen`` instead of the server.  Every request is passed
through unchanged (streaming included); for each completion request (``/v1/completions``,
``/v1/chat/completions``) it appends one line to the trace once the answer has been sent::

    client ──► proxy ──► server          answer streamed back as it comes
                 │
                 └─► server /tokenize (same prompt or messages, same chat template)
                     token ids → blocks of B tokens → chained BLAKE3 digests → dense ints
                     {"timestamp": ms since start, "input_length": n, "output_length": m,
                      "hash_ids": [ids]}                    (the digests and tokens are dropped)

Chained digests (block ``i`` hashes block ``i-1``'s digest with its own tokens, as vLLM and
kvtier key KV blocks) make equal ids mean equal prefixes; ids are numbered in order of first
appearance, so the file reveals nothing of the prompts but their sharing structure.  Works with
any server that has vLLM's ``/tokenize`` endpoint; needs nothing inside the engine.

Bounds: at most ``max_in_flight`` requests are proxied at once (more get HTTP 503); every upstream
call (the proxied request with its whole answer, and ``/tokenize``) ends within ``timeout_s`` in
all (:func:`kvtier.tools.httpget.stream_within`: a server that trickles bytes cannot hold it), and
:meth:`TraceRecorder.close` ends the requests still in flight at once.

The trace is written, a flushed line per request, into a temporary file next to ``out``
(``out``'s name, a random part, ``.part``: what a SIGKILL leaves) and renamed over ``out`` by
:meth:`TraceRecorder.close` only when at least one request was recorded: a recording that fails
to start, or records nothing, leaves ``out`` as it was.  ``output_length`` is the server's ``usage.completion_tokens`` (for a
stream, from its last usage chunk if the client asked for one; else the streamed choice chunks).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

import blake3
import httpx

from kvtier.core.errors import ServerAnswerError
from kvtier.tools.httpget import Head, request_within, stream_within
from kvtier.tools.mooncake import format_record

log = logging.getLogger(__name__)


class _ProxyServer(ThreadingHTTPServer):
    """The recorder's listener: a client that drops its connection (a keep-alive connection reset
    after its last answer) ends that connection quietly; any other failure of one connection is one
    log line, never socketserver's traceback on the operator's terminal (the recording goes on)."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, (ConnectionError, TimeoutError)):
            log.warning("kvtier trace record: a connection from %s failed: %s", client_address, exc)

RECORDED_PATHS = ("/v1/completions", "/v1/chat/completions")
RECORD_GRACE_S = 10.0
"""Longest :meth:`TraceRecorder.close` waits, seconds, for requests whose answer was sent to write
their trace lines (each asks the server's ``/tokenize`` first): a client that got its whole answer
before the close finds its request in the trace."""
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding",
                "date", "server"}


def block_digests(token_ids: list[int], block_tokens: int) -> list[bytes]:
    """Chained BLAKE3 digests (16 bytes) of each block of ``token_ids``, the last possibly partial."""
    out = []
    previous = b""
    for start in range(0, len(token_ids), block_tokens):
        block = token_ids[start:start + block_tokens]
        digest = blake3.blake3(previous + b"".join(t.to_bytes(4, "little", signed=False) for t in block)).digest(16)
        out.append(digest)
        previous = digest
    return out


class TraceRecorder:
    """Proxy ``upstream`` on ``host:port`` and append one Mooncake line per completion request.

    Args:
        upstream: base URL of the server (``http://host:port``).
        out: trace file (JSONL); replaced by :meth:`close` only when at least one request was
            recorded (see :attr:`kept`), untouched otherwise.
        host, port: where to listen (port 0: any free port; see :attr:`port`).
        block_tokens: tokens per hash id (512 as Mooncake; use your kvtier ``chunk_tokens`` to
            replay at kvtier's granularity).
        timeout_s: limit of each upstream call in all (connect, headers and whole answer), seconds.
        max_in_flight: requests proxied at once; more are answered 503.

    Raises:
        OSError: the address is taken, or no file can be created next to ``out``.
    """

    def __init__(self, upstream: str, out: str | Path, host: str = "127.0.0.1", port: int = 0,
                 block_tokens: int = 512, timeout_s: float = 600.0, max_in_flight: int = 256) -> None:
        if block_tokens <= 0:
            raise ValueError(f"--block-tokens must be positive, got {block_tokens}")
        self.upstream = upstream.rstrip("/")
        self.block_tokens = block_tokens
        self.out = Path(out)
        self.timeout_s = timeout_s
        self.kept = False  # whether close() wrote ``out``
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._answered = 0  # requests whose answer's end was sent and whose line is not written yet
        self._answered_done = threading.Condition()
        self._ids: dict[bytes, int] = {}
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._start = time.monotonic()
        self.recorded = 0
        self.failed = 0  # completion requests passed through but not recorded (tokenize failed)
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet: no prompt ever logged
                return

            def do_GET(self) -> None:
                recorder._proxy(self, b"")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                recorder._proxy(self, self.rfile.read(length) if length else b"")

        self._server = _ProxyServer((host, port), Handler)  # first: a taken port leaves no file behind
        try:
            # in plain sight beside ``out``: after a SIGKILL it holds every line but one being written
            fd, temp = tempfile.mkstemp(prefix=f"{self.out.name}.", suffix=".part", dir=self.out.parent)
        except OSError:
            self._server.server_close()
            raise
        self._temp = Path(temp)
        self.part_path = self._temp  # where each line is appended (flushed) as it is recorded
        umask = os.umask(0o022)  # read it back: the trace gets a new file's usual mode, not mkstemp's 0600
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        self._file: IO[str] = os.fdopen(fd, "w", encoding="utf-8")
        self._client = httpx.Client(timeout=timeout_s)
        self.port = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> TraceRecorder:
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvtier-trace-record", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        """Stop listening, end the requests still in flight (their clients see the connection
        close), and, when at least one request was recorded, put the lines in arrival order (they
        are written as answers finish, so concurrent requests may land out of order) and rename
        the temporary file over ``out`` (:attr:`kept` True); else delete it, ``out`` untouched."""
        self._server.shutdown()  # no new requests
        with self._answered_done:  # a client that has its whole answer gets its line (bounded wait)
            self._answered_done.wait_for(lambda: self._answered == 0, timeout=min(self.timeout_s, RECORD_GRACE_S))
        self._closing.set()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            self._file.close()
        self._client.close()
        if self.recorded == 0:
            self._temp.unlink(missing_ok=True)
            return
        lines = self._temp.read_text(encoding="utf-8").splitlines(keepends=True)
        lines.sort(key=lambda line: json.loads(line)["timestamp"])
        if self.out.suffix == ".gz":  # as every trace reader and writer takes the name (kvtier.tools.mooncake)
            with gzip.open(self._temp, "wt", encoding="utf-8") as packed:
                packed.write("".join(lines))
        else:
            self._temp.write_text("".join(lines), encoding="utf-8")
        os.replace(self._temp, self.out)
        self.kept = True

    # -- per request -------------------------------------------------------------------------
    def _proxy(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        if not self._slots.acquire(blocking=False):
            self._reply(handler, 503, b'{"error": "kvtier trace record: too many requests in flight"}')
            return
        try:
            arrival_ms = (time.monotonic() - self._start) * 1000.0
            path = handler.path
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_HEADERS}
            answered: list[bool] = []
            try:
                output = self._forward(handler, path, body, headers, answered)
                if handler.command == "POST" and path.split("?")[0] in RECORDED_PATHS and output is not None:
                    self._record(path, body, arrival_ms, output)
            finally:
                if answered:
                    with self._answered_done:
                        self._answered -= 1
                        self._answered_done.notify_all()
        finally:
            self._slots.release()

    def _forward(self, handler: BaseHTTPRequestHandler, path: str, body: bytes,
                 headers: dict[str, str], answered: list[bool]) -> int | None:
        """Pass the request through; returns the completion tokens seen (None if it failed).

        The whole exchange ends within ``timeout_s`` (or at :meth:`close`): before the answer's
        head the client gets a 502 naming the cause; after it, the connection is closed without
        the chunked body's end, so the client sees a cut answer rather than a complete one."""
        status = 0
        answer = stream_within(handler.command, self.upstream + path, self.timeout_s, "its answer", content=body or None,
                               headers=headers, client=self._client, stop=self._closing)
        try:
            counter = _OutputCounter()
            for item in answer:
                if isinstance(item, Head):
                    status = item.status
                    handler.send_response(status)
                    for key, value in item.headers:
                        if key.lower() not in _HOP_HEADERS:
                            handler.send_header(key, value)
                    handler.send_header("Transfer-Encoding", "chunked")
                    handler.end_headers()
                    continue
                counter.feed(item)
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(item), item))
                handler.wfile.flush()
            with self._answered_done:  # counted before the client can see the end (close waits for it)
                self._answered += 1
            answered.append(True)
            handler.wfile.write(b"0\r\n\r\n")
            return counter.tokens() if status == 200 else None
        except ServerAnswerError as exc:
            handler.close_connection = True
            if not status:
                message = json.dumps({"error": f"kvtier trace record: upstream {self.upstream} failed ({exc})"})
                self._reply(handler, 502, message.encode())
            return None
        except OSError:  # the client went away
            handler.close_connection = True
            return None
        finally:
            answer.close()

    def _reply(self, handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
        except OSError:
            pass

    def _record(self, path: str, body: bytes, arrival_ms: float, output_tokens: int) -> None:
        """Append the request's trace line(s); a batch (``"prompt"`` a list of strings or of token
        lists) gets one line per prompt, as vLLM runs each as its own request
        (vllm/entrypoints/openai/completion/serving.py), each with an equal share of the batch's
        ``output_tokens`` (the usage the server reports is the batch's total)."""
        try:
            request = json.loads(body)
            if path.startswith("/v1/chat/"):
                query = {"model": request.get("model"), "messages": request["messages"]}
                for key in ("add_generation_prompt", "continue_final_message", "chat_template",
                            "chat_template_kwargs", "tools", "add_special_tokens"):
                    if key in request:
                        query[key] = request[key]
                batch = [self._tokenize(query)]
            else:
                prompt = request["prompt"]
                batched = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
                batch = [self._prompt_tokens(request, one) for one in (prompt if batched else [prompt])]
        except (ValueError, KeyError, TypeError, ServerAnswerError):
            with self._lock:
                self.failed += 1
            return
        share, extra = divmod(output_tokens, len(batch))
        for i, tokens in enumerate(batch):
            self._write(arrival_ms, tokens, share + (i < extra))

    def _prompt_tokens(self, request: dict[str, Any], prompt: Any) -> list[int]:
        """Token ids of one completion prompt: given as ids, else from the server's ``/tokenize``."""
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if not isinstance(prompt, str):
            raise TypeError("a prompt is a string or a list of token ids")
        query = {"model": request.get("model"), "prompt": prompt}
        if "add_special_tokens" in request:
            query["add_special_tokens"] = request["add_special_tokens"]
        return self._tokenize(query)

    def _tokenize(self, query: dict[str, Any]) -> list[int]:
        answer = request_within("POST", self.upstream + "/tokenize", self.timeout_s, "the prompt's token ids",
                                json=query, client=self._client, stop=self._closing, max_body_bytes=64 << 20)
        if answer.status != 200:
            raise ValueError(f"/tokenize answered HTTP {answer.status}")
        tokens = json.loads(answer.text)["tokens"]
        if not isinstance(tokens, list):
            raise TypeError("/tokenize answered no token list")
        return tokens

    def _write(self, arrival_ms: float, tokens: list[int], output_tokens: int) -> None:
        digests = block_digests(tokens, self.block_tokens)
        with self._lock:
            ids = [self._ids.setdefault(d, len(self._ids)) for d in digests]
            if self._file.closed or not ids:
                return
            self._file.write(format_record(round(arrival_ms, 3), len(tokens), output_tokens, ids) + "\n")
            self._file.flush()
            self.recorded += 1


class _OutputCounter:
    """Completion tokens from a JSON answer's ``usage``, or from an SSE stream (usage chunk if any,
    else one token per streamed choice chunk with text)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._usage: int | None = None
        self._chunks = 0

    def feed(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) > (64 << 20):  # bounded: a huge non-stream answer is not parsed
            self._buffer.clear()

    def tokens(self) -> int:
        text = bytes(self._buffer).decode("utf-8", "replace")
        if not text.lstrip().startswith("data:"):
            try:
                return int(json.loads(text)["usage"]["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                return 0
        for line in text.splitlines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            try:
                event = json.loads(line[5:])
            except ValueError:
                continue
            usage = event.get("usage") if isinstance(event, dict) else None
            if usage and usage.get("completion_tokens") is not None:
                self._usage = int(usage["completion_tokens"])
            elif isinstance(event, dict) and event.get("choices"):
                choice = event["choices"][0]
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    self._chunks += 1
        return self._usage if self._usage is not None else self._chunks
