"""A real ZMQ subscriber of a vLLM server's KV events (``--kv-events-config``), decoding with
vLLM's own ``KVEventBatch``: what a cache-aware router (llm-d, Dynamo) receives."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import zmq


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def events_config(port: int, replay_port: int | None = None) -> str:
    """The ``--kv-events-config`` value publishing on ``port`` (all interfaces, vLLM's own form),
    with vLLM's replay endpoint on ``replay_port``."""
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv"}
    if replay_port is not None:
        cfg["replay_endpoint"] = f"tcp://*:{replay_port}"
    return json.dumps(cfg)


class EventSubscriber:
    """Folds a server's event stream into the set of (block hash, medium) it implies.

    ``BlockStored`` adds its hashes at its medium, ``BlockRemoved`` removes them, and
    ``AllBlocksCleared`` (vLLM's own GPU reset) clears the GPU medium only: kvtier's media are
    announced by kvtier's own events."""

    def __init__(self, port: int, replay_port: int | None = None) -> None:
        # imported here, not at the top: collecting test_vllm_serve.py (which imports this module)
        # then imports no vLLM, about 6.5 CPU-s in each pytest process of `make test`'s engine phases
        # (bytecode cached) that collects it, though only test_vllm_serve.py's one test subscribes
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context.instance()
        self._replay_port = replay_port
        self._next_seq = 0  # the sequence number the next batch must carry (vLLM's start at 0)
        self.replayed = 0
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.connect(f"tcp://127.0.0.1:{port}")
        self._sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._lock = threading.Lock()
        self._held: set[tuple[int | bytes, str]] = set()
        self.batches = 0
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            _topic, seq_bytes, payload = self._sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self._next_seq and self._replay_port is not None:
                self._replay(seq)  # ZMQ dropped what was sent before the subscription took: ask vLLM again
            self._apply(seq, payload)

    def _replay(self, until: int) -> None:
        """Batches ``_next_seq .. until - 1`` from vLLM's replay endpoint (a ROUTER: send the start
        sequence number, receive ``(topic, seq, payload)`` frames until its end marker)."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{self._replay_port}")
        try:
            dealer.send_multipart((b"", self._next_seq.to_bytes(8, "big")))
            while dealer.poll(5000):
                _, _topic, seq_bytes, payload = dealer.recv_multipart()
                if not payload:  # the end marker
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if self._next_seq <= seq < until:
                    self.replayed += 1
                    self._apply(seq, payload)
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        batch = self._decoder.decode(payload)
        self._next_seq = seq + 1
        with self._lock:
            self.batches += 1
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    self._held |= {(h, str(ev.medium)) for h in ev.block_hashes}
                elif isinstance(ev, BlockRemoved):
                    self._held -= {(h, str(ev.medium)) for h in ev.block_hashes}
                elif isinstance(ev, AllBlocksCleared):
                    self._held = {x for x in self._held if x[1] != "GPU"}

    def handshake(self, publish: Callable[[], None], timeout_s: float = 20.0, after: int = 0) -> bool:
        """Call ``publish`` (one empty batch through the publisher) until one arrives (more than
        ``after`` batches in all: a publisher restarted on the same endpoint): ZMQ drops what a PUB
        socket sends before a subscriber's subscription reached it ("slow joiner"), so a test
        stepping the scheduler at once must know the subscription is live first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            publish()
            time.sleep(0.05)
            with self._lock:
                if self.batches > after:
                    return True
        return False

    def held(self, media: tuple[str, ...] = ("CPU", "STORAGE")) -> set[tuple[int | bytes, str]]:
        """(hash, medium) pairs the stream says are held now, of ``media``."""
        with self._lock:
            return {x for x in self._held if x[1] in media}

    def wait(self, condition: Callable[[set[tuple[int | bytes, str]]], bool], timeout_s: float = 20.0) -> bool:
        """Whether ``condition(held())`` holds within ``timeout_s`` seconds (polled)."""
        deadline = time.monotonic() + timeout_s
        while not condition(self.held()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
