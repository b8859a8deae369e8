"""``kvtier bench compare``: one vLLM server per arm and run, the same workload sent to each, the
arms side by side; with the checks of its arms, replicas and memory, and the shared Redis and S3
servers it starts for the kvtier-redis, kvtier-s3 and kvtier-node arms."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

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
from kvtier.cli.outputs import FORCE_HELP, check_new_files, make_report_dir

COMPARE_HELP = """Start one vLLM server per arm and run, and send each the same workload.

Arms: baseline (no connector), kvtier (KVTierConnector, default config or --kvtier-config), kvtier-redis (the kvtier arm plus the shared redis tier on the server --redis names or, with --redis auto, starts on 127.0.0.1; every run under a key prefix of its own, deleted afterwards), kvtier-s3 (the kvtier arm plus the shared s3 tier on a private rclone serve s3 the command starts on 127.0.0.1 under --out, one bucket for all replicas, every run under a key prefix of its own, removed afterwards; needs rclone and obstore: make install), kvtier-node (the kvtier arm plus the node tier: one kvtier node serve owner per run, its pool of --node-gib GiB in /dev/shm shared by all replicas, stopped and its pool deleted after the run, its log <arm>[-run<k>].node.log in --out), native (vLLM's OffloadingConnector with a CPU tier the size of kvtier's, one per server; on a CPU-only vLLM through kvtier.bench.native_cpu, a benchmark-only shim that swaps the CUDA copy kernel for host copies), example (vLLM's ExampleConnector), and any connector given as --arm NAME='KV_TRANSFER_CONFIG_JSON'. Same model, engine cache size (--engine-cache-tokens), core pinning and workload for every arm. With --repeats N the arms run interleaved (A B C A B C ...) and every figure is the median of N runs with its range; "helping" needs TTFT p50 ranges that do not overlap. Prints one table (hit rates, TTFT p50/p99, throughput, ratios to baseline, verdict) and writes report.md, ttft_cdf.png, per-run server logs and /metrics texts to --out; --json writes the figures as JSON. An arm whose engine dies or hangs is reported with the request where it happened and its log; the other arms still run. With --replicas N every arm runs N servers side by side and request k goes to server k mod N (a round-robin load balancer without affinity); the table's figures are per arm (hit-rate counters summed over its servers, TTFTs over every request) and a second table gives each replica's. Each replica has its own cpu tier (kvtier's or native's) and its own disk_path directory (<disk_path>/run-<k>/r<i>); the replicas of kvtier-redis, kvtier-s3 and kvtier-node share the Redis server, the bucket or the node pool. With --restart-replica-at F every run of every arm restarts replica 0 once a share F of the requests was sent, as an operator restarts it: no new request goes to it (its turns go round robin to the live replicas), its requests in flight finish, it gets SIGTERM (graceful stop) and the same server starts again on the same port, taking requests once it answers; a third table gives, per arm, how long it took no requests and the hit rate and TTFT of its requests after the restart (a cpu tier is lost on restart; kvtier's disk, redis and node tiers are not). Every kvtier server logs its request receipts to its own <arm>[-run<k>][-r<i>].receipts.jsonl in --out; per kvtier arm and run, the receipts' tokens per tier and miss reasons are shown beside the metric deltas, with any disagreement named.

