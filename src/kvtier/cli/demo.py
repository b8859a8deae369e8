"""``kvtier demo``: the main job end to end on a real vLLM, on the 24-layer ``mid`` test geometry.

1. Restart (:func:`kvtier.bench.demo.run_restart_demo`): long prompts served cold by ``vllm serve``
   with KVTierConnector, the server stopped with SIGTERM, a fresh server on the same disk tier
   serving them again; TTFT of both runs (median and range), tokens loaded, text compared.
2. Comparison (:func:`kvtier.bench.demo.run_demo_compare`): baseline vs vLLM's native offload vs
   kvtier, interleaved runs, table with ranges, verdicts, TTFT CDF plot.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Annotated

import typer

from kvtier.cli.errors import fail


def _print_restart(result: object) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvtier.bench.demo import RestartDemoResult, restart_verdict

    assert isinstance(result, RestartDemoResult)
    console = Console()
    console.print("server command (both runs; equivalent to `vllm serve`):", style="bold")
    console.print(shlex.join(result.command), markup=False, highlight=False, soft_wrap=True)
    n = len(result.first.ttfts_s)
    table = Table(title=f"restart: the same {n} prompts before and after SIGTERM + a fresh server on the same disk tier")
    for col in ("run", "TTFT median", "TTFT range", "tokens from kvtier"):
        table.add_column(col, justify="right")
    for name, r in (("1: cold", result.first), ("2: after restart", result.second)):
        s = r.ttft
        table.add_row(name, f"{s.median * 1000:.0f} ms", f"{s.low * 1000:.0f}-{s.high * 1000:.0f} ms (n={s.n})",
                      f"{r.external_hit_tokens:.0f} / {r.prompt_tokens}")
    console.print(table)
    console.print(f"restart TTFT ratio (after / cold, medians): {result.ttft_ratio:.2f}", style="bold")
    console.print(restart_verdict(result), highlight=False)


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
        workdir: Annotated[Path, typer.Option(help="Directory for the model, disk tiers, logs and reports.")] = Path(".kvtier"),
        compare: Annotated[bool, typer.Option(help="After the restart, run the baseline / native / kvtier "
                                                   "comparison.")] = True,
        repeats: Annotated[int, typer.Option(min=1, max=5, help="Comparison runs per arm, interleaved.")] = 2,
    ) -> None:
        """Run kvtier on a real vLLM (24-layer test model, dummy weights, ~10 minutes on 2 idle cores,
        36 measured on a busy shared machine): a SIGTERM restart served from kvtier's disk tier, then
        baseline vs vLLM's native CPU offload vs kvtier on a workload that overflows the engine cache.

        Example: kvtier demo --workdir .kvtier
        """
        import importlib.util

        from kvtier.core.errors import ServerAnswerError, ServerStartError

        _check_workdir(workdir)  # the cheap checks first: importing vLLM takes many seconds
        if importlib.util.find_spec("vllm") is None:  # found, not imported: the servers import it
            fail("vLLM is not installed in this environment; run `make install` first")

        from kvtier.bench.demo import print_demo_compare, run_demo_compare, run_restart_demo

        print("restart: serving 3 prompts cold, stopping the server with SIGTERM, serving them again from a fresh "
              "server (24-layer model; each server takes a minute or more to start)", flush=True)
        try:
            result = run_restart_demo(workdir)
        except (ServerStartError, ServerAnswerError, OSError) as exc:
            fail(str(exc).splitlines()[0] + f" (see the logs under {workdir / 'logs'})")
        _print_restart(result)
        if result.second.external_hit_tokens <= 0:
            fail("the restarted server found nothing in kvtier's disk tier; see the logs under " + str(workdir / "logs"))
        if not compare:
            return
        print("\ncomparison: baseline (no connector) vs native (vLLM OffloadingConnector, CPU tier) vs kvtier",
              flush=True)
        try:
            outcome = run_demo_compare(workdir, repeats=repeats)
        except (RuntimeError, OSError, ValueError) as exc:
            fail(str(exc).splitlines()[0] + f" (see the logs under {workdir / 'bench-demo'})")
        print_demo_compare(outcome)
