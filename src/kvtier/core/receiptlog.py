"""The receipt log (issue 35 item 3): one JSON line per finished request, its cache receipt
(:class:`~kvtier.core.receipt.Receipt` encoded by msgspec), so streaming requests and batch jobs,
whose responses carry no ``kv_transfer_params``, have their receipts too.

Off by default (``receipt_log_path``).  Sampled per request by a hash of the request id the client
gave (:func:`sampled`), so a rerun logs the same requests.  Rotated by the standard library's
:class:`logging.handlers.RotatingFileHandler` at ``receipt_log_file_mib``, keeping
``receipt_log_files`` files (the current one and ``path.1`` … ``path.N-1``, ``.1`` the newest), so
the log takes at most their product on disk.  Written by one background thread
(:class:`~kvtier.core.receiptqueue.QueuedSink`): the scheduler never waits for the disk.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
from collections.abc import Mapping
from typing import Any

import msgspec
import xxhash

from kvtier.core.errors import ConfigError
from kvtier.core.receipt import Receipt
from kvtier.core.receiptqueue import CLOSE_TIMEOUT_S, QueuedSink, external_request_id

MiB = 1 << 20
_HASH_SPAN = float(1 << 64)


def sampled(request_id: str, rate: float) -> bool:
    """Whether the receipt of ``request_id`` is kept at sample ``rate`` (0 to 1): its client-given
    id (:func:`~kvtier.core.receiptqueue.external_request_id`) hashed by xxh64 (seed 0) to a number
    in [0, 1), kept when below ``rate``.  The same id gives the same answer in every run and
    process; ``rate`` 1 keeps all, 0 none."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    return xxhash.xxh64_intdigest(external_request_id(request_id).encode("utf-8")) / _HASH_SPAN < rate


class _LineFile(logging.handlers.RotatingFileHandler):
    """A rotating file of lines whose write errors reach the caller (the writer thread counts them)
    instead of logging's own traceback on stderr."""

    def handleError(self, record: logging.LogRecord) -> None:
        raise  # noqa: PLE0704 - called inside emit's ``except``: re-raise what failed


class ReceiptLog(QueuedSink):
    """JSON-lines receipt log with rotation and sampling.

    Args:
        path: the log file (its directory must exist); appended to when it exists.
        sample: share of requests logged, 0 to 1 (:func:`sampled`).
        file_bytes: size at which the file is rotated, bytes.
        files: files kept, the current one included (at least 2).
        queue_depth: receipts waiting for the writer at most; more are dropped and counted.
        close_timeout_s: longest :meth:`close` waits for the queue to drain.

    Raises:
        ConfigError: the file cannot be opened for appending (one sentence naming it).

    Attributes:
        handler: the :class:`~logging.handlers.RotatingFileHandler` the writer thread writes through;
            its lock (``handler.lock``) is held for each line.
    """

    def __init__(self, path: str, sample: float = 1.0, file_bytes: int = 64 * MiB, files: int = 5,
                 queue_depth: int = 4096, close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        if files < 2:
            raise ValueError(f"files must be at least 2 (the current file and one rotated), got {files}")
        self.path = os.fspath(path)
        self.sample = sample
        try:
            self.handler: logging.handlers.RotatingFileHandler = _LineFile(
                self.path, mode="a", maxBytes=file_bytes, backupCount=files - 1, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(cannot_append(self.path, exc)) from None
        self._encoder = msgspec.json.Encoder()
        super().__init__("log", queue_depth, close_timeout_s)

    def _wanted(self, receipt: Receipt) -> bool:
        return sampled(receipt.request_id, self.sample)

    def _write(self, receipt: Receipt, time_ns: int, trace_headers: Mapping[str, str] | None) -> None:
        line = self._encoder.encode(receipt).decode("utf-8")
        self.handler.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO, "levelname": "INFO"}))

    def _finish(self) -> None:
        self.handler.close()

    def __repr__(self) -> str:
        return f"ReceiptLog({self.path!r}, sample={self.sample:g})"


def cannot_append(path: str, exc: OSError) -> str:
    """The one sentence of a receipt log ``path`` that cannot be opened for appending (the engine's
    :class:`ReceiptLog` and :func:`append_problem`, so ``kvtier check`` says what start-up would)."""
    return (f"cannot open receipt_log_path {path!r} for appending ({exc.strerror or exc}); create its directory, "
            "make it writable, or unset receipt_log_path")


def append_problem(path: str) -> str | None:
    """Why the receipt log ``path`` cannot be opened for appending as :class:`ReceiptLog` opens it
    (:func:`cannot_append`'s sentence), else ``None``; tried for real (``os.access`` answers yes to
    root everywhere, even in ``/proc`` or a read-only ``/sys``), leaving nothing behind: an existing
    file is opened for appending and closed (not written); a missing one is created exclusively and
    removed at once.  ``O_NONBLOCK``: a FIFO without a reader is an error here, not a hang."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOCTTY | os.O_NONBLOCK
    try:
        try:
            fd = os.open(path, flags)
            created = False
        except FileNotFoundError:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
    except OSError as exc:
        return cannot_append(path, exc)
    os.close(fd)
    if created:
        try:
            os.unlink(path)
        except OSError as exc:  # created but cannot be removed: the engine could append; say what is left
            return f"receipt_log_path {path!r} was created by this check and cannot be removed ({exc.strerror})"
    return None


def read_receipt_log(path: str | os.PathLike[str], rotated: bool = True) -> list[Receipt]:
    """Every receipt of the log at ``path``, oldest first: with ``rotated`` its rotated files too
    (``path.N`` … ``path.1``, then ``path``).

    Raises:
        OSError: ``path`` cannot be read.
        msgspec.ValidationError, msgspec.DecodeError: a line is not a receipt.
    """
    base = os.fspath(path)
    names: list[str] = []
    if rotated:
        n = 1
        while os.path.exists(f"{base}.{n}"):
            names.append(f"{base}.{n}")
            n += 1
        names.reverse()
    names.append(base)
    decoder = msgspec.json.Decoder(Receipt)
    out: list[Any] = []
    for name in names:
        with open(name, "rb") as handle:
            out.extend(decoder.decode(line) for line in handle if line.strip())
    return out
