"""Replay of a Mooncake-format trace: shared hash ids become shared token prefixes on the wire.

Trace format (Mooncake, FAST'25 release, kvcache-ai/Mooncake ``FAST25-release/traces``): one JSON
object per line with ``timestamp`` (ms from the start of the trace), ``input_length`` and
``output_length`` (tokens) and ``hash_ids``, one id per 512-token block of the prompt; equal ids
mean the same block content after the same prefix, and the last block may be partial.

Token mapping, with ``T = tokens_per_block`` (512 reproduces the trace's lengths; 64 shrinks every
prompt 8x so a CPU engine keeps up while keeping the sharing structure)::

    hash_ids:  [ h0     | h1     | h2   ]            input_length = 2*512 + r
    prompt:    [ B(h0)  | B(h1)  | B(h2)[:r*T/512] ]  B(h) = T ids drawn from (seed, h)

Because block ``i`` depends only on its hash id, and a hash id fixes its whole prefix, two
requests whose hash-id lists share ``k`` leading ids share exactly ``k*T`` leading tokens (or the
shorter prompt's length), and differ at the first block where their ids differ.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.bench.workload import DOMAIN_TRACE_BLOCK, BenchRequest, TokenSpace, Workload, WorkloadError
from kvtier.core.errors import TraceError
from kvtier.tools.mooncake import (
    BUNDLED_TRACE,
    MOONCAKE_BLOCK_TOKENS,
    TraceRecord,
    iter_records,
)
from kvtier.tools.mooncake import bundled_trace_path as _bundled

__all__ = ["BUNDLED_TRACE", "MOONCAKE_BLOCK_TOKENS", "TraceRecord", "bundled_trace_path", "load_trace",
           "returning_only", "scaled_prompt_len", "trace_workload"]


def bundled_trace_path() -> Path:
    """Path of the Mooncake conversation trace shipped in ``kvtier/data`` (12,031 requests).

    Raises:
        WorkloadError: if the package was installed without its data file.
    """
    try:
        return _bundled()
    except TraceError as exc:
        raise WorkloadError(str(exc)) from None


def load_trace(path: Path, start: int = 0, limit: int | None = None) -> list[TraceRecord]:
    """Read records ``start .. start+limit-1`` (0-based line numbers) of a ``.jsonl`` or ``.jsonl.gz``
    Mooncake trace (read by :mod:`kvtier.tools.mooncake`, the one Mooncake reader).

    Raises:
        WorkloadError: the file is missing, a line is not a Mooncake record, or the window is empty.
    """
    if start < 0 or (limit is not None and limit <= 0):
        raise WorkloadError(f"trace window start={start} limit={limit} is invalid; use start >= 0 and limit >= 1")
    try:
        records = list(iter_records(path, None, start, limit))
    except TraceError as exc:
        raise WorkloadError(str(exc)) from None
    if not records and start == 0:  # the whole file: nothing to lower
        raise WorkloadError(f"the trace file {str(path)!r} holds no requests; give a trace with at least one "
                            "Mooncake record.")
    if not records:
        raise WorkloadError(f"the trace window start={start} limit={limit} of {str(path)!r} holds no requests; "
                            "lower --start")
    return records


def returning_only(records: list[TraceRecord]) -> list[TraceRecord]:
    """The records that share more than their first block with another record of the window.

    In the Mooncake conversation trace every prompt starts with the same block (hash id 0, a
    shared system prompt), and the turns of one conversation share everything after it; so this
    keeps the conversations that come back within the window, in trace order, and drops
    single-turn traffic, which no cache can serve.  A selection: reports say so.
    """
    count: dict[tuple[int, ...], int] = {}
    for record in records:
        if len(record.hash_ids) >= 2:
            count[record.hash_ids[:2]] = count.get(record.hash_ids[:2], 0) + 1
    return [r for r in records if len(r.hash_ids) >= 2 and count[r.hash_ids[:2]] >= 2]


def scaled_prompt_len(record: TraceRecord, tokens_per_block: int) -> int:
    """Prompt length in tokens when each 512-token block becomes ``tokens_per_block`` tokens.

    All blocks but the last are full; the last keeps its share ``r/512`` of a block, rounded up,
    so no block vanishes.
    """
    full = len(record.hash_ids) - 1
    rest = min(max(record.input_length - full * MOONCAKE_BLOCK_TOKENS, 1), MOONCAKE_BLOCK_TOKENS)
    return full * tokens_per_block + max(1, -(-rest * tokens_per_block // MOONCAKE_BLOCK_TOKENS))


MAX_TIME_SCALE = 1000.0
"""Largest ``--time-scale`` accepted: a trace replayed 1,000 times slower than recorded."""


def check_trace_knobs(*, tokens_per_block: int, time_scale: float, max_prompt_tokens: int | None,
                      max_output_tokens: int | None) -> None:
    """Check the knobs of :func:`trace_workload` (same meanings) without building it.

    Raises:
        WorkloadError: a knob is out of range.
    """
    if tokens_per_block <= 0:
        raise WorkloadError(f"--sent-tokens-per-block {tokens_per_block} must be a positive number of tokens")
    if not 0 <= time_scale <= MAX_TIME_SCALE:  # nan fails too
        raise WorkloadError(f"--time-scale {time_scale} must be from 0 to {MAX_TIME_SCALE:,.0f} (0 sends as fast as "
                            "concurrency allows; nan sent everything at once, inf waited forever)")
    if max_prompt_tokens is not None and max_prompt_tokens <= 0:
        raise WorkloadError(f"--max-prompt-tokens {max_prompt_tokens} must be positive")
    if max_output_tokens is not None and max_output_tokens <= 0:
        raise WorkloadError(f"--max-output-tokens {max_output_tokens} must be positive")


def trace_workload(records: list[TraceRecord], tokens: TokenSpace, *, tokens_per_block: int = 64,
                   time_scale: float = 1.0, max_prompt_tokens: int | None = None,
                   max_output_tokens: int | None = None) -> Workload:
    """Turn trace records into requests (see the module docstring for the token mapping).

    Args:
        records: a window of the trace, in order.
        tokens: the token space (seed, vocabulary range).
        tokens_per_block: tokens per hash id on the wire (512 = the trace's own lengths).
        time_scale: multiplies the trace's inter-arrival times (0.5 = twice as fast; 0 = send all at
            once, i.e. closed loop under the client's concurrency limit).
        max_prompt_tokens: prompts longer than this are cut to it (their shared prefix survives).
        max_output_tokens: completion lengths are capped to this.

    Raises:
        WorkloadError: a knob is out of range.
    """
    check_trace_knobs(tokens_per_block=tokens_per_block, time_scale=time_scale, max_prompt_tokens=max_prompt_tokens,
                      max_output_tokens=max_output_tokens)
    t0 = records[0].timestamp_ms
    seen: set[int] = set()
    blocks: dict[int, tuple[int, ...]] = {}  # hash id -> its full block; a partial block is a slice
    requests: list[BenchRequest] = []
    num_truncated = 0
    for record in records:
        length = scaled_prompt_len(record, tokens_per_block)
        prompt: list[int] = []
        for hash_id in record.hash_ids:
            block = blocks.get(hash_id)
            if block is None:
                block = blocks[hash_id] = tokens.block(DOMAIN_TRACE_BLOCK, (hash_id,), tokens_per_block)
            prompt.extend(block[:length - len(prompt)])
        if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
            prompt = prompt[:max_prompt_tokens]
            num_truncated += 1
        shared_blocks = 0
        for hash_id in record.hash_ids:  # a seen id implies its whole prefix was seen
            if hash_id not in seen:
                break
            shared_blocks += 1
        seen.update(record.hash_ids)
        output = record.output_length if max_output_tokens is None else min(record.output_length, max_output_tokens)
        requests.append(BenchRequest(
            request_id=f"trace-{record.index}", prompt_token_ids=tuple(prompt), max_tokens=max(1, output),
            arrival_s=(record.timestamp_ms - t0) / 1000.0 * time_scale,
            shared_prefix_tokens=min(shared_blocks * tokens_per_block, len(prompt))))
    notes = []
    if num_truncated:
        notes.append(f"{num_truncated} prompts cut to {max_prompt_tokens} tokens")
    params: dict[str, object] = {
        "start": records[0].index, "limit": len(records), "tokens_per_block": tokens_per_block,
        "time_scale": time_scale, "max_prompt_tokens": max_prompt_tokens, "max_output_tokens": max_output_tokens,
        "seed": tokens.seed}
    return Workload(name="trace", params=params, requests=tuple(requests), notes=tuple(notes))
