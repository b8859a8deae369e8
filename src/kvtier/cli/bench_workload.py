"""The options both ``kvtier bench`` commands take (the workload, its seed and vocabulary, the
requests in flight, the stall timeout) and the workload they build, each bad value refused in one
sentence (exit 2) before any request or server."""

from __future__ import annotations

from typing import Any

import typer

from kvtier.cli.errors import fail

# ---- workload options, shared by both commands ------------------------------------------------
WORKLOAD = typer.Option("trace", "--workload", "-w", help="trace, prefix-repetition or multi-round.")
SEED = typer.Option(0, "--seed", help="Seed of every token id (same seed, same requests).")
VOCAB = typer.Option(None, "--vocab-size", min=1, help="Token ids are drawn below this (default: the model's config.json).")
MAX_CONC = typer.Option(None, "--max-concurrency", min=1,
                        help="Requests in flight at most (closed loop); trace arrivals are then ignored unless --time-scale is given. "
                             "bench run: default 4 for prefix-repetition without --request-rate.")
TRACE = typer.Option(None, "--trace", help="Mooncake-format .jsonl(.gz) trace (default: the bundled conversation trace).")
START = typer.Option(0, "--start", min=0, help="trace: first request (0-based line).")
LIMIT = typer.Option(200, "--limit", min=1, help="trace: number of requests.")
TPB = typer.Option(64, "--sent-tokens-per-block", min=1, help=(
    "trace: token ids sent per 512-token trace block (hash id): 512 = the trace's real lengths, 64 = an eighth."))
OLD_TPB = typer.Option(None, "--tokens-per-block", hidden=True, help="Renamed --sent-tokens-per-block; refused.")
TIME_SCALE = typer.Option(None, "--time-scale", min=0.0,
                          help="trace: multiply inter-arrival times (0.1 = 10x faster; 0 = all at once). Default 1, or 0 with --max-concurrency.")
MAX_PROMPT = typer.Option(None, "--max-prompt-tokens", min=1, help="trace: cut longer prompts (the shared prefix survives).")
RETURNING = typer.Option(False, "--returning-only",
                         help="trace: keep only conversations that come back within the window (a selection; reports say so).")
MAX_OUT = typer.Option(32, "--max-output-tokens", min=1, help="trace: cap on completion tokens per request.")
NUM_REQ = typer.Option(100, "--num-requests", min=1, help="prefix-repetition: requests.")
PREFIX_LEN = typer.Option(256, "--prefix-len", min=0, help="prefix-repetition: shared prefix tokens.")
SUFFIX_LEN = typer.Option(256, "--suffix-len", min=0, help="prefix-repetition: fresh suffix tokens.")
NUM_PREFIXES = typer.Option(10, "--num-prefixes", min=1, help="prefix-repetition: distinct prefixes.")
OUTPUT_LEN = typer.Option(128, "--output-len", min=1, help="prefix-repetition: completion tokens.")
RATE = typer.Option(None, "--request-rate", help="prefix-repetition: requests per second, open loop (default: closed loop, 4 in flight in bench run).")
SHUFFLE = typer.Option(False, "--shuffle", help="prefix-repetition: seeded shuffled order instead of round robin.")
SESSIONS = typer.Option(8, "--num-sessions", min=1, help="multi-round: conversations.")
ROUNDS = typer.Option(4, "--num-rounds", min=1, help="multi-round: turns per conversation.")
SYSTEM = typer.Option(512, "--system-len", min=0, help="multi-round: shared system prompt tokens.")
QUESTION = typer.Option(128, "--question-len", min=1, help="multi-round: user tokens per turn.")
ANSWER = typer.Option(64, "--answer-len", min=1, help="multi-round: completion tokens per turn.")
THINK = typer.Option(1.0, "--think-time", min=0.0, help="multi-round: seconds between a reply and the next turn.")
INTERVAL = typer.Option(0.5, "--session-interval", min=0.0, help="multi-round: seconds between session starts.")
STALL = typer.Option(300.0, "--stall-timeout", min=1.0,
                     help="Seconds without a new token before a request fails, bytes without a token (a trickle) "
                          "included (compare: the engine counts as hung).")


def workload_knobs(old_tokens_per_block: str | None = None, **values: Any) -> Any:
    """:class:`kvtier.bench.factory.WorkloadKnobs` of the option values (imported here, on use).

    ``old_tokens_per_block``: the value of bench's former ``--tokens-per-block``, refused (exit 2).
    Everywhere else (simulate, size, trace stats) that flag is the trace's own block size, tokens per
    hash id as the trace was made; bench's was a scale factor, so one spelling meant two things."""
    from kvtier.bench.factory import WorkloadKnobs

    if old_tokens_per_block is not None:
        fail(f"bench's --tokens-per-block is now --sent-tokens-per-block (token ids sent per 512-token trace "
             f"block; --tokens-per-block elsewhere is a trace's own block size): pass --sent-tokens-per-block "
             f"{old_tokens_per_block}")
    return WorkloadKnobs(**values)


def make_workload(knobs: Any, vocab_size: int | None, model: str, max_model_len: int | None,
                  closed_loop: bool) -> tuple[Any, int]:
    """The workload and the vocabulary size its tokens were drawn from."""
    from kvtier.bench.factory import build_workload, model_vocab_size
    from kvtier.bench.workload import WorkloadError, vocab_token_space

    vocab = vocab_size if vocab_size is not None else model_vocab_size(model)
    if vocab is None:
        fail(f"cannot tell the vocabulary size of model {model!r}: no config.json or tokenizer of that name is "
             "found from here (a model path the server was given relative to its own directory is not found "
             "from another one); pass --vocab-size N, or run from the server's directory")
    try:
        vocab_token_space(0, vocab)
    except ValueError as exc:
        fail(f"{exc} (--vocab-size)")
    try:
        return build_workload(knobs, vocab, max_model_len, closed_loop), vocab
    except WorkloadError as exc:
        fail(str(exc))


def check_workload(knobs: Any, closed_loop: bool, vocab_size: int | None) -> None:
    """Refuse (exit 2, one sentence) a workload option, or a --vocab-size, that is wrong whatever the
    server: checked before any request, so a bad option is not reported as an unreachable server."""
    from kvtier.bench.factory import check_knobs
    from kvtier.bench.workload import WorkloadError, vocab_token_space

    if vocab_size is not None:
        try:
            vocab_token_space(0, vocab_size)
        except ValueError as exc:
            fail(f"{exc} (--vocab-size)")
    try:
        check_knobs(knobs, closed_loop)
    except WorkloadError as exc:
        fail(str(exc))

