"""One tensor-parallel rank's store, reachable from the scheduler-side connector.

vLLM builds the connector twice: a scheduler-side instance in the EngineCore process and a
worker-side instance in every worker.  The two are often in different processes: on the CPU
backend vLLM always runs its worker in a separate process (multiprocessing executor) unless
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and with tensor parallelism every rank is its own process.

So each worker owns its rank's :class:`~kvtier.core.store.TieredStore` (``cpu_gib / tp_size``
of DRAM) and serves a :class:`RankService` on a Unix socket; the scheduler asks every rank to
*pin* a request's cached prefix when vLLM asks how many tokens can be loaded, and the worker
copies the pinned chunks in the step that loads them.  Pinning at admission means the count
vLLM records as an external hit is exactly what is later copied: chunks are read and verified
(disk promotion included) before the count is returned, so a chunk cannot vanish or turn out
corrupt between the answer and the load.

When the scheduler and the worker live in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
with one rank), :func:`connect` returns the service object itself, no socket involved.

Protocol: :mod:`multiprocessing.connection` over ``AF_UNIX`` with an HMAC handshake keyed by the
engine id (known only to that engine's processes); messages are ``(op, args)`` tuples with ops
restricted to :data:`OPS`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Protocol

from kvtier.core.handles import LoadHandle
from kvtier.core.keys import ChunkKey, chunk_keys, request_root
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.protocol import RequestKeys

log = logging.getLogger(__name__)

OPS = frozenset({"pin", "release", "stats", "ping", "flush", "check_integrity"})
_LOCAL: dict[str, RankService] = {}
_LOCAL_LOCK = threading.Lock()


class Endpoint(Protocol):
    """What the scheduler side calls on each rank (a :class:`RankService` or a socket client)."""

    def pin(self, req_id: str, keys: RequestKeys, max_chunks: int) -> tuple[str, ...]: ...
    def release(self, req_id: str) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def flush(self, timeout_s: float | None = None) -> bool: ...
    def check_integrity(self) -> None: ...


class RankService:
    """A rank's store plus the load handles pinned for admitted requests.

    Args:
        store: this rank's store.
    """

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.root_ns = store.namespace.digest()
        self._pins: dict[str, LoadHandle] = {}
        self._lock = threading.Lock()

    def chain(self, keys: RequestKeys, max_chunks: int | None = None) -> list[ChunkKey]:
        """Chunk keys of the full chunks of ``keys.token_ids`` (at most ``max_chunks``)."""
        tokens = keys.token_ids
        if max_chunks is not None:
            tokens = tokens[:max_chunks * self.store.chunk_tokens]
        root = request_root(self.root_ns, keys.cache_salt, keys.lora, keys.mm_hashes)
        return chunk_keys(root, tokens, self.store.chunk_tokens)

    def pin(self, req_id: str, keys: RequestKeys, max_chunks: int) -> tuple[str, ...]:
        """Pin the longest stored prefix (≤ ``max_chunks`` chunks) for ``req_id``.

        Returns:
            the tier each pinned chunk was found in (``"cpu"`` or ``"disk"``), one per chunk;
            empty when nothing is stored.

        Asking again for the same request keeps the earlier pin when it is still a prefix of the
        request's chain (a request vLLM could not schedule is asked again every step).
        """
        chain = self.chain(keys, max_chunks)
        with self._lock:
            old = self._pins.get(req_id)
            if old is not None and old.keys == chain[:old.num_chunks] and old.num_chunks > 0:
                return tuple(old.tiers)
            self._pins.pop(req_id, None)
        if old is not None:
            self.store.cancel_load(old)
        handle = self.store.prepare_load(chain, max_chunks) if chain else None
        if handle is None or handle.num_chunks == 0:
            if handle is not None:
                self.store.cancel_load(handle)  # empty: nothing pinned, nothing counted
            return ()
        with self._lock:
            self._pins[req_id] = handle
        return tuple(handle.tiers)

    def take(self, req_id: str) -> LoadHandle | None:
        """Hand the pinned handle of ``req_id`` to the loader (who must ``complete_load`` it)."""
        with self._lock:
            return self._pins.pop(req_id, None)

    def release(self, req_id: str) -> None:
        """Drop the pin of a request that will not load (aborted, or nothing left to load)."""
        handle = self.take(req_id)
        if handle is not None:
            self.store.cancel_load(handle)

    def num_pinned_requests(self) -> int:
        with self._lock:
            return len(self._pins)

    def stats(self) -> dict[str, Any]:
        out = self.store.stats()
        out["pinned_requests"] = self.num_pinned_requests()
        return out

    def ping(self) -> str:
        return "pong"

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for queued disk writes (see :meth:`TieredStore.flush`)."""
        return self.store.flush(timeout_s)

    def check_integrity(self) -> None:
        """Assert the store's invariants and that no request holds a pin (tests, operators)."""
        assert self.num_pinned_requests() == 0, f"{self.num_pinned_requests()} requests still hold pins"
        self.store.check_integrity()


