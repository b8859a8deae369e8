"""``kvtier trace``: make Mooncake-format traces (synthetic regimes, or recorded from a live
server) and describe them (reuse-distance histogram and regime)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvtier.cli.errors import fail
from kvtier.cli.outputs import check_new_files

SYNTH_HELP = """Generate a seeded synthetic trace (Mooncake JSONL) of one traffic regime.

Regimes and their parameters (--set NAME=VALUE, repeatable; defaults in docs/simulate.md):
chat (rate_per_s, system_prompts, system_tokens, single_turn_share, mean_turns, think_median_s,
think_sigma, user_median_tokens, answer_median_tokens); agent (rate_per_s, agents, system_tokens,
mean_steps, tool_median_s, tool_sigma, task_median_tokens, step_median_tokens); rag (rate_per_s,
documents, zipf_s, doc_median_tokens, doc_sigma, system_tokens, question_median_tokens); batch
(rate_per_s, templates, template_tokens, doc_median_tokens, hot_share, hot_prompts,
hot_median_tokens); cycle (rate_per_s, prompts, prompt_tokens, system_tokens, jitter)."""


def _parse_sets(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip() or not value.strip():
            fail(f"--set takes NAME=VALUE (e.g. --set think_median_s=60); got {pair!r}")
        out[name.strip()] = value.strip()
    return out


def register(app: typer.Typer) -> None:
    trace_app = typer.Typer(help="Make and describe request traces (Mooncake JSONL: block ids, lengths and "
                            "times only, never prompt text).", no_args_is_help=True)
    app.add_typer(trace_app, name="trace")
    register_record(trace_app)

    @trace_app.command("synth", help=SYNTH_HELP)
    def synth(
        regime: str = typer.Option(..., "--regime", help="chat, agent, rag, batch or cycle."),
        out: Path = typer.Option(..., "--out", help="Output file (.jsonl, or .jsonl.gz to compress). An existing "
                                 "file is refused without --force."),
        force: bool = typer.Option(False, "--force", help="Replace an existing --out."),
        requests: int = typer.Option(5000, "--requests", help="Number of requests."),
        seed: int = typer.Option(0, "--seed", help="Seed (same seed and parameters: same file)."),
        block_tokens: int = typer.Option(512, "--block-tokens", help="Tokens per hash id (Mooncake: 512)."),
        sets: list[str] = typer.Option([], "--set", help="Regime parameter NAME=VALUE (repeatable)."),
    ) -> None:
        from kvtier.simulate.synth import SynthError, generate, make_params
        from kvtier.simulate.trace import distinct_full_blocks
        from kvtier.tools.mooncake import TraceRecord, write_records

        check_new_files([("--out", out)], force)
        try:
            params = make_params(regime, _parse_sets(sets))
            records = generate(regime, params, requests, seed, block_tokens)
        except SynthError as exc:
            fail(str(exc))
        try:
            written = write_records(out, (TraceRecord(i, r.timestamp_ms, r.input_length, r.output_length, r.hash_ids)
                                          for i, r in enumerate(records)))
        except OSError as exc:
            fail(f"cannot write {out} ({exc.strerror}); pass a path in a writable directory")
        blocks = distinct_full_blocks(records, block_tokens)  # counted as `trace stats` counts them
        typer.echo(f"{out}: {written:,} {regime} requests, {blocks:,} distinct full blocks of {block_tokens} tokens, "
                   f"{records[-1].timestamp_ms / 1000:,.0f} s (seed {seed}){read_with(block_tokens)}")

    @trace_app.command("stats")
    def stats(
        trace: Path = typer.Option(..., "--trace", help="Trace file (.jsonl or .jsonl.gz)."),
        fmt: str = typer.Option("auto", "--format", "--trace-format", help="auto (from its first record), mooncake "
                                 "or kvtier-jsonl."),
        tokens_per_block: int | None = typer.Option(None, "--tokens-per-block",
                                                    help="Tokens per block (mooncake: 512)."),
    ) -> None:
        """Print a trace's size, its reuse-distance histogram and the regime it is in."""
        from kvtier.simulate.reuse import histogram_lines, reuse_histogram
        from kvtier.simulate.trace import TraceError, read_trace

        try:
            requests = read_trace(trace, fmt, tokens_per_block)
        except TraceError as exc:
            fail(str(exc))
        typer.echo(f"{requests.name}: {requests.num_requests:,} requests over {requests.duration_s:,.0f} s, "
                   f"{requests.num_chunks:,} full chunks ({requests.num_unique_chunks:,} distinct) of "
                   f"{requests.block_tokens} tokens")
        if requests.num_chunks == 0:  # no histogram of 0 % rows, no "regime: scan" of nothing
            typer.echo(f"No full chunks: every prompt is shorter than one block of {requests.block_tokens} tokens, so "
                       "there is no reuse to classify; give --tokens-per-block the block size the trace was made "
                       "with (or a smaller one).")
            return
        for line in histogram_lines(reuse_histogram(requests)):
            typer.echo(line)


