"""What ``make demo`` (``kvtier demo``) runs, on the 24-layer ``mid`` test geometry where a prefill
costs seconds (:mod:`kvtier.launch.testmodel`, dummy weights: nothing is downloaded).

1. Restart (:func:`run_restart_demo`): ``vllm serve`` with KVTierConnector (cpu + disk tiers)
   answers a few long prompts cold, is stopped with SIGTERM (graceful: ``--shutdown-timeout``, so
   the connector's shutdown path runs), and a fresh server on the same disk tier answers the same
   prompts: TTFT of both runs, tokens loaded from kvtier, generated text compared.
2. Comparison (:func:`run_demo_compare`): ``kvtier bench compare`` of ``baseline`` (no connector),
   ``native`` (vLLM's OffloadingConnector, CPU tier, through the benchmark-only CPU shim
   :mod:`kvtier.bench.native_cpu`) and ``kvtier`` on a prefix-repetition workload: 3 prompts of
   1,028 tokens sent round robin to an engine cache that holds one, so every repeat is recomputed
   by the baseline and loaded by the connectors.  Runs interleaved over ``DEMO_REPEATS``.

Every server runs with ``--enforce-eager``: torch.compile's warm-up of the 24-layer model takes
minutes on 2 cores and is redone for every new connector configuration, eager mode starts in
seconds; every arm is treated the same.  Every figure is printed with its sample count and range; "faster" is said only when the ranges do
not overlap (:mod:`kvtier.bench.spread`).  Measured figures: docs/benchmarks.md.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.arms import make_arm
from kvtier.bench.compare import CompareResult, run_compare, warmup_workload
from kvtier.bench.factory import WorkloadKnobs, build_workload, model_vocab_size
from kvtier.bench.meters import MetricsError, scrape
from kvtier.bench.report import ReportPaths, print_table, write_reports
from kvtier.bench.spread import Spread
from kvtier.bench.workload import vocab_token_space
from kvtier.launch.serve import Server, ServerSpec, transfer_config

DEMO_GEOMETRY = "mid"
DEMO_PROMPT_TOKENS = 1028
"""Prompt length: 4 whole 256-token chunks (8 blocks of 128) + 4 tokens computed on a hit."""
DEMO_MAX_MODEL_LEN = 1280
DEMO_CACHE_TOKENS = 1280
"""Engine cache (10 blocks): one prompt fits, so a round robin over 3 prompts evicts each before it
returns."""
DEMO_KNOBS = WorkloadKnobs(kind="prefix-repetition", seed=0, num_requests=9, prefix_len=DEMO_PROMPT_TOKENS,
                           suffix_len=0, num_prefixes=3, output_len=2)
DEMO_ARMS = ("baseline", "native", "kvtier")
DEMO_REPEATS = 2
DEMO_CONCURRENCY = 1
RESTART_PROMPTS = 3
RESTART_OUTPUT_TOKENS = 8


def demo_kvtier_config(disk: Path) -> dict[str, object]:
    """kvtier's settings in the demo: 0.5 GiB cpu tier, 2 GiB disk tier under ``disk``, the rest
    kvtier's defaults."""
    return {"cpu_gib": 0.5, "disk_path": str(disk), "disk_gib": 2.0}


def demo_model(workdir: Path) -> Path:
    """The mid test model (config and tokenizer only; served with ``--load-format dummy``)."""
    from kvtier.launch.testmodel import write_model

    return write_model(workdir / "models" / DEMO_GEOMETRY, DEMO_GEOMETRY, weights="none")


# ---- 1. restart ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RestartRun:
    """One server's answers to the restart prompts.

    Attributes:
        ttfts_s: TTFT of each prompt, seconds; texts: what each generated (greedy).
        external_hit_tokens: ``vllm:external_prefix_cache_hits`` (tokens the connector supplied).
        prompt_tokens: tokens of the measured prompts.
    """

    ttfts_s: tuple[float, ...]
    texts: tuple[str, ...]
    external_hit_tokens: float
    prompt_tokens: int

    @property
    def ttft(self) -> Spread:
        """Median and range of the TTFTs."""
        spread = Spread.of(self.ttfts_s)
        assert spread is not None
        return spread


@dataclass(frozen=True)
class RestartDemoResult:
    """Both runs of :func:`run_restart_demo` and the first server's command line."""

    first: RestartRun
    second: RestartRun
    command: list[str]

    @property
    def ttft_ratio(self) -> float:
        """Median TTFT after the restart / median TTFT cold."""
        return self.second.ttft.median / self.first.ttft.median

    @property
    def beyond_noise(self) -> bool:
        """Every TTFT after the restart is below every cold TTFT."""
        return self.second.ttft.high < self.first.ttft.low


