"""``kvtier bench``: replay traffic against an OpenAI-compatible server; compare arms side by side."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from kvtier.cli.errors import check_output_path, fail, make_output_dir

RUN_HELP = """Replay a workload against a running server and read its meters.

Sends token-id prompts to /v1/completions (streaming), records TTFT, inter-token latency and end-to-end latency per request, scrapes /metrics before and after, and prints the hit rates and the verdict (helping / hurting / no reuse). Workloads: trace (Mooncake format, the bundled conversation trace by default; replayed at its arrival times unless --max-concurrency makes it a closed loop), prefix-repetition (a bounded closed loop by default: at most 4 requests in flight, said at the start; --request-rate for an open loop), multi-round (sessions with think time); each deterministic under --seed.

Examples:

  kvtier bench run --url http://127.0.0.1:8000 --workload trace --limit 200 --tokens-per-block 64 --max-concurrency 2

  kvtier bench run --url http://127.0.0.1:8000 --workload prefix-repetition --prefix-len 2000 --num-prefixes 8 --num-requests 64 --out runs/pr

  kvtier bench run --url http://127.0.0.1:8000 --workload multi-round --num-sessions 4 --num-rounds 5 --baseline runs/base/summary.json
"""

COMPARE_HELP = """Start one vLLM server per arm and run, and send each the same workload.

