"""The comparison ``make demo`` runs: a window of the Mooncake trace, replayed against vLLM without a
connector, with kvtier and with vLLM's ExampleConnector.

Settings, and why (figures in docs/benchmarks.md):

* model: the ``tiny`` test geometry (:mod:`kvtier.integrations.vllm.testmodel`) with dummy weights,
  so nothing is downloaded and a 2-core machine replays hundreds of requests in about a minute;
* trace: the bundled Mooncake conversation trace, requests 0-999, keeping the conversations that come
  back within the window (378 requests; single-turn requests can hit no cache and only add time),
  64 tokens per 512-token trace block, prompts cut to fit ``max_model_len``, 4 output tokens;
* engine cache: 4,096 tokens (32 blocks of 128) with ``max_model_len`` 2,048: a conversation's next
  turn comes dozens of requests later, long after the engine evicted it, so the baseline recomputes
  and kvtier loads;
* closed loop, 2 requests in flight: TTFT includes the prefill of the request beside it, so saved
  prefill shortens everyone's wait, as on a loaded server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.arms import make_arm
from kvtier.bench.compare import CompareResult, run_compare, warmup_workload
from kvtier.bench.engine import EngineSpec
from kvtier.bench.factory import WorkloadKnobs, build_workload, model_vocab_size
from kvtier.bench.report import ReportPaths, print_table, write_reports
from kvtier.bench.workload import vocab_token_space

DEMO_KNOBS = WorkloadKnobs(kind="trace", seed=0, start=0, limit=1000, returning_only=True, tokens_per_block=64,
                           max_output_tokens=4)
DEMO_MAX_MODEL_LEN = 2048
DEMO_CACHE_TOKENS = 4096
DEMO_CONCURRENCY = 2
DEMO_ARMS = ("baseline", "kvtier", "example")


@dataclass(frozen=True)
class DemoCompare:
    """What :func:`run_demo_compare` produced: the comparison, its files and the seconds it took."""

    result: CompareResult
    paths: ReportPaths
    seconds: float
    command: str


def demo_command(out_dir: Path, model: Path) -> str:
    """The ``kvtier bench compare`` command line equivalent to the demo (printed and in the report)."""
    k = DEMO_KNOBS
    return (f"kvtier bench compare --model {model} --arms {','.join(DEMO_ARMS)} --max-model-len {DEMO_MAX_MODEL_LEN} "
            f"--engine-cache-tokens {DEMO_CACHE_TOKENS} --workload trace --start {k.start} --limit {k.limit} "
            f"--returning-only --tokens-per-block {k.tokens_per_block} --max-output-tokens {k.max_output_tokens} "
            f"--max-concurrency {DEMO_CONCURRENCY} --kvtier-config <cpu 1 GiB + disk 2 GiB> --out {out_dir}")


def run_demo_compare(workdir: Path = Path(".kvtier"), arms: tuple[str, ...] = DEMO_ARMS,
                     progress: bool = True) -> DemoCompare:
    """Build the tiny model, run every arm on the demo workload, write the reports.

    Files: the model under ``workdir/models/tiny-dummy``, kvtier's disk tier under
    ``workdir/bench-demo/kvtier-disk`` (emptied first), reports and server logs under
    ``workdir/bench-demo`` (the ExampleConnector's scratch files are deleted at the end).  Never raises for a failing arm (it is in the result).

    Raises:
        ValueError: an unknown arm name.
        RuntimeError: the test model could not be written.
    """
    import shutil

    from kvtier.integrations.vllm.testmodel import write_model

    t0 = time.perf_counter()
    model = write_model(workdir / "models" / "tiny-dummy", "tiny", weights="none")
    out = workdir / "bench-demo"
    disk = out / "kvtier-disk"
    shutil.rmtree(out, ignore_errors=True)
    vocab = model_vocab_size(str(model))
    if vocab is None:
        raise RuntimeError(f"the test model at {model} has no vocab_size in its config.json")
    workload = build_workload(DEMO_KNOBS, vocab, DEMO_MAX_MODEL_LEN, closed_loop=True)
    kvtier = {"cpu_gib": 1.0, "disk_path": str(disk), "disk_gib": 2.0}
    spec = EngineSpec(model=str(model), max_model_len=DEMO_MAX_MODEL_LEN, cache_tokens=DEMO_CACHE_TOKENS)
    command = demo_command(out, model)
    result = run_compare([make_arm(a, out, kvtier) for a in arms], workload, spec, out,
                         warmup=warmup_workload(vocab_token_space(DEMO_KNOBS.seed, vocab)),
                         max_concurrency=DEMO_CONCURRENCY, stall_timeout_s=120.0, progress=progress,
                         on_arm=lambda a: print(f"arm {a.name}: starting vLLM ({a.description})", flush=True))
    shutil.rmtree(out / "example-connector-storage", ignore_errors=True)  # ~300 MB of scratch safetensors
    paths = write_reports(result, out, out / "compare.json", command=command)
    return DemoCompare(result=result, paths=paths, seconds=time.perf_counter() - t0, command=command)


def print_demo_compare(demo: DemoCompare) -> None:
    """Print the table, the verdicts and where the report, plot and JSON are."""
    w = demo.result.workload
    print(f"workload: Mooncake conversation trace, {len(w.requests)} requests, {w.num_prompt_tokens} prompt tokens")
    for note in w.notes:
        print(f"note: {note}")
    print_table(demo.result)
    print(f"report: {demo.paths.markdown}")
    if demo.paths.plot is not None:
        print(f"TTFT CDF: {demo.paths.plot}")
    if demo.paths.json is not None:
        print(f"JSON: {demo.paths.json}")
    print(f"bench compare took {demo.seconds:.0f} s")
