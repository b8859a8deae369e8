"""Build any of the three workloads from one set of knobs (what the CLI collects).

``build_workload`` also fits a trace to the server: prompts are cut so that prompt + output fits
``max_model_len``, and checks the other workloads fit, failing with a sentence that names the knob.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.multi_round import check_multi_round, multi_round_workload
from kvtier.bench.prefix_repetition import check_prefix_repetition, prefix_repetition_workload
from kvtier.bench.trace import (
    TraceRecord,
    bundled_trace_path,
    check_trace_knobs,
    load_trace,
    returning_only,
    trace_workload,
)
from kvtier.bench.workload import Workload, WorkloadError, vocab_token_space
from kvtier.tools.mooncake import BUNDLED

WORKLOADS = ("trace", "prefix-repetition", "multi-round")


@dataclass(frozen=True)
class WorkloadKnobs:
    """Every workload knob; each workload reads its own (see the workload modules for meanings).

    ``time_scale=None`` means 1.0 (real time) in open loop and 0 (as fast as allowed) when
    ``closed_loop`` is set.
    """

    kind: str = "trace"
    seed: int = 0
    # trace
    trace_path: Path | None = None
    start: int = 0
    limit: int = 200
    tokens_per_block: int = 64
    time_scale: float | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = 32
    returning_only: bool = False
    # prefix-repetition
    num_requests: int = 100
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128
    request_rate: float | None = None
    shuffle: bool = False
    # multi-round
    num_sessions: int = 8
    num_rounds: int = 4
    system_len: int = 512
    question_len: int = 128
    answer_len: int = 64
    think_time_s: float = 1.0
    session_interval_s: float = 0.5


def model_vocab_size(model: str) -> int | None:
    """``vocab_size`` from ``MODEL/config.json`` when ``model`` is a local directory, else ``None``."""
    config = Path(model) / "config.json"
    try:
        value = json.loads(config.read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) else None


def _time_scale(knobs: WorkloadKnobs, closed_loop: bool) -> float:
    return knobs.time_scale if knobs.time_scale is not None else (0.0 if closed_loop else 1.0)


def _trace_window(knobs: WorkloadKnobs) -> tuple[list[TraceRecord], tuple[str, ...]]:
    """The trace's records in the knobs' window (``--returning-only`` applied) and the notes saying so.

    Raises:
        WorkloadError: the trace cannot be read, the window is empty, or no conversation in it comes back.
    """
    path = knobs.trace_path
    if path is None or (str(path) == BUNDLED and not Path(path).exists()):  # `--trace bundled`, as simulate reads it
        path = bundled_trace_path()
    records = load_trace(path, knobs.start, knobs.limit)
    if not knobs.returning_only:
        return records, ()
    kept = returning_only(records)
    if not kept:
        raise WorkloadError(f"no conversation of the trace window start={knobs.start} limit={knobs.limit} "
                            "comes back; widen --limit or drop --returning-only")
    return kept, ((f"returning conversations only: {len(kept)} of the window's {len(records)} requests "
                   "(those sharing more than the first block with another request of the window)"),)


def _check_seed(seed: int) -> None:
    """Refuse a negative ``--seed`` (WorkloadError): TokenSpace's own ValueError reached the user as a traceback."""
    if seed < 0:
        raise WorkloadError(f"--seed {seed} is negative; give a seed >= 0")


_OWN_KNOBS = {
    "trace": {"trace_path": "--trace", "start": "--start", "limit": "--limit", "tokens_per_block": "--sent-tokens-per-block",
              "time_scale": "--time-scale", "max_prompt_tokens": "--max-prompt-tokens",
              "max_output_tokens": "--max-output-tokens", "returning_only": "--returning-only"},
    "prefix-repetition": {"num_requests": "--num-requests", "prefix_len": "--prefix-len", "suffix_len": "--suffix-len",
                          "num_prefixes": "--num-prefixes", "output_len": "--output-len",
                          "request_rate": "--request-rate", "shuffle": "--shuffle"},
    "multi-round": {"num_sessions": "--num-sessions", "num_rounds": "--num-rounds", "system_len": "--system-len",
                    "question_len": "--question-len", "answer_len": "--answer-len", "think_time_s": "--think-time",
                    "session_interval_s": "--session-interval"},
}
"""The knobs each workload reads, with the option that sets each (the rest of WorkloadKnobs is common)."""


def _check_foreign_knobs(knobs: WorkloadKnobs) -> None:
    """Refuse (WorkloadError) a knob of another workload set away from its default: it would be
    ignored silently (`bench run --num-requests 60` without --workload replayed 200 trace requests)."""
    defaults = WorkloadKnobs()
    for kind, own in _OWN_KNOBS.items():
        if kind == knobs.kind:
            continue
        given = [flag for field, flag in own.items() if getattr(knobs, field) != getattr(defaults, field)]
        if given:
            raise WorkloadError(f"{', '.join(given)} {'is an option' if len(given) == 1 else 'are options'} of the "
                                f"{kind} workload, not of {knobs.kind}, and would be ignored; add --workload {kind} "
                                f"or drop {'it' if len(given) == 1 else 'them'}")