Arms: baseline (no connector), kvtier (KVTierConnector, default config or --kvtier-config), kvtier-redis (the kvtier arm plus the shared redis tier on the server --redis names or, with --redis auto, starts on 127.0.0.1; every run under a key prefix of its own, deleted afterwards), kvtier-s3 (the kvtier arm plus the shared s3 tier on a private rclone serve s3 the command starts on 127.0.0.1 under --out, one bucket for all replicas, every run under a key prefix of its own, removed afterwards; needs rclone and obstore: make install), native (vLLM's OffloadingConnector with a CPU tier the size of kvtier's, one per server; on a CPU-only vLLM through kvtier.bench.native_cpu, a benchmark-only shim that swaps the CUDA copy kernel for host copies), example (vLLM's ExampleConnector), and any connector given as --arm NAME='KV_TRANSFER_CONFIG_JSON'. Same model, engine cache size (--engine-cache-tokens), core pinning and workload for every arm. With --repeats N the arms run interleaved (A B C A B C ...) and every figure is the median of N runs with its range; "helping" needs TTFT p50 ranges that do not overlap. Prints one table (hit rates, TTFT p50/p99, throughput, ratios to baseline, verdict) and writes report.md, ttft_cdf.png, per-run server logs and /metrics texts to --out; --json writes the figures as JSON. An arm whose engine dies or hangs is reported with the request where it happened and its log; the other arms still run. With --replicas N every arm runs N servers side by side and request k goes to server k mod N (a round-robin load balancer without affinity); the table's figures are per arm (hit-rate counters summed over its servers, TTFTs over every request) and a second table gives each replica's. Each replica has its own cpu tier (kvtier's or native's) and its own disk_path directory (<disk_path>/run-<k>/r<i>); the replicas of kvtier-redis and kvtier-s3 share the Redis server or the bucket.

Examples:

  kvtier bench compare --model models/mid --max-model-len 4096 --engine-cache-tokens 8192 --workload prefix-repetition --prefix-len 4000 --suffix-len 0 --num-prefixes 3 --num-requests 6 --output-len 1 --max-concurrency 1 --repeats 3

  kvtier bench compare --model models/mid --arms baseline,kvtier,kvtier-redis --replicas 2 --redis auto --kvtier-config cpu.yaml --max-model-len 2048 --engine-cache-tokens 4096 --enforce-eager --workload trace --start 0 --limit 300 --returning-only --tokens-per-block 32 --max-output-tokens 2 --max-concurrency 2 --repeats 2

  kvtier bench compare --model models/mid --arms native,kvtier-redis,kvtier-s3 --replicas 2 --redis auto --kvtier-config cpu.yaml --max-model-len 2048 --engine-cache-tokens 4096 --enforce-eager --workload trace --start 0 --limit 300 --returning-only --tokens-per-block 32 --max-output-tokens 2 --max-concurrency 2 --repeats 2

  kvtier bench compare --model models/tiny --arms baseline,kvtier --arm lmcache='{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}' --workload trace --start 0 --limit 300 --max-concurrency 2 --json out.json
"""

DEFAULT_RUN_CONCURRENCY = 4
"""`bench run`'s requests in flight when neither --max-concurrency nor an arrival schedule is given."""

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
TPB = typer.Option(64, "--tokens-per-block", min=1, help="trace: tokens per 512-token trace block (512 = real lengths).")
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
RUN_OUT = typer.Option(None, "--out", help="Directory for requests.json, summary.json and the /metrics texts.")
BASELINE_FILE = typer.Option(None, "--baseline", help="summary.json of an earlier run to judge TTFT against.")
KVTIER_CONFIG = typer.Option(None, "--kvtier-config", help="YAML of kvtier settings for the kvtier arm.")
COMPARE_OUT = typer.Option(None, "--out", help="Report directory (default .kvtier/bench/compare-<time>).")
JSON_PATH = typer.Option(None, "--json", help="Write the figures as JSON here.")


def _knobs(**values: Any) -> Any:
    from kvtier.bench.factory import WorkloadKnobs

    return WorkloadKnobs(**values)


def _check_local_model(model: str) -> None:
    """Refuse (exit 2, one sentence) a ``--model`` written as a local path that names no model
    directory: vLLM reads a path that exists as the model's directory and anything else as a hub id,
    so a mistyped ``/models/llama`` reached vLLM (after "cannot tell the vocabulary size", or with
    --vocab-size, a server that fails once started).  A hub id (``Qwen/Qwen3-8B``) is left to vLLM."""
    path = Path(model).expanduser()
    if not (model.startswith(("/", "./", "../", "~")) or model in (".", "..") or path.exists()):
        return
    if not path.exists():
        fail(f"--model {model} does not exist; give the model's directory (the one holding config.json) or a "
             "hub id such as Qwen/Qwen3-8B")
    if not path.is_dir():
        fail(f"--model {model} is not a directory; give the model's directory (the one holding config.json)")
    if not (path / "config.json").is_file():
        fail(f"--model {model} holds no config.json, so it is not a model directory; give the directory vLLM loads "
             "(python -m kvtier.launch.testmodel writes one, docs/quickstart.md)")


def _build(knobs: Any, vocab_size: int | None, model: str, max_model_len: int | None,
           closed_loop: bool) -> tuple[Any, int]:
    """The workload and the vocabulary size its tokens were drawn from."""
    from kvtier.bench.factory import build_workload, model_vocab_size
    from kvtier.bench.workload import WorkloadError, vocab_token_space

    vocab = vocab_size if vocab_size is not None else model_vocab_size(model)
    if vocab is None:
        fail(f"cannot tell the vocabulary size of model {model!r}; pass --vocab-size")
    try:
        vocab_token_space(0, vocab)
    except ValueError as exc:
        fail(f"{exc} (--vocab-size)")
    try:
        return build_workload(knobs, vocab, max_model_len, closed_loop), vocab
    except WorkloadError as exc:
        fail(str(exc))


def _check_offline(knobs: Any, closed_loop: bool, vocab_size: int | None) -> None:
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


MAX_RAM_SHARE = 0.9
"""Share of RAM all replicas of one arm may reserve together (``--replicas`` x ``--memory-fraction``):
the rest is for kvtier's own tiers, the client and the OS."""


PROBE_TIMEOUT_S = 10.0
"""Total deadline of `bench run`'s start-up probe of ``/v1/models`` and of each ``/metrics`` scrape, seconds."""


def _served_model(url: str) -> tuple[str, int | None]:
    """The server's first model and its ``max_model_len``, read from ``/v1/models`` within
    PROBE_TIMEOUT_S seconds in all (:func:`kvtier.tools.httpget.get_within`); fails with exit 2."""
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
        card = json.loads(page.text)["data"][0]
        return str(card["id"]), card.get("max_model_len")
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        fail(f"{models_url} did not answer an OpenAI model list; --url must be the root of a running "
             "OpenAI-compatible server")


def run_command(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="Server root URL."),
    model: str | None = typer.Option(None, "--model", help="Model name to request (default: the server's first model)."),
    out: Path | None = RUN_OUT,
    baseline: Path | None = BASELINE_FILE,
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    workload: str = WORKLOAD, seed: int = SEED, vocab_size: int | None = VOCAB, max_concurrency: int | None = MAX_CONC,
    trace: Path | None = TRACE, start: int = START, limit: int = LIMIT, tokens_per_block: int = TPB,
    time_scale: float | None = TIME_SCALE, max_prompt_tokens: int | None = MAX_PROMPT, max_output_tokens: int = MAX_OUT,
    returning_only: bool = RETURNING,
    num_requests: int = NUM_REQ, prefix_len: int = PREFIX_LEN, suffix_len: int = SUFFIX_LEN,
    num_prefixes: int = NUM_PREFIXES, output_len: int = OUTPUT_LEN, request_rate: float | None = RATE,
    shuffle: bool = SHUFFLE, num_sessions: int = SESSIONS, num_rounds: int = ROUNDS, system_len: int = SYSTEM,
    question_len: int = QUESTION, answer_len: int = ANSWER, think_time: float = THINK,
    session_interval: float = INTERVAL, stall_timeout: float = STALL,
) -> None:
    from kvtier.bench.run import judge_run, load_baseline, print_run, run_once

    knobs = _knobs(kind=workload, seed=seed, trace_path=trace, start=start, limit=limit,
                   tokens_per_block=tokens_per_block, time_scale=time_scale, max_prompt_tokens=max_prompt_tokens,
                   max_output_tokens=max_output_tokens, returning_only=returning_only, num_requests=num_requests, prefix_len=prefix_len,
                   suffix_len=suffix_len, num_prefixes=num_prefixes, output_len=output_len,
                   request_rate=request_rate, shuffle=shuffle, num_sessions=num_sessions, num_rounds=num_rounds,
                   system_len=system_len, question_len=question_len, answer_len=answer_len,
                   think_time_s=think_time, session_interval_s=session_interval)
    closed_loop = max_concurrency is not None or (workload == "prefix-repetition" and request_rate is None)
    _check_offline(knobs, closed_loop, vocab_size)  # a bad option is its own error, not "cannot reach" (clifix2)
    reference = None
    if baseline is not None:
        try:
            reference = load_baseline(baseline)
        except ValueError as exc:
            fail(str(exc))
    if out is not None:
        make_output_dir(out, "--out")
    served, max_len = _served_model(url)
    model = model or served
    if max_concurrency is None and workload == "prefix-repetition" and request_rate is None:
        max_concurrency = DEFAULT_RUN_CONCURRENCY
        print(f"closed loop: at most {max_concurrency} requests in flight (--max-concurrency to change, "
              "--request-rate for an open loop)", flush=True)
    built, _ = _build(knobs, vocab_size, model, max_len, closed_loop)
    outcome = run_once(built, url, model, max_concurrency, stall_timeout, out, progress=not no_progress)
    if outcome.error is not None:
        fail(outcome.error)
    print_run(outcome, judge_run(outcome, reference))
    assert outcome.run is not None
    if outcome.run.summary().num_ok == 0:  # nothing measured: a CI job must not read this as a pass
        fail(f"no request succeeded: {outcome.run.failure_text() or 'none was sent'}")


