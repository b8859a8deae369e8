"""``kvtier demo``: the main job end to end on a real vLLM.

1. Restart demo: builds the tiny test model, starts ``vllm serve`` with KVTierConnector (cpu and
   disk tiers under ``.kvtier/``), sends a few long prompts, stops the engine, starts a fresh one
   on the same disk tier, sends them again, and prints what the second engine loaded from kvtier
   and the median TTFT of both runs.
2. Comparison (:func:`kvtier.bench.demo.run_demo_compare`): a window of the Mooncake trace against
   vLLM without a connector, with kvtier and with vLLM's ExampleConnector; one table.
"""

from __future__ import annotations

import os
import shlex
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from kvtier.cli.errors import fail


@dataclass(frozen=True)
class RunResult:
    """One engine run: median TTFT of the measured prompts (seconds), their texts, and the counters after."""

    ttft_s: float
    text: str
    ttfts_s: tuple[float, ...]
    texts: tuple[str, ...]
    external_hit_tokens: float
    loaded_tokens_cpu: float
    loaded_tokens_disk: float
    prompt_tokens: float


@dataclass(frozen=True)
class RestartDemoResult:
    """Both runs of :func:`run_restart_demo` and the command line used."""

    first: RunResult
    second: RunResult
    command: list[str]


def _one_run(model: Path, kvtier: dict[str, object], workdir: Path, name: str, prompts: list[str],
             warmup: str, timeout_s: float, extra_args: list[str]) -> tuple[RunResult, list[str]]:
    from kvtier.integrations.vllm.serve import start_server

    server = start_server(model, kvtier, workdir / "logs" / f"demo-{name}.log",
                          engine_id=f"kvtier-demo-{os.getpid()}-{name}", extra_args=extra_args)
    try:
        server.wait_ready(timeout_s)
        server.complete(warmup, max_tokens=2)  # first-request warm-up (kernels) stays out of the TTFT
        runs = [server.complete(prompt) for prompt in prompts]
        server.flush()
        m = server.metrics()
    finally:
        server.stop()
    ttfts = tuple(t for t, _ in runs)
    texts = tuple(x for _, x in runs)
    result = RunResult(statistics.median(ttfts), texts[0], ttfts, texts, m.get("vllm:external_prefix_cache_hits_total", 0.0),
                       m.get("kvtier_loaded_tokens_total{cpu}", 0.0), m.get("kvtier_loaded_tokens_total{disk}", 0.0),
                       m.get("vllm:prompt_tokens_total", 0.0))
    return result, server.command


def run_restart_demo(workdir: Path = Path(".kvtier"), geometry: str = "tiny", prompt_words: int = 800,
                     timeout_s: float = 600.0, num_prompts: int = 3) -> RestartDemoResult:
    """Serve a prompt, restart the engine, serve it again; the second run is loaded from disk.

    Args:
        workdir: where the model, the disk tier (``workdir/demo-disk``, emptied first so the
            first run is cold) and the server logs go.
        geometry: test-model geometry (``tiny`` with seeded weights, or ``mid`` with dummy weights).
        prompt_words: prompt length in words (about 2 tokens per word).
        num_prompts: distinct prompts per run; the TTFT shown is their median (one sample on a
            shared machine is noise).
        timeout_s: how long to wait for each server to come up.

    Raises:
        RuntimeError: a server failed to start (its log tail is in the message).
    """
    from kvtier.integrations.vllm.testmodel import random_prompt, write_model

    weights = "random" if geometry == "tiny" else "none"
    model = write_model(workdir / "models" / geometry, geometry, weights=weights)
    disk = workdir / "demo-disk"
    shutil.rmtree(disk, ignore_errors=True)
    kvtier: dict[str, object] = {"chunk_tokens": 256, "cpu_gib": 0.5, "disk_path": str(disk), "disk_gib": 2,
                                 "write_mode": "write-through"}
    prompts = [random_prompt(7 + 100 * i, prompt_words) for i in range(num_prompts)]
    warmup = random_prompt(8, 20)
    extra = [] if weights == "random" else ["--load-format", "dummy"]
    first, command = _one_run(model, kvtier, workdir, "first", prompts, warmup, timeout_s, extra)
    second, _ = _one_run(model, kvtier, workdir, "second", prompts, warmup, timeout_s, extra)
    return RestartDemoResult(first, second, command)