Examples:

  kvtier bench compare --model models/mid --max-model-len 4096 --engine-cache-tokens 8192 --workload prefix-repetition --prefix-len 4000 --suffix-len 0 --num-prefixes 3 --num-requests 6 --output-len 1 --max-concurrency 1 --repeats 3

  kvtier bench compare --model models/mid --arms baseline,kvtier,kvtier-redis --replicas 2 --redis auto --kvtier-config cpu.yaml --max-model-len 2048 --engine-cache-tokens 4096 --enforce-eager --workload trace --start 0 --limit 300 --returning-only --sent-tokens-per-block 32 --max-output-tokens 2 --max-concurrency 2 --repeats 2

  kvtier bench compare --model models/mid --arms native,kvtier-redis,kvtier-s3 --replicas 2 --redis auto --kvtier-config cpu.yaml --max-model-len 2048 --engine-cache-tokens 4096 --enforce-eager --workload trace --start 0 --limit 300 --returning-only --sent-tokens-per-block 32 --max-output-tokens 2 --max-concurrency 2 --repeats 2

  kvtier bench compare --model models/small8 --arms native,kvtier-redis,kvtier-node --replicas 2 --redis auto --node-gib 1 --kvtier-config cpu.yaml --max-model-len 2048 --engine-cache-tokens 4096 --enforce-eager --workload trace --start 0 --limit 300 --returning-only --sent-tokens-per-block 32 --max-output-tokens 2 --max-concurrency 2 --repeats 2

  kvtier bench compare --model models/small8 --arms native,kvtier-redis,kvtier-node --replicas 2 --restart-replica-at 0.2 --redis auto --node-gib 1 --kvtier-config cpu.yaml --max-model-len 2048 --engine-cache-tokens 4096 --enforce-eager --workload trace --start 0 --limit 600 --returning-only --sent-tokens-per-block 32 --max-output-tokens 2 --max-concurrency 2 --repeats 3

  kvtier bench compare --model models/tiny --arms baseline,kvtier --arm lmcache='{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}' --workload trace --start 0 --limit 300 --max-concurrency 2 --json out.json
"""

KVTIER_CONFIG = typer.Option(None, "--kvtier-config", help="YAML of kvtier settings for the kvtier arm.")
COMPARE_OUT = typer.Option(None, "--out", help="Report directory (default .kvtier/bench/compare-<time>); one that "
                           "already holds files is refused without --force.")
JSON_PATH = typer.Option(None, "--json", help="Write the figures as JSON here (an existing file is refused without "
                         "--force).")
FORCE = typer.Option(False, "--force", help=FORCE_HELP)


def _check_local_model(model: str, max_model_len: int) -> None:
    """Refuse (exit 2, one sentence) a ``--model`` written as a local path that names no model
    directory: vLLM reads a path that exists as the model's directory and anything else as a hub id,
    so a mistyped ``/models/llama`` reached vLLM (after "cannot tell the vocabulary size", or with
    --vocab-size, a server that fails once started).  A hub id (``Qwen/Qwen3-8B``) is left to vLLM.
    So is a ``--max-model-len`` longer than a local model's context window, which every arm's server
    refused after its start-up (:func:`kvtier.size.context.max_context`)."""
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
    from kvtier.size.context import ALLOW_LONG, long_allowed, max_context

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # vLLM names what is wrong with it
    window = max_context(config) if isinstance(config, dict) else None
    if window is not None and max_model_len > window[0] and not long_allowed():  # the arms inherit it
        fail(f"--max-model-len {max_model_len} is longer than {model}'s context window, {window[0]} tokens "
             f"({window[1]} in its config.json): every arm's vLLM server would refuse it at start-up; give "
             f"--max-model-len {window[0]} or less (or set {ALLOW_LONG}=1, if you mean to)")


MAX_RAM_SHARE = 0.9
"""Share of RAM all replicas of one arm may reserve together (``--replicas`` x ``--memory-fraction``):
the rest is for kvtier's own tiers, the client and the OS."""


