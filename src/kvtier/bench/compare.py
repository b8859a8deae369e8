"""``kvtier bench compare``: the same workload against one fresh vLLM server per arm, in turn.

Per arm: start the server (same model, engine cache size and limits; only the KV connector
differs), send one warm-up request (tokens no workload uses, so first-call costs do not land on
the workload and no cache entry is shared), scrape ``/metrics``, send the workload, scrape again,
stop the server.  An arm whose server fails to start, dies or hangs is recorded as a failure with
the requests in flight and its log path; the other arms still run.  Verdicts are taken against
the ``baseline`` arm when it ran.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.arms import BASELINE, ArmSpec
from kvtier.bench.client import ClientOptions, run_workload
from kvtier.bench.engine import Engine, EngineSpec, EngineStartError
from kvtier.bench.meters import MeterDeltas, MetricsError, deltas, scrape
from kvtier.bench.results import RunResult, RunSummary
from kvtier.bench.verdict import ArmFigures, Thresholds, Verdict, VerdictKind, judge
from kvtier.bench.workload import BenchRequest, TokenSpace, Workload

DOMAIN_WARMUP = 99


@dataclass(frozen=True)
class ArmFailure:
    """Why an arm has no (complete) result.

    Attributes:
        reason: what happened (server exited with code N, hung, failed to start).
        request_ids: the requests in flight when it happened (empty if it never served).
        log_path: the server's log.
    """

    reason: str
    request_ids: tuple[str, ...]
    log_path: Path


@dataclass(frozen=True)
class ArmOutcome:
    """What one arm produced.

    Attributes:
        arm: the arm; log_path: its server log; startup_s: seconds until the server was healthy.
        run: the client's results (``None`` if the server never came up).
        meters: the server's counter deltas (``None`` if they could not be scraped).
        failure: set when the server failed to start, died or hung.
        verdict: set by :func:`run_compare` once every arm ran.
    """

    arm: ArmSpec
    log_path: Path
    startup_s: float
    run: RunResult | None
    meters: MeterDeltas | None
    failure: ArmFailure | None
    verdict: Verdict | None = None

    @property
    def ok(self) -> bool:
        """The arm ran its whole workload and its meters were read."""
        return self.failure is None and self.run is not None and self.meters is not None

    def summary(self) -> RunSummary | None:
        """The run's summary, if there was a run."""
        return self.run.summary() if self.run is not None else None

    def figures(self) -> ArmFigures | None:
        """The verdict's inputs, if the arm completed and had successful requests."""
        summary = self.summary()
        if not self.ok or summary is None or summary.ttft_s is None or self.meters is None:
            return None
        return ArmFigures(prefix_hit_rate=self.meters.prefix_hit_rate or 0.0, ttft_p50_s=summary.ttft_s.p50,
                          ttft_p99_s=summary.ttft_s.p99)

    def json_figures(self) -> dict[str, Any]:
        """The arm's entry of ``--json``: exactly the issue's keys (hit rates are 0.0 when the
        server was never asked, e.g. ``external_hit_rate`` of an arm without a connector)."""
        summary = self.summary()
        ttft = summary.ttft_s if summary is not None else None
        meters = self.meters
        return {
            "ttft_p50_s": ttft.p50 if ttft else float("nan"),
            "ttft_p99_s": ttft.p99 if ttft else float("nan"),
            "prefix_hit_rate": (meters.prefix_hit_rate or 0.0) if meters else 0.0,
            "external_hit_rate": (meters.external_hit_rate or 0.0) if meters else 0.0,
            "output_tok_per_s": summary.output_tok_per_s if summary else 0.0,
            "num_requests": summary.num_ok if summary else 0,
        }


@dataclass(frozen=True)
class CompareResult:
    """All arms of one comparison, in the order they ran."""

    workload: Workload
    engine: EngineSpec
    outcomes: tuple[ArmOutcome, ...]

    def outcome(self, name: str) -> ArmOutcome | None:
        """The outcome of arm ``name``, if it ran."""
        return next((o for o in self.outcomes if o.arm.name == name), None)


def warmup_workload(tokens: TokenSpace) -> Workload:
    """One short request with tokens from a domain no workload uses."""
    request = BenchRequest("warmup", tokens.block(DOMAIN_WARMUP, (0,), 64), 2)
    return Workload(name="warmup", params={}, requests=(request,))