def restart_spec(model: Path, kvtier: dict[str, object]) -> ServerSpec:
    """The restart demo's server (both runs): KVTierConnector; the model's own weights when its
    directory has safetensors, else dummy weights."""
    from kvtier.size.recipe import WORKER_SHUTDOWN_TIMEOUT_S

    load_format = None if any(model.glob("*.safetensors")) else "dummy"
    # vLLM waits VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 by default) for a worker before it SIGTERMs it:
    # the flush of the SIGTERM the demo shows may take shutdown_flush_s (30) + 5 (docs/vllm.md)
    return ServerSpec(model=str(model), max_model_len=DEMO_MAX_MODEL_LEN, cache_tokens=4 * DEMO_MAX_MODEL_LEN,
                      load_format=load_format, kv_transfer_config=transfer_config(kvtier), enforce_eager=True,
                      shutdown_timeout_s=60,
                      env={"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": str(WORKER_SHUTDOWN_TIMEOUT_S)})


def restart_command(spec: ServerSpec, port: int = 8000) -> list[str]:
    """The restart server's command line as the demo prints it: the variables it adds to the server's
    environment (``K=V`` words), then its arguments, so the printed line runs the same server."""
    return [*(f"{k}={v}" for k, v in spec.environment().items()), *spec.argv(port)]


def _restart_run(spec: ServerSpec, log: Path, prompts: list[list[int]], warmup: list[int],
                 timeout_s: float) -> RestartRun:
    with Server(spec, log) as server:
        server.start(timeout_s)
        server.complete(warmup, max_tokens=2)  # first-request warm-up (kernels) stays out of the TTFT
        try:
            before = scrape(server.base_url).total("vllm:external_prefix_cache_hits")
        except MetricsError:
            before = 0.0
        runs = [server.complete(p, max_tokens=RESTART_OUTPUT_TOKENS) for p in prompts]
        try:
            hits = scrape(server.base_url).total("vllm:external_prefix_cache_hits") - before
        except MetricsError:
            hits = float("nan")
    return RestartRun(tuple(t for t, _ in runs), tuple(x for _, x in runs), hits, sum(len(p) for p in prompts))


def run_restart_demo(workdir: Path = Path(".kvtier"), timeout_s: float = 900.0,
                     num_prompts: int = RESTART_PROMPTS, prompt_tokens: int = DEMO_PROMPT_TOKENS,
                     model: Path | None = None) -> RestartDemoResult:
    """Serve prompts cold, stop the server with SIGTERM, serve them again from a fresh server.

    Files: the model under ``workdir/models``, the disk tier ``workdir/demo-disk`` (emptied first
    so the first run is cold), logs ``workdir/logs/demo-{first,second}.log``.

    Raises:
        ServerStartError: a server failed to start (the message names its log).
        ServerAnswerError: a request failed or did not end in time.
    """
    model = model or demo_model(workdir)
    disk = workdir / "demo-disk"
    shutil.rmtree(disk, ignore_errors=True)
    spec = restart_spec(model, demo_kvtier_config(disk))
    vocab = model_vocab_size(str(model)) or 2048
    tokens = vocab_token_space(7, vocab)
    prompts = [list(tokens.block(1, (i,), prompt_tokens)) for i in range(num_prompts)]
    warmup = list(tokens.block(2, (0,), 32))
    first = _restart_run(spec, workdir / "logs" / "demo-first.log", prompts, warmup, timeout_s)
    second = _restart_run(spec, workdir / "logs" / "demo-second.log", prompts, warmup, timeout_s)
    return RestartDemoResult(first, second, restart_command(spec))


def restart_verdict(result: RestartDemoResult) -> str:
    """One sentence whose wording matches the numbers (see :attr:`RestartDemoResult.beyond_noise`)."""
    a, b = result.first.ttft, result.second.ttft
    same = result.first.texts == result.second.texts
    figures = (f"TTFT median {a.median * 1000:.0f} ms cold (range {a.low * 1000:.0f}-{a.high * 1000:.0f}, n={a.n}) "
               f"-> {b.median * 1000:.0f} ms after the restart (range {b.low * 1000:.0f}-{b.high * 1000:.0f}, "
               f"n={b.n}), ratio {result.ttft_ratio:.2f}")
    if result.second.external_hit_tokens <= 0:
        how = "NOT served from disk: the restarted server found nothing in kvtier"
    elif result.beyond_noise:
        how = "faster: every prompt after the restart beat every cold one"
    else:
        how = "not faster beyond noise: the two ranges overlap"
    return (f"{figures}; {how}; {result.second.external_hit_tokens:.0f} of {result.second.prompt_tokens} prompt "
            f"tokens loaded from kvtier; generated text identical: {same}")