def service_address(engine_id: str, dp_rank: int, tp_rank: int) -> str:
    """Unix socket path of one rank's service (short enough for ``sun_path``)."""
    digest = hashlib.blake2b(f"{engine_id}/{dp_rank}".encode(), digest_size=8).hexdigest()
    base = os.path.join(tempfile.gettempdir(), f"kvtier-{os.getuid()}")
    os.makedirs(base, mode=0o700, exist_ok=True)
    return os.path.join(base, f"{digest}-r{tp_rank}.sock")


def authkey_for(engine_id: str) -> bytes:
    """HMAC key of an engine's sockets, derived from its (random) engine id."""
    return hashlib.blake2b(f"kvtier-auth/{engine_id}".encode(), digest_size=32).digest()


class ServiceServer:
    """Serves a :class:`RankService` on a Unix socket from daemon threads."""

    def __init__(self, service: RankService, address: str, authkey: bytes) -> None:
        self.service = service
        self.address = address
        if os.path.exists(address):
            os.unlink(address)  # left by an engine that died
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self._closed = False
        with _LOCAL_LOCK:
            _LOCAL[address] = service
        self._thread = threading.Thread(target=self._accept_loop, name="kvtier-service", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:  # noqa: BLE001 - closed, or a client failed the handshake
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvtier-service-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    op, args = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    if op not in OPS:
                        raise ValueError(f"unknown op {op!r}")
                    conn.send(("ok", getattr(self.service, op)(*args)))
                except Exception as exc:  # report to the caller, keep serving
                    if not isinstance(exc, AssertionError):
                        log.exception("kvtier service op %s failed", op)
                    conn.send(("err", f"{type(exc).__name__}: {exc}"))

    def close(self) -> None:
        self._closed = True
        with _LOCAL_LOCK:
            _LOCAL.pop(self.address, None)
        try:
            self._listener.close()
        finally:
            try:
                os.unlink(self.address)
            except OSError:
                pass


class ServiceUnavailable(RuntimeError):
    """A rank's service could not be reached."""


class ServiceClient:
    """Socket client of one rank's service; connects lazily, one request at a time."""

    def __init__(self, address: str, authkey: bytes, connect_timeout_s: float = 10.0) -> None:
        self.address = address
        self._authkey = authkey
        self._timeout = connect_timeout_s
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def _connect(self) -> Connection:
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                return Client(self.address, family="AF_UNIX", authkey=self._authkey)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() > deadline:
                    raise ServiceUnavailable(f"kvtier worker service at {self.address} is not reachable") from exc
                time.sleep(0.05)

    def call(self, op: str, *args: Any) -> Any:
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = self._connect()
                self._conn.send((op, args))
                status, value = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._conn = None
                raise ServiceUnavailable(f"kvtier worker service at {self.address} went away ({exc})") from exc
        if status != "ok":
            raise RuntimeError(f"kvtier worker service: {value}")
        return value

    def pin(self, req_id: str, keys: RequestKeys, max_chunks: int) -> tuple[str, ...]:
        return tuple(self.call("pin", req_id, keys, max_chunks))

    def release(self, req_id: str) -> None:
        self.call("release", req_id)

    def stats(self) -> dict[str, Any]:
        return dict(self.call("stats"))

    def flush(self, timeout_s: float | None = None) -> bool:
        return bool(self.call("flush", timeout_s))

    def check_integrity(self) -> None:
        self.call("check_integrity")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def connect(address: str, authkey: bytes) -> Endpoint:
    """The service at ``address``: the object itself if it lives in this process, else a client."""
    with _LOCAL_LOCK:
        local = _LOCAL.get(address)
    return local if local is not None else ServiceClient(address, authkey)


def local_services() -> dict[str, RankService]:
    """Services living in this process, by address (tests use it to inspect the store)."""
    with _LOCAL_LOCK:
        return dict(_LOCAL)


def engine_endpoints(engine_id: str, tp_size: int = 1, dp_rank: int = 0) -> list[Endpoint]:
    """The rank services of a running engine, given its ``kv_transfer_config.engine_id``.

    Tools and tests use this to read a live engine's store (``stats``, ``flush``,
    ``check_integrity``) from the process that started the engine.
    """
    key = authkey_for(engine_id)
    return [connect(service_address(engine_id, dp_rank, r), key) for r in range(tp_size)]
