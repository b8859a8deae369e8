"""``kvtier bench``: replay traffic against an OpenAI-compatible server (``bench run``, here);
compare arms side by side (``bench compare``, :mod:`kvtier.cli.bench_compare`)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import typer

from kvtier.cli.bench_compare import COMPARE_HELP, compare_command
from kvtier.cli.bench_workload import (
    ANSWER,
    INTERVAL,
    LIMIT,
    MAX_CONC,
    MAX_OUT,
    MAX_PROMPT,
    NUM_PREFIXES,
    NUM_REQ,
    OLD_TPB,
    OUTPUT_LEN,
    PREFIX_LEN,
    QUESTION,
    RATE,
    RETURNING,
    ROUNDS,
    SEED,
    SESSIONS,
    SHUFFLE,
    STALL,
    START,
    SUFFIX_LEN,
    SYSTEM,
    THINK,
    TIME_SCALE,
    TPB,
    TRACE,
    VOCAB,
    WORKLOAD,
    check_workload,
    make_workload,
    workload_knobs,
)
from kvtier.cli.errors import check_input_files, fail
from kvtier.cli.outputs import FORCE_HELP, make_report_dir
from kvtier.cli.termination import note_on_stop

RUN_HELP = """Replay a workload against a running server and read its meters.

Sends token-id prompts to /v1/completions (streaming), records TTFT, inter-token latency and end-to-end latency per request, scrapes /metrics before and after, and prints the hit rates and the verdict (helping / hurting / no reuse). Workloads: trace (Mooncake format, the bundled conversation trace by default; replayed at its arrival times unless --max-concurrency makes it a closed loop), prefix-repetition (a bounded closed loop by default: at most 4 requests in flight, said at the start; --request-rate for an open loop), multi-round (sessions with think time); each deterministic under --seed.

Examples:

  kvtier bench run --url http://127.0.0.1:8000 --workload trace --limit 200 --sent-tokens-per-block 64 --max-concurrency 2

  kvtier bench run --url http://127.0.0.1:8000 --workload prefix-repetition --prefix-len 2000 --num-prefixes 8 --num-requests 64 --out runs/pr

  kvtier bench run --url http://127.0.0.1:8000 --workload multi-round --num-sessions 4 --num-rounds 5 --baseline runs/base/summary.json
"""

DEFAULT_RUN_CONCURRENCY = 4
"""`bench run`'s requests in flight when neither --max-concurrency nor an arrival schedule is given."""

RUN_OUT = typer.Option(None, "--out", help="Directory for requests.json, summary.json and the /metrics texts "
                       "(one that already holds them is refused without --force).")
RUN_FILES = ("metrics-before.txt", "requests.json", "summary.json", "metrics-after.txt")
"""The files `bench run --out DIR` writes in DIR, in the order it writes them (:func:`kvtier.bench.run.run_once`)."""
BASELINE_FILE = typer.Option(None, "--baseline", help="summary.json of an earlier run to judge TTFT against.")


PROBE_TIMEOUT_S = 10.0
"""Total deadline of `bench run`'s start-up probe of ``/v1/models`` and of each ``/metrics`` scrape, seconds."""


def _served_model(url: str, asked: str | None = None) -> tuple[str, int | None]:
    """The server's model (``asked``, which it must serve; else its first) and its ``max_model_len``,
    read from ``/v1/models`` within PROBE_TIMEOUT_S seconds in all (:func:`kvtier.tools.httpget.get_within`);
    fails with exit 2."""
    import json

    from kvtier.core.errors import ServerAnswerError
    from kvtier.tools.httpget import get_within

    models_url = url.rstrip("/") + "/v1/models"
    try:
        page = get_within(models_url, PROBE_TIMEOUT_S, "its model list", max_body_bytes=1 << 20)
    except ServerAnswerError as exc:
        fail(f"{exc} (--url must be the root of a running OpenAI-compatible server)")
    if page.status != 200:
        fail(f"{models_url} answered HTTP {page.status}; --url must be the root of a running OpenAI-compatible server")
    try:
        cards = {str(card["id"]): card for card in json.loads(page.text)["data"]}
        card = cards[asked] if asked in cards else next(iter(cards.values()))
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, StopIteration):
        fail(f"{models_url} did not answer an OpenAI model list; --url must be the root of a running "
             "OpenAI-compatible server")
    if asked is not None and asked not in cards:
        fail(f"the server at {url} serves {', '.join(map(repr, cards))} (its /v1/models), not {asked!r}; "
             "pass one of those to --model, or leave --model out")
    return str(card["id"]), card.get("max_model_len")


def _left_in(out: Path | None) -> str:
    """What a stopped `bench run` left in ``--out``, said after the stop message."""
    if out is None:
        return "nothing was written (no --out)"
    held = [name for name in RUN_FILES if (out / name).is_file()]
    if len(held) == len(RUN_FILES):
        return f"--out {out} holds the run's files ({', '.join(held)})"
    missing = [name for name in RUN_FILES if name not in held]
    missing_text = ", ".join(missing[:-1]) + (" and " if len(missing) > 1 else "") + missing[-1]
    if not held:
        return f"--out {out} holds none of the run's files; run it again"
    return (f"--out {out} holds only {', '.join(held)} (the run was cut short before {missing_text} were written); "
            "run it again with --force to replace it")