def compare_command(
    model: str = typer.Option(..., "--model", "-m", help="Model directory (or name) every arm serves."),
    arms: str = typer.Option("baseline,native,kvtier", "--arms",
                             help="Comma-separated arms out of baseline, kvtier, kvtier-redis, kvtier-s3, native, example; run in "
                                  "this order."),
    arm: list[str] = typer.Option([], "--arm", help="Another arm, NAME='KV_TRANSFER_CONFIG_JSON' (repeatable)."),
    repeats: int = typer.Option(1, "--repeats", min=1, max=20, help="Runs per arm, interleaved (A B C A B C ...)."),
    replicas: int = typer.Option(1, "--replicas",
                                 help="vLLM servers per arm and run, all with the arm's config; request k goes to "
                                      "server k mod N (round robin, no affinity). Figures per arm and per replica."),
    redis: str | None = typer.Option(None, "--redis",
                                     help="The kvtier-redis arm's shared Redis: 'auto' (a private redis-server on "
                                          "127.0.0.1, stopped at the end) or redis://HOST:PORT/DB of a running one."),
    max_model_len: int = typer.Option(4096, "--max-model-len", min=64, help="Context length of every arm, tokens."),
    engine_cache_tokens: int = typer.Option(8192, "--engine-cache-tokens", min=1,
                                            help="Engine KV cache of every arm, tokens (at least --max-model-len)."),
    block_size: int = typer.Option(128, "--block-size", min=16, help="Engine KV block size, tokens (CPU: multiple of 32)."),
    load_format: str = typer.Option("dummy", "--load-format", help="vLLM load format; 'auto' for real weights."),
    kvtier_config: Path | None = KVTIER_CONFIG,
    max_num_batched_tokens: int | None = typer.Option(None, "--max-num-batched-tokens", min=1, help="Prefill chunk per engine step, tokens."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager",
                                       help="Pass --enforce-eager to every server (no torch.compile warm-up: starts in "
                                            "seconds instead of minutes on a CPU, same for every arm)."),
    memory_fraction: float = typer.Option(0.25, "--memory-fraction", min=0.01, max=1.0,
                                          help="vLLM --gpu-memory-utilization (CPU backend: share of RAM it may reserve)."),
    out: Path | None = COMPARE_OUT,
    json_path: Path | None = JSON_PATH,
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    workload: str = WORKLOAD, seed: int = SEED, vocab_size: int | None = VOCAB, max_concurrency: int | None = MAX_CONC,
    trace: Path | None = TRACE, start: int = START, limit: int = LIMIT, tokens_per_block: int = TPB,
    time_scale: float | None = TIME_SCALE, max_prompt_tokens: int | None = MAX_PROMPT, max_output_tokens: int = MAX_OUT,
    returning_only: bool = RETURNING,
    num_requests: int = NUM_REQ, prefix_len: int = PREFIX_LEN, suffix_len: int = SUFFIX_LEN,
    num_prefixes: int = NUM_PREFIXES, output_len: int = OUTPUT_LEN, request_rate: float | None = RATE,
    shuffle: bool = SHUFFLE, num_sessions: int = SESSIONS, num_rounds: int = ROUNDS, system_len: int = SYSTEM,
    question_len: int = QUESTION, answer_len: int = ANSWER, think_time: float = THINK,
    session_interval: float = INTERVAL, stall_timeout: float = STALL,
) -> None:
    import importlib.util
    import time

    from kvtier.bench.arms import ARM_NAMES, make_arm, parse_custom_arm, shared_tier_conflict
    from kvtier.bench.compare import run_compare, warmup_workload
    from kvtier.bench.report import print_table, write_reports
    from kvtier.bench.workload import vocab_token_space
    from kvtier.launch.serve import ServerSpec

    names = [a.strip() for a in arms.split(",") if a.strip()]
    unknown = [a for a in names if a not in ARM_NAMES]
    if unknown or len(set(names)) != len(names):
        fail(f"--arms {arms!r} must list distinct arms out of {', '.join(ARM_NAMES)}")
    if replicas < 1:
        fail(f"--replicas {replicas} must be at least 1 (the number of vLLM servers each arm runs side by side)")
    cores = os.cpu_count() or 1
    if replicas > cores:  # every replica is a whole vLLM server, started at once
        fail(f"--replicas {replicas} is more than the {cores} CPU cores of this host, which run every replica's "
             f"vLLM server at once; use at most {cores}")
    if replicas * memory_fraction > MAX_RAM_SHARE:  # the CPU backend reserves its share of RAM per server
        fail(f"--replicas {replicas} x --memory-fraction {memory_fraction:g} would reserve "
             f"{replicas * memory_fraction:.0%} of this host's RAM at once; keep the product at most "
             f"{MAX_RAM_SHARE:g} (lower --memory-fraction or --replicas)")
    if ("kvtier-redis" in names) != (redis is not None):
        fail("the kvtier-redis arm needs --redis auto (or --redis redis://HOST:PORT/DB)" if redis is None else
             "--redis is used by the kvtier-redis arm only; add kvtier-redis to --arms")
    try:
        custom = [parse_custom_arm(text) for text in arm]
    except ValueError as exc:
        fail(str(exc))
    all_names = names + [c.name for c in custom]
    if not all_names or len(set(all_names)) != len(all_names):
        fail("give at least one arm (--arms or --arm), each name once")
    if engine_cache_tokens < max_model_len:
        fail(f"--engine-cache-tokens {engine_cache_tokens} is below --max-model-len {max_model_len}; vLLM needs room "
             "for one full-length request, so raise it or lower --max-model-len")
    if importlib.util.find_spec("vllm") is None:
        fail("vLLM is not installed in this environment; run `make install` first")
    if "kvtier-s3" in names and importlib.util.find_spec("obstore") is None:
        fail("the kvtier-s3 arm's servers need obstore, the s3 tier's client; run `make install` or "
             "pip install 'kvtier[s3]'")
    extra: dict[str, Any] | None = None
    if kvtier_config is not None:
        from kvtier.core.config import KVTierConfig
        from kvtier.core.errors import ConfigError

        try:  # validated once here; the arm passes on only the keys the file set
            extra = KVTierConfig.from_yaml(kvtier_config).flat_dict(exclude_unset=True)
        except (ConfigError, OSError) as exc:
            fail(f"--kvtier-config {kvtier_config}: {exc}")
    for name in names:
        if (why := shared_tier_conflict(name, extra)) is not None:
            fail(why)
    _check_tier_memory(names, extra, replicas, memory_fraction)
    knobs = _knobs(kind=workload, seed=seed, trace_path=trace, start=start, limit=limit,
                   tokens_per_block=tokens_per_block, time_scale=time_scale, max_prompt_tokens=max_prompt_tokens,
                   max_output_tokens=max_output_tokens, returning_only=returning_only, num_requests=num_requests, prefix_len=prefix_len,
                   suffix_len=suffix_len, num_prefixes=num_prefixes, output_len=output_len,
                   request_rate=request_rate, shuffle=shuffle, num_sessions=num_sessions, num_rounds=num_rounds,
                   system_len=system_len, question_len=question_len, answer_len=answer_len,
                   think_time_s=think_time, session_interval_s=session_interval)
    _check_offline(knobs, max_concurrency is not None, vocab_size)  # a bad workload option leaves no empty --out
    out = out or Path(".kvtier/bench") / time.strftime("compare-%Y%m%d-%H%M%S")
    check_output_path(json_path, "--json")  # before any server starts: a bad path fails in one line, not after minutes
    make_output_dir(out, "--out")
    _check_local_model(model)
    built, vocab = _build(knobs, vocab_size, model, max_model_len, max_concurrency is not None)
    spec = ServerSpec(model=model, max_model_len=max_model_len, cache_tokens=engine_cache_tokens,
                      block_size=block_size, load_format=None if load_format == "auto" else load_format,
                      memory_fraction=memory_fraction, max_num_batched_tokens=max_num_batched_tokens,
                      enforce_eager=enforce_eager)
    with _shared_redis(redis, out) as redis_url, _shared_s3("kvtier-s3" in names, out) as s3_target:
        s3_config = s3_target.extra_config() if s3_target is not None else None
        arm_specs = [make_arm(n, out, extra, redis_url, s3_config) for n in names] + custom
        servers = f"{replicas} vLLM servers" if replicas > 1 else "vLLM"
        result = run_compare(arm_specs, built, spec, out, warmup=warmup_workload(vocab_token_space(seed, vocab)),
                             max_concurrency=max_concurrency, stall_timeout_s=stall_timeout, progress=not no_progress,
                             repeats=repeats, replicas=replicas, s3_target=s3_target, on_arm=lambda a, k: print(
                                 f"arm {a.name} (run {k + 1}/{repeats}): starting {servers} ({a.description})",
                                 flush=True))
    print_table(result)
    paths = write_reports(result, out, json_path, command=shlex.join(["kvtier", *sys.argv[1:]]))
    print(f"report: {paths.markdown}")
    if paths.plot is not None:
        print(f"TTFT CDF: {paths.plot}")
    if paths.json is not None:
        print(f"JSON: {paths.json}")
    if all(o.failure is not None for o in result.outcomes):
        first = result.outcomes[0]
        assert first.failure is not None
        fail(f"every arm failed (the first, {first.arm.name}: {first.failure.reason}); see the server logs under {out}")


