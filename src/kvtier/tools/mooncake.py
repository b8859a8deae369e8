"""The Mooncake trace format: read and write it, in one place (engine-independent).

Format (Mooncake, FAST'25 release, kvcache-ai/Mooncake ``FAST25-release/traces``): one JSON object
per line, ``timestamp`` (ms from the start of the trace), ``input_length`` and ``output_length``
(tokens) and ``hash_ids``, one id per ``block_tokens``-token block of the prompt (512 in their
traces), the last block possibly partial, so ``len(hash_ids) == ceil(input_length / block_tokens)``.
Equal ids mean the same block content after the same prefix.  Files may be gzip-compressed
(``.gz``).  The format holds lengths, times and block ids only: never prompt text.

Users: ``kvtier simulate`` (replays it), ``kvtier bench`` (turns it into requests), ``kvtier trace
synth`` and ``kvtier trace record`` (write it).
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from itertools import islice
from pathlib import Path
from typing import IO

from kvtier.core.errors import TraceError
from kvtier.tools.inputfile import not_a_regular_file

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the Mooncake FAST'25 traces (their README: "block size 512")."""

BUNDLED_TRACE = "mooncake_conversation_trace.jsonl.gz"


@dataclass(frozen=True)
class TraceRecord:
    """One request of a Mooncake trace.

    Attributes:
        index: 0-based line number in the file (stable request identity).
        timestamp_ms: arrival time, milliseconds from the start of the trace.
        input_length: prompt tokens.
        output_length: completion tokens.
        hash_ids: one id per block of the prompt, the last possibly partial.
    """

    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


BUNDLED = "bundled"
"""What ``--trace`` takes for the Mooncake conversation trace shipped in kvtier/data."""


def resolve_trace_path(text: str | Path) -> Path:
    """``text`` as a path; :data:`BUNDLED` (unless a file of that name exists) names :func:`bundled_trace_path`.

    Raises:
        TraceError: ``bundled`` but the package lacks its data file.
    """
    if str(text) == BUNDLED and not Path(BUNDLED).exists():
        return bundled_trace_path()
    return Path(text)


def bundled_trace_path() -> Path:
    """Path of the Mooncake conversation trace shipped in ``kvtier/data`` (12,031 requests).

    Raises:
        TraceError: the package was installed without its data file.
    """
    path = Path(str(resources.files("kvtier") / "data" / BUNDLED_TRACE))
    if not path.is_file():
        raise TraceError(f"the bundled trace {BUNDLED_TRACE} is missing from kvtier/data; reinstall kvtier "
                            "or pass --trace PATH")
    return path


GZIP_MAGIC = b"\x1f\x8b"
"""How a gzip stream starts (RFC 1952): a read goes by these bytes, not by the name, so a compressed
trace saved as ``.jsonl`` reads (it was refused as 'not JSONL text or gzip')."""


def _is_gzip(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(2) == GZIP_MAGIC


def _open(path: Path, mode: str) -> IO[str]:
    if path.suffix == ".gz" or (mode == "r" and _is_gzip(path)):
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]
    return path.open(mode, encoding="utf-8")


MAX_TRACE_INT = 2**53
"""Largest length a trace line may give (JSON's exact integers): ``1e300`` was taken and then quoted
back as a 301-digit token count."""


def _int(raw: dict, name: str, where: str, minimum: int) -> int:
    value = raw.get(name)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= MAX_TRACE_INT:
        shown = f"{value:.6g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
        raise TraceError(f"{where}: field {name!r} must be an integer from {minimum} to 2^53, got {shown}")
    return value