def run_arm(arm: ArmSpec, workload: Workload, engine: EngineSpec, log_path: Path, *,
            warmup: Workload | None, max_concurrency: int | None, stall_timeout_s: float,
            start_timeout_s: float = 900.0, progress: bool = True) -> ArmOutcome:
    """Run one arm start to finish; never raises for a failing server (see the module docstring)."""
    spec = dataclasses.replace(engine, kv_transfer_config=arm.kv_transfer_config)
    server = Engine(spec, log_path)
    try:
        try:
            server.start(timeout_s=start_timeout_s)
        except EngineStartError as exc:
            return ArmOutcome(arm, log_path, 0.0, None, None, ArmFailure(str(exc), (), log_path))
        options = ClientOptions(base_url=server.base_url, model=server.served_model,
                                max_concurrency=max_concurrency, stall_timeout_s=stall_timeout_s,
                                abort_on_stall=True, progress=progress)
        if warmup is not None:
            warm = run_workload(warmup, dataclasses.replace(options, progress=False), server.exit_reason)
            if warm.aborted or not all(r.ok for r in warm.results):
                why = warm.aborted or next(r.error for r in warm.results if not r.ok)
                return ArmOutcome(arm, log_path, server.startup_s, None, None,
                                  ArmFailure(f"warm-up request failed: {why}", ("warmup",), log_path))
        try:
            before = scrape(server.base_url, save_to=log_path.with_suffix('.metrics-before.txt'))
        except MetricsError as exc:
            return ArmOutcome(arm, log_path, server.startup_s, None, None, ArmFailure(str(exc), (), log_path))
        run = run_workload(workload, options, server.exit_reason)
        log_path.with_suffix(".requests.json").write_text(json.dumps(run.to_dict(), indent=1) + "\n")
        if run.aborted is not None:
            return ArmOutcome(arm, log_path, server.startup_s, run, None,
                              ArmFailure(run.aborted, run.failed_at, log_path))
        try:
            after = scrape(server.base_url, save_to=log_path.with_suffix('.metrics-after.txt'))
            meters: MeterDeltas | None = deltas(before, after)
            failure = None
        except MetricsError as exc:
            meters, failure = None, ArmFailure(str(exc), (), log_path)
        return ArmOutcome(arm, log_path, server.startup_s, run, meters, failure)
    finally:
        server.stop()


def run_compare(arms: list[ArmSpec], workload: Workload, engine: EngineSpec, out_dir: Path, *,
                warmup: Workload | None, max_concurrency: int | None = None, stall_timeout_s: float = 300.0,
                start_timeout_s: float = 900.0, thresholds: Thresholds | None = None, progress: bool = True,
                on_arm: Callable[[ArmSpec], None] | None = None) -> CompareResult:
    """Run every arm in order and judge each against ``baseline`` (see the module docstring).

    ``on_arm`` is called before each arm starts (the CLI prints a line there).  Server logs are
    written to ``out_dir/<arm>.log``, the raw ``/metrics`` texts beside them
    (``<arm>.metrics-before.txt``, ``<arm>.metrics-after.txt``) and the client's per-request results
    (``<arm>.requests.json``).
    """
    thresholds = thresholds or Thresholds()
    outcomes: list[ArmOutcome] = []
    for arm in arms:
        if on_arm is not None:
            on_arm(arm)
        outcomes.append(run_arm(arm, workload, engine, out_dir / f"{arm.name}.log", warmup=warmup,
                                max_concurrency=max_concurrency, stall_timeout_s=stall_timeout_s,
                                start_timeout_s=start_timeout_s, progress=progress))
    base = next((o for o in outcomes if o.arm.name == BASELINE), None)
    base_figures = base.figures() if base is not None else None
    judged = []
    for outcome in outcomes:
        figures = outcome.figures()
        if figures is None:
            verdict = None
        elif outcome.arm.name == BASELINE:
            verdict = (judge(figures, None, thresholds) if figures.prefix_hit_rate < thresholds.min_hit_rate
                       else Verdict(VerdictKind.REFERENCE, "the baseline every other arm is compared with"))
        else:
            verdict = judge(figures, base_figures, thresholds)
        judged.append(dataclasses.replace(outcome, verdict=verdict))
    return CompareResult(workload=workload, engine=engine, outcomes=tuple(judged))