def read_with(block_tokens: int) -> str:
    """What a trace of ``block_tokens`` per hash id needs to be read: a Mooncake line has no field
    for its block size, so ``trace stats``, ``simulate`` and ``size`` assume Mooncake's 512."""
    if block_tokens == 512:
        return ""
    return (f"; read it with --tokens-per-block {block_tokens} (trace stats, simulate, size), which otherwise "
            "assume Mooncake's 512")


def register_record(trace_app: typer.Typer) -> None:
    @trace_app.command("record")
    def record(
        url: str = typer.Option(..., "--url", help="The server to record (e.g. http://127.0.0.1:8000); it needs "
                                "vLLM's /tokenize endpoint."),
        out: Path = typer.Option(..., "--out", help="Trace file to write (Mooncake JSONL); written when recording "
                                 "ends, only if a request was recorded. An existing file is refused without --force."),
        force: bool = typer.Option(False, "--force", help="Replace an existing --out (still only if a request was "
                                   "recorded)."),
        listen: str = typer.Option("127.0.0.1:8100", "--listen", help="HOST:PORT the recording proxy listens on: "
                                   "point clients here instead of --url."),
        block_tokens: int = typer.Option(512, "--block-tokens", help="Tokens per hash id (Mooncake: 512; use "
                                         "kvtier's chunk_tokens to replay at its granularity)."),
        duration_s: float = typer.Option(0.0, "--duration-s", help="Stop after this many seconds (0: on Ctrl-C)."),
        timeout_s: float = typer.Option(600.0, "--timeout-s", help="Limit of each call to the server in all "
                                        "(connect, headers and whole answer), seconds."),
    ) -> None:
        """Record a live server's traffic as a Mooncake trace (block ids, lengths and times only,
        never prompt text) through a pass-through proxy; then run `kvtier simulate` on it."""
        import signal
        import time

        from kvtier.core.errors import ServerAnswerError
        from kvtier.simulate.record import TraceRecorder
        from kvtier.tools.httpget import get_within

        host, sep, port_text = listen.rpartition(":")
        if not sep or not port_text.isdigit():
            fail(f"--listen must be HOST:PORT such as 127.0.0.1:8100; got {listen!r}")
        if not 1 <= int(port_text) <= 65535:
            fail(f"--listen port {port_text} is out of range; give a port from 1 to 65535 such as 127.0.0.1:8100")
        if block_tokens <= 0 or not duration_s >= 0 or not 0 < timeout_s < float("inf") or duration_s == float("inf"):
            fail("--block-tokens and --timeout-s must be positive and --duration-s >= 0 (finite numbers)")
        from kvtier.core.config import MAX_CHUNK_TOKENS

        if block_tokens > MAX_CHUNK_TOKENS:  # the bound trace synth and the connector's chunk_tokens apply
            fail(f"--block-tokens {block_tokens:,} is more than {MAX_CHUNK_TOKENS:,}, longer than any model's context, "
                 "so no prompt would fill a block; use Mooncake's 512 or kvtier's chunk_tokens")
        check_new_files([("--out", out)], force, when=" once a request is recorded")
        try:  # 10 s (or --timeout-s if shorter) in all (kvtier.tools.httpget): a trickle cannot hold the start
            page = get_within(url.rstrip("/") + "/v1/models", min(10.0, timeout_s), "its model list",
                              max_body_bytes=1 << 20)
            if page.status != 200:
                raise ServerAnswerError(f"it answered HTTP {page.status}")
        except ServerAnswerError as exc:
            fail(f"cannot reach the server at {url} ({exc}); pass the base URL of a running OpenAI-compatible server")
        try:
            recorder = TraceRecorder(url, out, host or "127.0.0.1", int(port_text), block_tokens, timeout_s).start()
        except OSError as exc:
            fail(f"cannot listen on {listen} or write next to {out} ({exc.strerror}); pick a free port and a writable "
                 "directory")
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            # started with `&` from a script, which passes SIGINT on ignored: Ctrl-C or `kill -INT` is how a
            # recording without --duration-s is meant to end, so take it back (SIGTERM ends it the same way)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        typer.echo(f"recording {url} through http://{host or '127.0.0.1'}:{recorder.port} into {out} "
                   f"({'Ctrl-C' if not duration_s else f'{duration_s:g} s'} to stop; each line goes to "
                   f"{recorder.part_path} as it is recorded, renamed to {out.name} at the stop)")
        try:
            deadline = time.monotonic() + duration_s if duration_s else None
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        finally:  # also on SIGTERM or SIGHUP (kvtier.cli.termination): what was recorded is written and said
            recorder.close()
            unrecorded = f"{recorder.failed} passed through unrecorded: the server could not tokenize them"
            if recorder.kept:
                typer.echo(f"{out}: {recorder.recorded} requests recorded ({unrecorded}){read_with(block_tokens)}")
            else:
                typer.echo(f"no request recorded ({unrecorded}); {out} was not written"
                           + (" and still holds its previous trace" if out.exists() else ""))