@contextlib.contextmanager
def _shared_redis(redis: str | None, out: Path) -> Iterator[str | None]:
    """The kvtier-redis arm's server URL: ``None`` without ``--redis``; a private redis-server under
    ``out`` for ``auto`` (stopped on exit); else the given URL once it answered ``PING``."""
    from kvtier.bench.shared_redis import LocalRedis, check_redis_url
    from kvtier.core.errors import ServerStartError

    if redis is None:
        yield None
        return
    if redis != "auto":
        try:
            check_redis_url(redis)
        except ValueError as exc:
            fail(str(exc))
        yield redis
        return
    try:
        server = LocalRedis.start(out / "redis")
    except ServerStartError as exc:
        fail(str(exc))
    print(f"--redis auto: redis-server on {server.url} (log {server.log_path})", flush=True)
    with server:
        yield server.url


@contextlib.contextmanager
def _shared_s3(wanted: bool, out: Path) -> Iterator[Any]:
    """The kvtier-s3 arm's bucket (:class:`kvtier.bench.shared_s3.S3Target`): ``None`` unless
    ``wanted``; else a private ``rclone serve s3`` under ``out/s3``, stopped on exit."""
    from kvtier.bench.shared_s3 import LocalS3
    from kvtier.core.errors import ServerStartError

    if not wanted:
        yield None
        return
    try:
        server = LocalS3.start(out / "s3")
    except ServerStartError as exc:
        fail(str(exc))
    print(f"kvtier-s3: rclone serve s3 on {server.target.endpoint_url}, bucket {server.target.bucket} "
          f"(log {server.log_path})", flush=True)
    with server:
        yield server.target


