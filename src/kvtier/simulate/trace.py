"""Request traces: what the simulator replays.

A trace is a sequence of requests in arrival order; each request has an arrival time, a prompt
length in tokens and the keys of its **full** chunks, in prompt order::

    prompt tokens: |<- chunk 0 ->|<- chunk 1 ->|<- chunk 2 ->|<- tail ->|
    chunk keys:        k0            k1            k2          (none: a partial chunk is
                                                                 always recomputed)

Keys are chained (a key names its chunk together with the whole prefix before it), so equal keys
mean equal prefixes.  Readers map every key to a small ``int`` once, so the replay loop hashes
ints, never strings or digests.

Two formats are read (Mooncake through :mod:`kvtier.tools.mooncake`, the one Mooncake reader):

- **Mooncake JSONL** (FAST'25 release, kvcache-ai/Mooncake ``FAST25-release/traces``): one object
  per line with ``timestamp`` (ms), ``input_length`` (tokens), ``output_length`` and ``hash_ids``
  (one id per ``block_tokens``-token block, the last one possibly partial, so
  ``len(hash_ids) == ceil(input_length / block_tokens)``).
- **kvtier JSONL** (recorded by ``kvtier bench`` and the connector, written with
  :func:`format_kvtier_record`): one object per line with ``time_s`` (seconds), ``num_tokens``,
  ``chunk_tokens`` and ``chunk_keys`` (hex digests of the full chunks,
  ``len(chunk_keys) == num_tokens // chunk_tokens``).  No prompt text or token ids are stored.

Both may be gzip-compressed (``.gz``).  Errors raise :class:`TraceError` naming the file and line.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.core.errors import TraceError
from kvtier.tools.mooncake import (
    MOONCAKE_BLOCK_TOKENS,
    check_arrival_order,
    iter_records,
    jsonl_objects,
    resolve_trace_path,
)

FORMATS = ("auto", "mooncake", "kvtier-jsonl")


@dataclass(frozen=True)
class Trace:
    """A replayable trace.

    Attributes:
        name: file name, for reports.
        block_tokens: tokens per chunk key.
        times_s: arrival time of each request, seconds from the first one, shape ``[n]``.
        num_tokens: prompt length of each request in tokens, shape ``[n]``.
        chunk_keys: per request, int ids of its full chunks in prompt order
            (``num_tokens[i] // block_tokens`` ids).
    """

    name: str
    block_tokens: int
    times_s: list[float]
    num_tokens: list[int]
    chunk_keys: list[list[int]]

    @property
    def num_requests(self) -> int:
        return len(self.num_tokens)

    @property
    def num_chunks(self) -> int:
        """Full chunks over all requests (with repeats)."""
        return sum(len(keys) for keys in self.chunk_keys)

    @property
    def num_unique_chunks(self) -> int:
        return len({key for keys in self.chunk_keys for key in keys})

    @property
    def duration_s(self) -> float:
        return self.times_s[-1] - self.times_s[0] if self.times_s else 0.0


def trace_path(text: str | Path) -> Path:
    """``text`` as a path; ``bundled`` names the shipped trace (:func:`kvtier.tools.mooncake.resolve_trace_path`).

    Raises:
        TraceError: ``bundled`` but the package lacks its data file.
    """
    return resolve_trace_path(text)


def full_blocks(hash_ids: Sequence[int], input_length: int, block_tokens: int) -> Sequence[int]:
    """The block ids of a Mooncake request's *full* blocks: the first ``input_length // block_tokens``
    of ``hash_ids`` (its last id may name a partial block, which no cache stores).  The one
    definition of a trace's blocks: ``trace stats``, ``trace synth`` and the simulator count these."""
    return hash_ids[: input_length // block_tokens]


def distinct_full_blocks(records: Iterable[Any], block_tokens: int) -> int:
    """Distinct :func:`full_blocks` over ``records`` (each with ``hash_ids`` and ``input_length``)."""
    return len({b for r in records for b in full_blocks(r.hash_ids, r.input_length, block_tokens)})


def detect_format(path: str | Path) -> str:
    """``"kvtier-jsonl"`` when the first record of ``path`` is one (``chunk_keys`` and no
    ``timestamp``: what ``kvtier trace record`` writes), else ``"mooncake"`` (whose reader names what
    is wrong with a record that is neither).

    Raises:
        TraceError: missing or unreadable file, a first line that is not JSON.
    """
    for _lineno, _where, first in jsonl_objects(Path(path)):
        return "kvtier-jsonl" if "chunk_keys" in first and "timestamp" not in first else "mooncake"
    return "mooncake"


def read_trace(path: str | Path, fmt: str = "auto", block_tokens: int | None = None) -> Trace:
    """Read a trace file.

    Args:
        path: a ``.jsonl`` file, or ``.jsonl.gz``; ``bundled`` (:func:`trace_path`): the shipped trace.
        fmt: ``"mooncake"``, ``"kvtier-jsonl"`` or ``"auto"`` (:func:`detect_format` on its first record).
        block_tokens: tokens per chunk key; Mooncake default 512; kvtier JSONL records carry
            their own ``chunk_tokens`` and this, if given, must match it.

    Raises:
        TraceError: missing/unreadable file, malformed line, unknown format, empty trace,
            ``block_tokens`` not positive.
    """
    if block_tokens is not None and block_tokens <= 0:
        raise TraceError(f"--tokens-per-block must be a positive integer, got {block_tokens}")
    if fmt == "auto":
        fmt = detect_format(trace_path(path))
    if fmt == "mooncake":
        return _read_mooncake(trace_path(path), block_tokens if block_tokens is not None else MOONCAKE_BLOCK_TOKENS)
    if fmt == "kvtier-jsonl":
        return _read(trace_path(path), _KVTierParser(block_tokens))
    raise TraceError(f"unknown trace format {fmt!r}; use one of {', '.join(FORMATS)}")


def format_kvtier_record(time_s: float, num_tokens: int, chunk_tokens: int, keys: Sequence[bytes]) -> str:
    """One kvtier JSONL line (without newline) recording a request without its prompt.

    Args:
        time_s: arrival time in seconds (any origin; the reader keeps differences).
        num_tokens: prompt length in tokens.
        chunk_tokens: tokens per chunk.
        keys: chained chunk keys of the full chunks (``kvtier.core.keys.chunk_keys``).

    Raises:
        ValueError: ``len(keys) != num_tokens // chunk_tokens``.
    """
    if chunk_tokens <= 0 or len(keys) != num_tokens // chunk_tokens:
        raise ValueError(f"{len(keys)} keys for {num_tokens} tokens in chunks of {chunk_tokens}")
    return json.dumps({"time_s": time_s, "num_tokens": num_tokens, "chunk_tokens": chunk_tokens,
                       "chunk_keys": [key.hex() for key in keys]}, separators=(",", ":"))


class _Parser:
    block_tokens: int | None

    def parse(self, obj: dict, where: str) -> tuple[float, int, Sequence[int | str]]:
        """(time_s, num_tokens, full-chunk keys) of one record."""
        raise NotImplementedError


def _read(path: str | Path, parser: _Parser) -> Trace:
    path = Path(path)
    times: list[float] = []
    num_tokens: list[int] = []
    chunk_keys: list[list[int]] = []
    key_to_id: dict[int | str, int] = {}
    previous_line = 0
    for lineno, where, obj in jsonl_objects(path):
        time_s, tokens, keys = parser.parse(obj, where)
        if times:  # the Mooncake reader's rule (iter_records): replayed in file order, so refused unsorted
            check_arrival_order(time_s, times[-1], lineno, previous_line, path.name, "time_s", "the trace")
        previous_line = lineno
        # Dense ids: the replay loop then hashes small ints whatever the key format was.
        chunk_keys.append([key_to_id.setdefault(key, len(key_to_id)) for key in keys])
        times.append(time_s)
        num_tokens.append(tokens)
    if not num_tokens:
        raise TraceError(f"trace file {path} holds no requests; pass a non-empty trace")
    assert parser.block_tokens is not None
    start = times[0]
    return Trace(path.name, parser.block_tokens, [t - start for t in times], num_tokens, chunk_keys)


def _number(obj: dict, name: str, where: str, minimum: int, integer: bool) -> float:
    value = obj.get(name)
    kinds = (int,) if integer else (int, float)
    # finite: Python's JSON reader takes Infinity (a time_s of inf made a trace 'over inf s')
    if not isinstance(value, kinds) or isinstance(value, bool) or not minimum <= value < math.inf:
        kind = "an integer" if integer else "a finite number"
        raise TraceError(f"{where}: field {name!r} must be {kind} >= {minimum}, got {value!r}")
    return value


def _read_mooncake(path: Path, block_tokens: int) -> Trace:
    """A Mooncake file through :mod:`kvtier.tools.mooncake` (the one Mooncake reader); the last,
    partial block of each prompt is dropped (always recomputed)."""
    if block_tokens <= 0:
        raise TraceError(f"--tokens-per-block must be positive, got {block_tokens}")
    times: list[float] = []
    num_tokens: list[int] = []
    chunk_keys: list[list[int]] = []
    key_to_id: dict[int, int] = {}
    for _lineno, where, first in jsonl_objects(path):  # the first record: the other format, said as such
        if "timestamp" not in first and "chunk_keys" in first:
            raise TraceError(f"{where} is a kvtier-jsonl record (chunk_keys), not a Mooncake one; read it as "
                             "kvtier-jsonl (the format auto, the default, does)")
        break
    for record in iter_records(path, block_tokens):
        full = full_blocks(record.hash_ids, record.input_length, block_tokens)
        chunk_keys.append([key_to_id.setdefault(key, len(key_to_id)) for key in full])
        times.append(record.timestamp_ms / 1000.0)
        num_tokens.append(record.input_length)
    if not num_tokens:
        raise TraceError(f"trace file {path} holds no requests; pass a non-empty trace")
    start = times[0]
    return Trace(path.name, block_tokens, [t - start for t in times], num_tokens, chunk_keys)


_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")


class _KVTierParser(_Parser):
    def __init__(self, block_tokens: int | None) -> None:
        self.block_tokens = block_tokens
        self._requested = block_tokens

    def parse(self, obj: dict, where: str) -> tuple[float, int, Sequence[int | str]]:
        if "time_s" not in obj and "hash_ids" in obj:  # the other format: say which flag reads it
            raise TraceError(f"{where} is a Mooncake record (hash_ids), not a kvtier-jsonl one; read it as "
                             "mooncake (the format auto, the default, does)")
        time_s = float(_number(obj, "time_s", where, 0, integer=False))
        tokens = int(_number(obj, "num_tokens", where, 1, integer=True))
        chunk = int(_number(obj, "chunk_tokens", where, 1, integer=True))
        if self.block_tokens is None:
            self.block_tokens = chunk
        if chunk != self.block_tokens:
            source = "--tokens-per-block" if self._requested == self.block_tokens else "earlier lines"
            raise TraceError(f"{where}: chunk_tokens {chunk} differs from {self.block_tokens} ({source}); "
                             "a trace must use one chunk size")
        keys = obj.get("chunk_keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
            raise TraceError(f"{where}: field 'chunk_keys' must be a list of hex strings")
        bad = next((k for k in keys if not _HEX.fullmatch(k)), None)
        if bad is not None:  # key.hex() of format_kvtier_record: whole bytes, hex digits only
            raise TraceError(f"{where}: chunk key {bad[:40]!r} is not hex (an even number of digits 0-9a-f, as "
                             "bytes.hex() writes a chunk key); write each key with format_kvtier_record")
        keys = [k.lower() for k in keys]  # one key, one id: "AB" and "ab" are the same bytes
        if len(keys) != tokens // chunk:
            raise TraceError(f"{where}: {len(keys)} chunk_keys for {tokens} tokens in chunks of {chunk}, "
                             f"expected {tokens // chunk} (one per full chunk)")
        return time_s, tokens, keys