def parse_record(raw: object, index: int, where: str, block_tokens: int | None) -> TraceRecord:
    """One decoded JSON line as a record.

    Args:
        raw: the decoded line.
        index: its 0-based line number.
        where: ``"FILE line N"``, for messages.
        block_tokens: if given, ``len(hash_ids)`` must be ``ceil(input_length / block_tokens)``.

    Raises:
        TraceError: a field missing or out of range, naming it.
    """
    if not isinstance(raw, dict):
        raise TraceError(f"{where} is not a JSON object; each line must be one request object")
    if missing := [f for f in ("timestamp", "input_length", "hash_ids") if f not in raw]:
        has = ", ".join(map(repr, list(raw)[:6])) + (", ..." if len(raw) > 6 else "") or "none"
        raise TraceError(f"{where} has no field {' nor '.join(map(repr, missing))} (its fields: {has}); a Mooncake "
                         "trace line has timestamp (ms), input_length, output_length and hash_ids: convert the "
                         "trace (docs/simulate.md describes both formats kvtier reads)")
    stamp = raw.get("timestamp")
    # finite: Python's JSON reader takes Infinity, and bench run would wait forever for that arrival
    if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or not 0 <= stamp < math.inf:
        raise TraceError(f"{where}: field 'timestamp' must be a finite number >= 0 (ms), got {stamp!r}")
    tokens = _int(raw, "input_length", where, 1)
    output = _int(raw, "output_length", where, 0) if "output_length" in raw else 0
    ids = raw.get("hash_ids")
    if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TraceError(f"{where}: field 'hash_ids' must be a non-empty list of integers >= 0")
    if block_tokens is not None:
        expected = -(-tokens // block_tokens)
        if len(ids) != expected:
            raise TraceError(f"{where}: {len(ids)} hash_ids for {tokens} tokens, expected {expected} blocks "
                                f"of {block_tokens} tokens; check --tokens-per-block")
    return TraceRecord(index, float(stamp), tokens, output, tuple(ids))


def jsonl_objects(path: str | Path, start: int = 0) -> Iterator[tuple[int, str, dict]]:
    """``(0-based line number, "NAME line N", object)`` for every non-blank line from ``start`` on of a
    ``.jsonl`` or ``.jsonl.gz`` file: the one JSONL reader of the trace formats.

    Raises:
        TraceError: missing/unreadable file, a line that is not JSON or not a JSON object (naming the line).
    """
    path = Path(path)
    if (kind := not_a_regular_file(path)) is not None and not path.is_dir():  # stat before open: a FIFO would hang
        raise TraceError(f"trace file {path} {kind}; pass a .jsonl(.gz) file")
    try:
        with _open(path, "r") as handle:
            first_seen = start > 0
            for lineno, line in enumerate(handle):
                if lineno < start or not line.strip():
                    continue
                where = f"{path.name} line {lineno + 1}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    if not first_seen:  # the first line already: not a JSONL file at all (a CSV, a log)
                        raise TraceError(f"{where} is not JSON ({exc.msg}): a trace is JSONL, one JSON object "
                                         "per line (a Mooncake trace: timestamp, input_length, output_length, "
                                         "hash_ids); pass a .jsonl(.gz) trace") from None
                    raise TraceError(f"{where} is not valid JSON ({exc.msg}); fix or remove that line") from None
                except ValueError as exc:  # not a JSONDecodeError: an integer past Python's 4,300-digit limit
                    raise TraceError(f"{where} holds a number too long to read ({str(exc).split(':')[0]}); no "
                                     "request has one: fix or remove that line") from None
                except RecursionError:  # nested deeper than Python's JSON decoder goes: no request is
                    raise TraceError(f"{where} is nested too deeply to be a request object; fix or remove "
                                     "that line") from None
                if not isinstance(obj, dict):
                    raise TraceError(f"{where} is not a JSON object; each line must be one request object")
                first_seen = True
                yield lineno, where, obj
    except FileNotFoundError:
        raise TraceError(f"trace file {path} does not exist; pass an existing .jsonl(.gz) file") from None
    except IsADirectoryError:
        raise TraceError(f"trace path {path} is a directory; pass a .jsonl(.gz) file") from None
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise TraceError(f"cannot read trace file {path} ({exc}); check that it is JSONL text or gzip") from None


def iter_records(path: str | Path, block_tokens: int | None = None, start: int = 0,
                 limit: int | None = None) -> Iterator[TraceRecord]:
    """Records of lines ``start .. start+limit-1`` (0-based) of a ``.jsonl`` or ``.jsonl.gz`` file,
    blank lines skipped.

    Raises:
        TraceError: missing/unreadable file, bad JSON, bad record, a timestamp before the previous
            record's (naming the line: every tool replays in file order, so an unsorted trace is refused
            rather than reordered behind the operator's back).
    """
    records = (parse_record(raw, lineno, where, block_tokens) for lineno, where, raw in jsonl_objects(path, start))
    previous: TraceRecord | None = None
    for record in islice(records, limit):
        if previous is not None:
            check_arrival_order(record.timestamp_ms, previous.timestamp_ms, record.index, previous.index,
                                Path(path).name, "timestamp", "the trace")
        previous = record
        yield record


def check_arrival_order(stamp: float, previous: float, index: int, previous_index: int, name: str, field: str,
                        what: str) -> None:
    """Refuse an arrival ``stamp`` (of 0-based line ``index``) earlier than the previous record's.

    Raises:
        TraceError: one sentence naming both lines and how to sort the file.
    """
    if stamp < previous:
        raise TraceError(f"{name} line {index + 1}: {field} {stamp:g} is before line {previous_index + 1}'s "
                         f"{previous:g}; sort {what} by {field} (e.g. jq -cs 'sort_by(.{field})[]' {name} > "
                         "sorted.jsonl)")


def format_record(timestamp_ms: float, input_length: int, output_length: int, hash_ids: Iterable[int]) -> str:
    """One Mooncake JSON line (without newline)."""
    stamp = int(timestamp_ms) if float(timestamp_ms).is_integer() else round(timestamp_ms, 3)
    return json.dumps({"timestamp": stamp, "input_length": input_length, "output_length": output_length,
                       "hash_ids": list(hash_ids)}, separators=(",", ":"))


def write_records(path: str | Path, records: Iterable[TraceRecord]) -> int:
    """Write records as Mooncake JSONL (gzip if ``path`` ends in ``.gz``); returns how many.

    Raises:
        OSError: the file cannot be written.
    """
    written = 0
    with _open(Path(path), "w") as handle:
        for r in records:
            handle.write(format_record(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) + "\n")
            written += 1
    return written