def _print(result: RestartDemoResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print("server command (equivalent to `vllm serve`):", style="bold")
    console.print(shlex.join(result.command), markup=False, highlight=False, soft_wrap=True)
    n = len(result.first.ttfts_s)
    table = Table(title=f"kvtier restart demo: the same {n} prompts before and after an engine restart")
    for col in ("run", "TTFT median (ms)", "external hit (tokens)", "loaded from cpu", "loaded from disk"):
        table.add_column(col, justify="right")
    for name, r in (("1: cold", result.first), ("2: after restart", result.second)):
        table.add_row(name, f"{r.ttft_s * 1000:.1f}", f"{r.external_hit_tokens:.0f}", f"{r.loaded_tokens_cpu:.0f}",
                      f"{r.loaded_tokens_disk:.0f}")
    console.print(table)
    same = result.first.texts == result.second.texts
    faster = result.second.ttft_s < result.first.ttft_s
    verdict = "faster" if faster else (
        "NOT faster in this run: on the tiny model prefill is cheap and this machine is noisy; see the "
        "comparison below and docs/benchmarks.md for the mid-size model")
    console.print(f"second run hit: {result.second.external_hit_tokens:.0f} tokens loaded from kvtier's disk tier; "
                  f"median TTFT {result.first.ttft_s * 1000:.1f} ms -> {result.second.ttft_s * 1000:.1f} ms "
                  f"({verdict}); generated text identical: {same}")


def _check_workdir(workdir: Path) -> None:
    """One-line failure unless ``workdir`` is (or can be made) a writable directory."""
    if workdir.exists() and not workdir.is_dir():
        fail(f"--workdir {str(workdir)!r} is a file, not a directory; pass a directory")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".kvtier-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        fail(f"cannot use --workdir {str(workdir)!r} ({exc.strerror}); pass a writable directory")


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        workdir: Annotated[Path, typer.Option(help="Directory for the model, disk tier and logs.")] = Path(".kvtier"),
        geometry: Annotated[str, typer.Option(help="Test model: tiny (seeded weights) or mid (dummy weights).")] = "tiny",
        prompt_words: Annotated[int, typer.Option(min=10, max=900, help="Prompt length in words (~2 tokens each).")] = 800,
        compare: Annotated[bool, typer.Option(help="After the restart demo, run the baseline/kvtier/example "
                                                   "comparison on the Mooncake trace.")] = True,
    ) -> None:
        """Run kvtier on a real vLLM: a restart demo (hit and TTFT of both runs), then a comparison
        of baseline, kvtier and vLLM's ExampleConnector on a window of the Mooncake trace.

        Example: kvtier demo --workdir .kvtier
        """
        if geometry not in ("tiny", "mid"):
            fail(f"unknown geometry {geometry!r}; use --geometry tiny or --geometry mid")
        try:
            import vllm  # noqa: F401
        except ImportError:
            fail("vLLM is not installed in this environment; run `make install` first")
        _check_workdir(workdir)
        try:
            result = run_restart_demo(workdir, geometry, prompt_words)
        except (RuntimeError, OSError) as exc:
            fail(str(exc).splitlines()[0] + f" (see the logs under {workdir / 'logs'})")
        _print(result)
        if result.second.external_hit_tokens <= 0:
            fail("the second run did not hit kvtier; see the logs under " + str(workdir / "logs"))
        if not compare:
            return
        from kvtier.bench.demo import print_demo_compare, run_demo_compare

        print("\ncomparison: baseline (no connector) vs kvtier vs ExampleConnector on the Mooncake trace", flush=True)
        try:
            outcome = run_demo_compare(workdir)
        except (RuntimeError, OSError, ValueError) as exc:
            fail(str(exc).splitlines()[0] + f" (see the logs under {workdir / 'bench-demo'})")
        print_demo_compare(outcome)