def run_command(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="Server root URL."),
    model: str | None = typer.Option(None, "--model", help="Model name to request (default: the server's first model)."),
    out: Path | None = RUN_OUT,
    force: bool = typer.Option(False, "--force", help=FORCE_HELP),
    baseline: Path | None = BASELINE_FILE,
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    workload: str = WORKLOAD, seed: int = SEED, vocab_size: int | None = VOCAB, max_concurrency: int | None = MAX_CONC,
    trace: Path | None = TRACE, start: int = START, limit: int = LIMIT, tokens_per_block: int = TPB,
    old_tokens_per_block: str | None = OLD_TPB,
    time_scale: float | None = TIME_SCALE, max_prompt_tokens: int | None = MAX_PROMPT, max_output_tokens: int = MAX_OUT,
    returning_only: bool = RETURNING,
    num_requests: int = NUM_REQ, prefix_len: int = PREFIX_LEN, suffix_len: int = SUFFIX_LEN,
    num_prefixes: int = NUM_PREFIXES, output_len: int = OUTPUT_LEN, request_rate: float | None = RATE,
    shuffle: bool = SHUFFLE, num_sessions: int = SESSIONS, num_rounds: int = ROUNDS, system_len: int = SYSTEM,
    question_len: int = QUESTION, answer_len: int = ANSWER, think_time: float = THINK,
    session_interval: float = INTERVAL, stall_timeout: float = STALL,
    receipt_log: Path | None = typer.Option(None, "--receipt-log", help=(
        "The server's receipt log (its receipt_log_path, readable here): report the run's tokens per tier and "
        "miss reasons from the requests' receipts beside the metrics', and where they disagree.")),
) -> None:
    from kvtier.bench.run import judge_run, load_baseline, print_run, run_once

    knobs = workload_knobs(
        old_tokens_per_block, kind=workload, seed=seed, trace_path=trace, start=start, limit=limit, tokens_per_block=tokens_per_block,
        time_scale=time_scale, max_prompt_tokens=max_prompt_tokens, max_output_tokens=max_output_tokens,
        returning_only=returning_only, num_requests=num_requests, prefix_len=prefix_len, suffix_len=suffix_len,
        num_prefixes=num_prefixes, output_len=output_len, request_rate=request_rate, shuffle=shuffle,
        num_sessions=num_sessions, num_rounds=num_rounds, system_len=system_len, question_len=question_len,
        answer_len=answer_len, think_time_s=think_time, session_interval_s=session_interval)
    closed_loop = max_concurrency is not None or (workload == "prefix-repetition" and request_rate is None)
    check_workload(knobs, closed_loop, vocab_size)  # a bad option is its own error, not "cannot reach" (clifix2)
    check_input_files([("--baseline", baseline), ("--receipt-log", receipt_log)])
    reference = None
    if baseline is not None:
        try:
            reference = load_baseline(baseline, workload)
        except ValueError as exc:
            fail(str(exc))
    if receipt_log is not None and not receipt_log.parent.is_dir():
        fail(f"--receipt-log {receipt_log}: its directory does not exist; give the server's receipt_log_path")
    if out is not None:
        make_report_dir(out, "--out", force, RUN_FILES,
                        [("--baseline", baseline), ("--receipt-log", receipt_log), ("--trace", trace)])
        for name in RUN_FILES:  # --force: an earlier run's files go now, never mixed with this run's
            (out / name).unlink(missing_ok=True)
    model, max_len = _served_model(url, model)
    if max_concurrency is None and workload == "prefix-repetition" and request_rate is None:
        max_concurrency = DEFAULT_RUN_CONCURRENCY
        print(f"closed loop: at most {max_concurrency} requests in flight (--max-concurrency to change, "
              "--request-rate for an open loop)", flush=True)
    built, _ = make_workload(knobs, vocab_size, model, max_len, closed_loop)
    try:
        with note_on_stop(lambda: _left_in(out)):
            outcome = run_once(built, url, model, max_concurrency, stall_timeout, out, progress=not no_progress,
                               receipt_log=receipt_log)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        fail(f"--receipt-log {receipt_log} holds a line that is not a kvtier receipt ({exc}); give the server's "
             "receipt_log_path")
    if outcome.error is not None:
        fail(outcome.error)
    print_run(outcome, judge_run(outcome, reference))
    assert outcome.run is not None
    if outcome.run.summary().num_ok == 0:  # nothing measured: a CI job must not read this as a pass
        fail(f"no request succeeded: {outcome.run.failure_text() or 'none was sent'}")


def register(app: typer.Typer) -> None:
    """Add ``kvtier bench run`` and ``kvtier bench compare`` to the CLI."""
    bench = typer.Typer(help="Replay traffic against vLLM and tell whether the cache is helping.",
                        no_args_is_help=True)
    bench.command("run", help=RUN_HELP)(run_command)
    bench.command("compare", help=COMPARE_HELP)(compare_command)
    app.add_typer(bench, name="bench")