def compare_command(
    model: str = typer.Option(..., "--model", "-m", help="Model directory (or name) every arm serves."),
    arms: str = typer.Option("baseline,native,kvtier", "--arms",
                             help="Comma-separated arms out of baseline, kvtier, kvtier-redis, kvtier-s3, kvtier-node, native, example; "
                                  "run in "
                                  "this order."),
    arm: list[str] = typer.Option([], "--arm", help="Another arm, NAME='KV_TRANSFER_CONFIG_JSON' (repeatable)."),
    repeats: int = typer.Option(1, "--repeats", min=1, max=20, help="Runs per arm, interleaved (A B C A B C ...)."),
    replicas: int = typer.Option(1, "--replicas",
                                 help="vLLM servers per arm and run, all with the arm's config; request k goes to "
                                      "server k mod N (round robin, no affinity). Figures per arm and per replica."),
    restart_replica_at: float | None = typer.Option(
        None, "--restart-replica-at",
        help="Restart replica 0 once this share of the workload's requests was sent (between 0 and 1), in every "
             "arm and run: SIGTERM after its requests in flight finished, the same server started again; its "
             "turns go to the live replicas meanwhile. Needs --replicas 2 or more."),
    redis: str | None = typer.Option(None, "--redis",
                                     help="The kvtier-redis arm's shared Redis: 'auto' (a private redis-server on "
                                          "127.0.0.1, stopped at the end) or redis://HOST:PORT/DB of a running one."),
    node_gib: float | None = typer.Option(None, "--node-gib", min=0.001, max=1 << 20,
                                          help="The kvtier-node arm's pool in /dev/shm, GiB (default: node_gib of "
                                               "--kvtier-config, else 1)."),
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
    force: bool = FORCE,
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
) -> None:
    import importlib.util
    import time

    from kvtier.bench.arms import ARM_NAMES, make_arm, parse_custom_arm, shared_tier_conflict
    from kvtier.bench.compare import run_compare, warmup_workload
    from kvtier.bench.report import print_table, write_reports
    from kvtier.bench.restart import RestartPlan, check_restart
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
    if restart_replica_at is not None:
        try:
            check_restart(restart_replica_at, replicas)
        except ValueError as exc:
            fail(str(exc))
    if ("kvtier-redis" in names) != (redis is not None):
        fail("the kvtier-redis arm needs --redis auto (or --redis redis://HOST:PORT/DB)" if redis is None else
             "--redis is used by the kvtier-redis arm only; add kvtier-redis to --arms")
    if node_gib is not None and "kvtier-node" not in names:
        fail("--node-gib sizes the kvtier-node arm's pool only; add kvtier-node to --arms")
    if kvtier_config is not None and not any(n in TIER_ARMS for n in names):
        fail("--kvtier-config configures the kvtier arms (and the native arm's cpu_gib) only; add kvtier, "
             "kvtier-redis, kvtier-s3, kvtier-node or native to --arms, or drop it")
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
    check_input_files([("--kvtier-config", kvtier_config)])
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
    pool_gib = _node_pool_gib(names, node_gib, extra)
    _check_tier_memory(names, extra, replicas, memory_fraction, pool_gib)
    knobs = workload_knobs(
        old_tokens_per_block, kind=workload, seed=seed, trace_path=trace, start=start, limit=limit, tokens_per_block=tokens_per_block,
        time_scale=time_scale, max_prompt_tokens=max_prompt_tokens, max_output_tokens=max_output_tokens,
        returning_only=returning_only, num_requests=num_requests, prefix_len=prefix_len, suffix_len=suffix_len,
        num_prefixes=num_prefixes, output_len=output_len, request_rate=request_rate, shuffle=shuffle,
        num_sessions=num_sessions, num_rounds=num_rounds, system_len=system_len, question_len=question_len,
        answer_len=answer_len, think_time_s=think_time, session_interval_s=session_interval)
    check_workload(knobs, max_concurrency is not None, vocab_size)  # a bad workload option leaves no empty --out
    out = out or Path(".kvtier/bench") / time.strftime("compare-%Y%m%d-%H%M%S")
    inputs = [("--trace", trace), ("--kvtier-config", kvtier_config)]
    check_new_files([("--json", json_path)], force, inputs)  # before any server starts: one line, not after minutes
    make_report_dir(out, "--out", force, None, inputs)
    _check_local_model(model, max_model_len)
    built, vocab = make_workload(knobs, vocab_size, model, max_model_len, max_concurrency is not None)
    plan = None
    if restart_replica_at is not None:
        try:
            plan = RestartPlan.at_fraction(restart_replica_at, len(built.requests))
        except ValueError as exc:
            fail(str(exc))
    spec = ServerSpec(model=model, max_model_len=max_model_len, cache_tokens=engine_cache_tokens,
                      block_size=block_size, load_format=None if load_format == "auto" else load_format,
                      memory_fraction=memory_fraction, max_num_batched_tokens=max_num_batched_tokens,
                      enforce_eager=enforce_eager)
    with (_shared_redis(redis, out) as redis_url, _shared_s3("kvtier-s3" in names, out) as s3_target,
          _node_pool(pool_gib) as node_pool):
        s3_config = s3_target.extra_config() if s3_target is not None else None
        node_config = node_pool.extra_config() if node_pool is not None else None
        arm_specs = [make_arm(n, out, extra, redis_url, s3_config, node_config) for n in names] + custom
        servers = f"{replicas} vLLM servers" if replicas > 1 else "vLLM"
        result = run_compare(arm_specs, built, spec, out, warmup=warmup_workload(vocab_token_space(seed, vocab)),
                             max_concurrency=max_concurrency, stall_timeout_s=stall_timeout, progress=not no_progress,
                             repeats=repeats, replicas=replicas, s3_target=s3_target, node_pool=node_pool,
                             restart=plan, on_arm=lambda a, k: print(
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


def _node_pool_gib(names: list[str], node_gib: float | None, extra: dict[str, Any] | None) -> float | None:
    """The kvtier-node arm's pool size (``None`` without the arm): ``--node-gib``, else the
    config's ``node_gib``, else :data:`~kvtier.bench.shared_node.DEFAULT_NODE_GIB`; fails (exit 2)
    when ``/dev/shm`` has not that much free (the owner reserves all of it at start)."""
    from kvtier.bench.shared_node import DEFAULT_NODE_GIB, POOL_ROOT

    if "kvtier-node" not in names:
        return None
    gib = node_gib or float((extra or {}).get("node_gib") or 0) or DEFAULT_NODE_GIB
    try:
        stats = os.statvfs(POOL_ROOT)
    except OSError:
        fail(f"the kvtier-node arm puts its pool in {POOL_ROOT}, which this host lacks; run it on Linux")
    free_gib = stats.f_bavail * stats.f_frsize / (1 << 30)
    if gib > free_gib:
        fail(f"the kvtier-node arm's pool of {gib:g} GiB does not fit in {POOL_ROOT} ({free_gib:.1f} GiB free); "
             "lower --node-gib (or node_gib in --kvtier-config) or free shared memory")
    return gib


@contextlib.contextmanager
def _node_pool(gib: float | None) -> Iterator[Any]:
    """The kvtier-node arm's pool (:class:`kvtier.bench.shared_node.NodePool`): ``None`` unless
    ``gib``; else a private directory under /dev/shm, removed on exit (each run starts its owner)."""
    from kvtier.bench.shared_node import NodePool
    from kvtier.core.errors import ServerStartError

    if gib is None:
        yield None
        return
    try:
        pool = NodePool.make(gib)
    except ServerStartError as exc:
        fail(str(exc))
    print(f"kvtier-node: a {gib:g} GiB pool per run in {pool.dir} (socket {pool.socket})", flush=True)
    try:
        yield pool
    finally:
        pool.remove()


TIER_ARMS = ("kvtier", "kvtier-redis", "kvtier-s3", "kvtier-node", "native")
"""Arms whose every server holds a cpu tier of ``cpu_gib`` (kvtier's, or vLLM's native one sized like it)."""


def _check_tier_memory(names: list[str], extra: dict[str, Any] | None, replicas: int, memory_fraction: float,
                       pool_gib: float | None = None) -> None:
    """Fail (exit 2) when one arm's servers together would hold more than MAX_RAM_SHARE of this
    host's RAM: per server ``--memory-fraction`` of RAM plus its cpu tier (vLLM's native tier
    zero-fills all of it at start, vllm/v1/kv_offload/cpu/gpu_worker.py; kvtier's fills as it is used),
    plus, for the kvtier-node arm, its pool once (``pool_gib``, reserved at the owner's start)."""
    from kvtier.core.config import KVTierConfig

    if not any(n in TIER_ARMS for n in names):
        return
    try:
        ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError):  # not every platform tells
        return
    cpu_gib = float((extra or {}).get("cpu_gib", KVTierConfig().cpu_gib))
    need = replicas * (memory_fraction * ram_gib + cpu_gib) + (pool_gib or 0.0)
    if need > MAX_RAM_SHARE * ram_gib:
        pool = f" + a {pool_gib:g} GiB node pool" if pool_gib else ""
        fail(f"--replicas {replicas} x (--memory-fraction {memory_fraction:g} of RAM + a {cpu_gib:g} GiB cpu tier)"
             f"{pool} would hold {need:.1f} GiB of this host's {ram_gib:.1f} GiB RAM at once (at most {MAX_RAM_SHARE:.0%}); "
             "lower cpu_gib in --kvtier-config, --memory-fraction or --replicas")