# ---- 2. comparison ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoCompare:
    """What :func:`run_demo_compare` produced: the comparison, its files and the seconds it took."""

    result: CompareResult
    paths: ReportPaths
    seconds: float
    command: str

    def ttft_ratio(self, arm: str = "kvtier") -> float | None:
        """TTFT p50 of ``arm`` / the baseline's (medians over runs); ``None`` if either failed."""
        a, base = self.result.arm_result(arm), self.result.arm_result("baseline")
        if a is None or base is None or not a.ok or not base.ok:
            return None
        p50, ref = a.spreads().get("ttft_p50_s"), base.spreads().get("ttft_p50_s")
        return p50.median / ref.median if p50 and ref and ref.median > 0 else None


def demo_command(out_dir: Path, model: Path, repeats: int) -> str:
    """The ``kvtier bench compare`` command line equivalent to the demo (printed and in the report)."""
    k = DEMO_KNOBS
    return (f"kvtier bench compare --model {model} --arms {','.join(DEMO_ARMS)} --max-model-len {DEMO_MAX_MODEL_LEN} "
            f"--engine-cache-tokens {DEMO_CACHE_TOKENS} --workload prefix-repetition --prefix-len {k.prefix_len} "
            f"--suffix-len 0 --num-prefixes {k.num_prefixes} --num-requests {k.num_requests} --output-len "
            f"{k.output_len} --max-concurrency {DEMO_CONCURRENCY} --repeats {repeats} --enforce-eager "
            f"--kvtier-config <cpu_gib 0.5, disk_gib 2, disk_path {out_dir}/kvtier-disk> --out {out_dir}")


def run_demo_compare(workdir: Path = Path(".kvtier"), arms: tuple[str, ...] = DEMO_ARMS,
                     repeats: int = DEMO_REPEATS, progress: bool = True, model: Path | None = None) -> DemoCompare:
    """Run every arm on the demo workload, interleaved over ``repeats``; write the reports under
    ``workdir/bench-demo`` (emptied first).  Never raises for a failing arm (it is in the result).

    Raises:
        ValueError: an unknown arm name.
        RuntimeError: the model has no vocabulary size.
    """
    t0 = time.perf_counter()
    model = model or demo_model(workdir)
    out = workdir / "bench-demo"
    shutil.rmtree(out, ignore_errors=True)
    vocab = model_vocab_size(str(model))
    if vocab is None:
        raise RuntimeError(f"the test model at {model} has no vocab_size in its config.json")
    workload = build_workload(DEMO_KNOBS, vocab, DEMO_MAX_MODEL_LEN, closed_loop=True)
    kvtier = demo_kvtier_config(out / "kvtier-disk")
    spec = ServerSpec(model=str(model), max_model_len=DEMO_MAX_MODEL_LEN, cache_tokens=DEMO_CACHE_TOKENS,
                      enforce_eager=True)
    command = demo_command(out, model, repeats)
    result = run_compare([make_arm(a, out, kvtier) for a in arms], workload, spec, out,
                         warmup=warmup_workload(vocab_token_space(DEMO_KNOBS.seed, vocab)),
                         max_concurrency=DEMO_CONCURRENCY, stall_timeout_s=300.0, progress=progress,
                         repeats=repeats, on_arm=lambda a, k: print(
                             f"run {k + 1}/{repeats}, arm {a.name}: starting vLLM ({a.description})", flush=True))
    paths = write_reports(result, out, out / "compare.json", command=command)
    return DemoCompare(result=result, paths=paths, seconds=time.perf_counter() - t0, command=command)


def print_demo_compare(demo: DemoCompare) -> None:
    """Print the table, the verdicts, the kvtier/baseline and kvtier/native ratios and the files."""
    w = demo.result.workload
    print(f"workload: {len(w.requests)} requests, {DEMO_KNOBS.num_prefixes} prompts of {DEMO_PROMPT_TOKENS} tokens "
          f"round robin, engine cache {DEMO_CACHE_TOKENS} tokens (holds one), one request in flight")
    print_table(demo.result)
    kv, native = demo.ttft_ratio("kvtier"), demo.ttft_ratio("native")
    runs = demo.result.repeats
    if kv is not None:
        line = f"kvtier / baseline TTFT p50: {kv:.2f} (medians of {runs} run(s) each, {len(w.requests)} requests a run)"
        if native is not None:
            line += f"; native / baseline: {native:.2f}; kvtier / native: {kv / native:.2f}"
        print(line)
    print(f"report: {demo.paths.markdown}")
    if demo.paths.plot is not None:
        print(f"TTFT CDF: {demo.paths.plot}")
    if demo.paths.json is not None:
        print(f"JSON: {demo.paths.json}")
    print(f"bench compare took {demo.seconds:.0f} s")