TIER_ARMS = ("kvtier", "kvtier-redis", "kvtier-s3", "native")
"""Arms whose every server holds a cpu tier of ``cpu_gib`` (kvtier's, or vLLM's native one sized like it)."""


def _check_tier_memory(names: list[str], extra: dict[str, Any] | None, replicas: int, memory_fraction: float) -> None:
    """Fail (exit 2) when one arm's servers together would hold more than MAX_RAM_SHARE of this
    host's RAM: per server ``--memory-fraction`` of RAM plus its cpu tier (vLLM's native tier
    zero-fills all of it at start, vllm/v1/kv_offload/cpu/gpu_worker.py; kvtier's fills as it is used)."""
    from kvtier.core.config import KVTierConfig

    if not any(n in TIER_ARMS for n in names):
        return
    try:
        ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError):  # not every platform tells
        return
    cpu_gib = float((extra or {}).get("cpu_gib", KVTierConfig().cpu_gib))
    need = replicas * (memory_fraction * ram_gib + cpu_gib)
    if need > MAX_RAM_SHARE * ram_gib:
        fail(f"--replicas {replicas} x (--memory-fraction {memory_fraction:g} of RAM + a {cpu_gib:g} GiB cpu tier) "
             f"would hold {need:.1f} GiB of this host's {ram_gib:.1f} GiB RAM at once (at most {MAX_RAM_SHARE:.0%}); "
             "lower cpu_gib in --kvtier-config, --memory-fraction or --replicas")


def register(app: typer.Typer) -> None:
    """Add ``kvtier bench run`` and ``kvtier bench compare`` to the CLI."""
    bench = typer.Typer(help="Replay traffic against vLLM and tell whether the cache is helping.",
                        no_args_is_help=True)
    bench.command("run", help=RUN_HELP)(run_command)
    bench.command("compare", help=COMPARE_HELP)(compare_command)
    app.add_typer(bench, name="bench")