def check_knobs(knobs: WorkloadKnobs, closed_loop: bool) -> None:
    """Check every knob that does not depend on the server (its vocabulary and max model len), so a
    command can refuse a bad one before it reaches any server: the kind, each workload's ranges, and
    for a trace that its window can be read and is not empty.

    Raises:
        WorkloadError: the same sentence :func:`build_workload` would give, or a knob of another
            workload than ``knobs.kind`` set away from its default (it would be ignored).
    """
    _check_seed(knobs.seed)
    if knobs.kind in _OWN_KNOBS:
        _check_foreign_knobs(knobs)
    if knobs.kind == "trace":
        check_trace_knobs(tokens_per_block=knobs.tokens_per_block, time_scale=_time_scale(knobs, closed_loop),
                          max_prompt_tokens=knobs.max_prompt_tokens, max_output_tokens=knobs.max_output_tokens)
        _trace_window(knobs)
    elif knobs.kind == "prefix-repetition":
        check_prefix_repetition(num_requests=knobs.num_requests, prefix_len=knobs.prefix_len,
                                suffix_len=knobs.suffix_len, num_prefixes=knobs.num_prefixes,
                                output_len=knobs.output_len, request_rate=knobs.request_rate)
    elif knobs.kind == "multi-round":
        check_multi_round(num_sessions=knobs.num_sessions, num_rounds=knobs.num_rounds, system_len=knobs.system_len,
                          question_len=knobs.question_len, answer_len=knobs.answer_len,
                          think_time_s=knobs.think_time_s, session_interval_s=knobs.session_interval_s)
    else:
        raise WorkloadError(f"unknown workload {knobs.kind!r}; choose one of {', '.join(WORKLOADS)}")


def build_workload(knobs: WorkloadKnobs, vocab_size: int, max_model_len: int | None,
                   closed_loop: bool) -> Workload:
    """The workload ``knobs.kind``, fitted to ``max_model_len`` (``None``: unknown, no fitting).

    Raises:
        WorkloadError: unknown kind, a knob out of range or of another workload, or a prompt that
            cannot fit the model.
    """
    _check_seed(knobs.seed)
    if knobs.kind in _OWN_KNOBS:
        _check_foreign_knobs(knobs)
    tokens = vocab_token_space(knobs.seed, vocab_size)
    if knobs.kind == "trace":
        cap = knobs.max_prompt_tokens
        if max_model_len is not None:
            room = max_model_len - (knobs.max_output_tokens or 0)
            if room <= 0:
                raise WorkloadError(f"--max-output-tokens {knobs.max_output_tokens} leaves no room for a prompt in "
                                    f"max model len {max_model_len}; lower it")
            cap = room if cap is None else min(cap, room)
        records, notes = _trace_window(knobs)
        workload = trace_workload(records, tokens, tokens_per_block=knobs.tokens_per_block,
                                  time_scale=_time_scale(knobs, closed_loop),
                                  max_prompt_tokens=cap, max_output_tokens=knobs.max_output_tokens)
        return dataclasses.replace(workload, notes=notes + workload.notes,
                                   params={**workload.params, "start": knobs.start, "limit": knobs.limit,
                                           "returning_only": knobs.returning_only})
    if knobs.kind == "prefix-repetition":
        workload = prefix_repetition_workload(
            tokens, num_requests=knobs.num_requests, prefix_len=knobs.prefix_len, suffix_len=knobs.suffix_len,
            num_prefixes=knobs.num_prefixes, output_len=knobs.output_len, request_rate=knobs.request_rate,
            shuffle=knobs.shuffle)
    elif knobs.kind == "multi-round":
        workload = multi_round_workload(
            tokens, num_sessions=knobs.num_sessions, num_rounds=knobs.num_rounds, system_len=knobs.system_len,
            question_len=knobs.question_len, answer_len=knobs.answer_len, think_time_s=knobs.think_time_s,
            session_interval_s=knobs.session_interval_s)
    else:
        raise WorkloadError(f"unknown workload {knobs.kind!r}; choose one of {', '.join(WORKLOADS)}")
    if max_model_len is not None:
        longest = max(workload.requests, key=lambda r: r.prompt_len + r.max_tokens)
        if longest.prompt_len + longest.max_tokens > max_model_len:
            raise WorkloadError(f"request {longest.request_id} needs {longest.prompt_len} prompt + "
                                f"{longest.max_tokens} output tokens, more than max model len {max_model_len}; "
                                "shorten the workload's lengths or serve the model with a longer max model len")
    return workload
