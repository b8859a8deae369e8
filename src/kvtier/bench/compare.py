"""``kvtier bench compare``: the same workload against one fresh vLLM server per arm and run.

Runs are interleaved over ``repeats`` (A B C A B C ...; see :mod:`kvtier.bench.spread` for why),
every server with the same core pinning (:meth:`ServerSpec.environment`).  An arm whose connector
writes files (kvtier's ``disk_path``, ExampleConnector's ``shared_storage_path``) gets a fresh,
empty directory ``<path>/run-<k>`` per run, removed after the run, so no run starts warm.

Per run: start the server (same model, engine cache size and limits; only the KV connector
differs), send one warm-up request (tokens no workload uses, so first-call costs do not land on
the workload and no cache entry is shared), scrape ``/metrics``, send the workload, scrape again,
stop the server (gracefully: SIGTERM).  An arm whose server fails to start, dies or hangs, or whose
run has no successful request, is recorded as a failure with the requests in flight (or the first
failed request's reason) and its log path; the other arms still run.  Verdicts are taken against
the ``baseline`` arm when it ran, on the medians over runs, with the noise check of
:func:`~kvtier.bench.spread.judge_spread`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.arms import BASELINE, ArmSpec
from kvtier.bench.client import ClientOptions, run_workload
from kvtier.bench.comparereceipts import replica_receipts, with_receipt_logs
from kvtier.bench.meters import MetricsError, deltas
from kvtier.bench.outcome import ArmFailure, ArmOutcome
from kvtier.bench.receipts import LogCursor
from kvtier.bench.replicas import (
    REPLICA_FIGURE_KEYS,
    ReplicaSet,
    replica_deltas,
    replica_log_paths,
    replica_specs,
    sum_deltas,
)
from kvtier.bench.restart import RestartHook, RestartPlan
from kvtier.bench.results import RunResult
from kvtier.bench.shared_node import NodePool
from kvtier.bench.shared_s3 import S3Target
from kvtier.bench.spread import Spread, figures_of, judge_spread, spreads, unread_hit_rate
from kvtier.bench.verdict import Thresholds, Verdict, baseline_verdict, no_tokens_verdict
from kvtier.bench.workload import BenchRequest, TokenSpace, Workload
from kvtier.launch.serve import ServerSpec, ServerStartError

__all__ = ["ArmFailure", "ArmOutcome", "ArmResult", "CompareResult", "judge_arms", "run_arm", "run_compare",
           "run_failure", "warmup_workload"]

DOMAIN_WARMUP = 99


@dataclass(frozen=True)
class ArmResult:
    """One arm over all its runs.

    Attributes:
        arm: the arm; runs: its outcomes in run order; verdict: against the baseline (medians and
        noise check), ``None`` without figures.
    """

    arm: ArmSpec
    runs: tuple[ArmOutcome, ...]
    verdict: Verdict | None = None

    @property
    def ok_runs(self) -> tuple[ArmOutcome, ...]:
        """The runs that completed."""
        return tuple(r for r in self.runs if r.ok)

    @property
    def failure(self) -> ArmFailure | None:
        """The first failure among the runs, if any."""
        return next((r.failure for r in self.runs if r.failure is not None), None)

    @property
    def ok(self) -> bool:
        """Every run completed."""
        return bool(self.runs) and all(r.ok for r in self.runs)

    def spreads(self) -> dict[str, Spread]:
        """Median and range of each figure over the completed runs."""
        return spreads([r.run_figures() for r in self.ok_runs])

    def replica_spreads(self) -> list[dict[str, Spread]]:
        """Per replica, median and range of each of its figures over the completed runs."""
        per_run = [o.replica_figures() for o in self.ok_runs]
        count = max((len(f) for f in per_run), default=0)
        out = []
        for i in range(count):
            figures = {}
            for key in REPLICA_FIGURE_KEYS:
                spread = Spread.of([float(v) for f in per_run if i < len(f) and (v := f[i].get(key)) is not None])
                if spread is not None:
                    figures[key] = spread
            out.append(figures)
        return out

    def json_figures(self) -> dict[str, Any]:
        """The arm's entry of ``--json``: the issue's keys, each the median over completed runs."""
        s = self.spreads()
        num = [r.summary().num_ok for r in self.ok_runs]  # type: ignore[union-attr]
        return {"ttft_p50_s": s["ttft_p50_s"].median if "ttft_p50_s" in s else float("nan"),
                "ttft_p99_s": s["ttft_p99_s"].median if "ttft_p99_s" in s else float("nan"),
                "prefix_hit_rate": s["prefix_hit_rate"].median if "prefix_hit_rate" in s else 0.0,
                "external_hit_rate": s["external_hit_rate"].median if "external_hit_rate" in s else 0.0,
                "output_tok_per_s": s["output_tok_per_s"].median if "output_tok_per_s" in s else 0.0,
                "request_per_s": s["request_per_s"].median if "request_per_s" in s else 0.0,
                "num_requests": int(statistics.median(num)) if num else 0}


@dataclass(frozen=True)
class CompareResult:
    """All runs of one comparison, in the order they ran, and the per-arm results.

    Attributes:
        workload, engine: what every run used; outcomes: every run in run order;
        arms: per arm, in the order given (filled by :func:`run_compare`; derived from
        ``outcomes`` without verdicts when left empty); repeats: runs per arm; replicas: servers
        per arm and run (requests round robin over them); restart: the replica restarted in
        every run, and when (:mod:`kvtier.bench.restart`), if one was.
    """

    workload: Workload
    engine: ServerSpec
    outcomes: tuple[ArmOutcome, ...]
    arms: tuple[ArmResult, ...] = ()
    repeats: int = 1
    replicas: int = 1
    restart: RestartPlan | None = None

    def __post_init__(self) -> None:
        if not self.arms:
            names = list(dict.fromkeys(o.arm.name for o in self.outcomes))
            object.__setattr__(self, "arms", tuple(
                ArmResult(next(o.arm for o in self.outcomes if o.arm.name == n),
                          tuple(o for o in self.outcomes if o.arm.name == n),
                          next((o.verdict for o in self.outcomes if o.arm.name == n), None)) for n in names))

    def outcome(self, name: str) -> ArmOutcome | None:
        """The first run of arm ``name``, if it ran."""
        return next((o for o in self.outcomes if o.arm.name == name), None)

    def arm_result(self, name: str) -> ArmResult | None:
        """Arm ``name`` over all its runs, if it ran."""
        return next((a for a in self.arms if a.arm.name == name), None)


def warmup_workload(tokens: TokenSpace) -> Workload:
    """One short request with tokens from a domain no workload uses."""
    request = BenchRequest("warmup", tokens.block(DOMAIN_WARMUP, (0,), 64), 2)
    return Workload(name="warmup", params={}, requests=(request,))


def run_failure(run: RunResult) -> str | None:
    """Why a run of an arm counts as failed, or ``None``: the run was aborted (engine died or
    hung), or no request succeeded (e.g. every one answered HTTP 400), so there is no figure to
    judge and no verdict may be given as if the arm were fine.  Some failed requests alone do
    not fail the run (the report names them, :meth:`RunResult.failure_text`)."""
    if run.aborted is not None:
        return run.aborted
    if run.summary().num_ok == 0:
        return f"no request succeeded: {run.failure_text() or 'none was sent'}"
    return None


def run_arm(arm: ArmSpec, workload: Workload, engine: ServerSpec, log_path: Path, *,
            warmup: Workload | None, max_concurrency: int | None, stall_timeout_s: float,
            start_timeout_s: float = 900.0, progress: bool = True, repeat: int = 0, replicas: int = 1,
            restart: RestartPlan | None = None) -> ArmOutcome:
    """Run one arm start to finish on ``replicas`` servers (requests round robin, see
    :mod:`kvtier.bench.replicas`), restarting one mid-run when ``restart`` says so (see
    :mod:`kvtier.bench.restart`); never raises for a failing server (see the module docstring)."""
    spec = dataclasses.replace(engine, kv_transfer_config=arm.kv_transfer_config)
    logs = replica_log_paths(log_path, replicas)
    specs, receipt_logs = with_receipt_logs(replica_specs(spec, replicas), logs)
    servers = ReplicaSet(specs, logs)
    log_path = logs[0]

    def failed(reason: str, request_ids: tuple[str, ...] = (), run: RunResult | None = None,
               load: float | None = None) -> ArmOutcome:
        where = next((s.log_path for s in servers.servers if s.exit_reason() not in (None, "was never started")),
                     log_path)
        return ArmOutcome(arm, where, servers.startup_s, run, None, ArmFailure(reason, request_ids, where),
                          repeat=repeat, load_avg_1m=load, replica_logs=tuple(logs))

    try:
        try:
            servers.start(timeout_s=start_timeout_s)
        except ServerStartError as exc:
            return failed(str(exc))
        options = ClientOptions(base_url=servers.urls[0], model=servers.servers[0].served_model,
                                max_concurrency=max_concurrency, stall_timeout_s=stall_timeout_s,
                                abort_on_stall=True, progress=progress,
                                replica_urls=servers.urls if replicas > 1 else ())
        if warmup is not None:  # once per server: every replica's first-call costs stay out of the workload
            for url in servers.urls:
                warm = run_workload(warmup, dataclasses.replace(options, base_url=url, replica_urls=(),
                                                                progress=False), servers.exit_reason)
                if warm.aborted or not all(r.ok for r in warm.results):
                    why = warm.aborted or next(r.error for r in warm.results if not r.ok)
                    return failed(f"warm-up request failed: {why}", ("warmup",))
        try:
            before = servers.scrape(".metrics-before.txt")
        except MetricsError as exc:
            return failed(str(exc))
        load, cursors = os.getloadavg()[0], [LogCursor(p) if p is not None else None for p in receipt_logs]
        hook = None if restart is None else RestartHook(restart, lambda i: servers.restart(i, start_timeout_s),
                                                        drain_timeout_s=stall_timeout_s)
        run = run_workload(workload, options, servers.exit_reason, hook)
        log_path.with_suffix(".requests.json").write_text(json.dumps(run.to_dict(), indent=1) + "\n")
        if (why := run_failure(run)) is not None:
            return failed(why, run.failed_at, run, load)
        try:
            after = servers.scrape(".metrics-after.txt")
        except MetricsError as exc:
            return failed(str(exc), (), run, load)
        per_replica = replica_deltas(before, after, servers.restarts)
        again = [deltas(started, after[i]) for i, (_, started) in servers.restarts.items()]
        receipts = replica_receipts(cursors, before, after, run.summary().num_ok + run.summary().num_failed,
                                    servers.restarts)
        return ArmOutcome(arm, log_path, servers.startup_s, run, sum_deltas(per_replica), None, repeat=repeat,
                          load_avg_1m=load, replica_meters=tuple(per_replica), replica_logs=tuple(servers.log_paths),
                          receipts=receipts, restart_meters=again[0] if again else None)
    finally:
        servers.stop()


def run_compare(arms: list[ArmSpec], workload: Workload, engine: ServerSpec, out_dir: Path, *,
                warmup: Workload | None, max_concurrency: int | None = None, stall_timeout_s: float = 300.0,
                start_timeout_s: float = 900.0, thresholds: Thresholds | None = None, progress: bool = True,
                repeats: int = 1, on_arm: Callable[[ArmSpec, int], None] | None = None,
                replicas: int = 1, s3_target: S3Target | None = None,
                node_pool: NodePool | None = None, restart: RestartPlan | None = None) -> CompareResult:
    """Run every arm ``repeats`` times, interleaved, each run on ``replicas`` servers (requests
    round robin, :mod:`kvtier.bench.replicas`), and judge each against ``baseline`` (see the
    module docstring).  An arm with a shared ``redis_url`` gets a key prefix of its own per run,
    deleted afterwards (:func:`kvtier.bench.shared_redis.with_run_prefix`); so does an arm with an
    ``s3_bucket`` (:func:`kvtier.bench.shared_s3.with_run_prefix`), whose objects are removed from
    ``s3_target`` (the private server of the ``kvtier-s3`` arm) after the run; an arm whose servers
    name ``node_pool``'s socket (``kvtier-node``) gets a fresh owner of that pool per run, its log
    ``<arm>[-run<k>].node.log`` (:mod:`kvtier.bench.runscope`).  With ``restart``, every run of
    every arm restarts the same replica at the same point of the workload (:mod:`kvtier.bench.restart`).

    ``on_arm(arm, repeat)`` is called before each run starts (the CLI prints a line there).  Server
    logs are written to ``out_dir/<arm>.log`` (``<arm>-run<k>.log`` with several runs), the raw
    ``/metrics`` texts beside them (``.metrics-before.txt``, ``.metrics-after.txt``) and the
    client's per-request results (``.requests.json``); with several replicas, ``-r<i>`` before the
    suffix names each server's log and ``/metrics`` texts.
    """
    from kvtier.bench.runscope import run_scope
    from kvtier.bench.shared_redis import run_tag

    thresholds = thresholds or Thresholds()
    outcomes: list[ArmOutcome] = []
    tag = run_tag()
    for k in range(repeats):
        for arm in arms:
            if on_arm is not None:
                on_arm(arm, k)
            stem = arm.name if repeats == 1 else f"{arm.name}-run{k}"
            node_log = out_dir / f"{stem}.node.log"
            try:
                with run_scope(arm, k, tag, s3_target=s3_target, node_pool=node_pool, node_log=node_log) as run_spec:
                    outcome = run_arm(run_spec, workload, engine, out_dir / f"{stem}.log", warmup=warmup,
                                      max_concurrency=max_concurrency, stall_timeout_s=stall_timeout_s,
                                      start_timeout_s=start_timeout_s, progress=progress, repeat=k,
                                      replicas=replicas, restart=restart)
            except ServerStartError as exc:  # the run's node pool owner: the arm's run fails, the others go on
                outcome = ArmOutcome(arm, node_log, 0.0, None, None, ArmFailure(str(exc), (), node_log), repeat=k)
            outcomes.append(dataclasses.replace(outcome, arm=arm))
    return CompareResult(workload=workload, engine=engine, outcomes=tuple(outcomes),
                         arms=judge_arms(arms, outcomes, thresholds), repeats=repeats, replicas=replicas,
                         restart=restart)


def judge_arms(arms: list[ArmSpec], outcomes: list[ArmOutcome], thresholds: Thresholds) -> tuple[ArmResult, ...]:
    """Per arm (in ``arms`` order) its runs and its verdict against the baseline, over the runs
    that completed (:attr:`ArmOutcome.ok`); an arm without a completed run has no verdict."""
    per_arm = [(arm, tuple(o for o in outcomes if o.arm.name == arm.name)) for arm in arms]
    base = next((runs for arm, runs in per_arm if arm.name == BASELINE), None)
    base_spreads = spreads([o.run_figures() for o in base if o.ok]) if base else None
    results = []
    others = {arm.name: f for arm, runs in per_arm if arm.name != BASELINE
              and (f := figures_of(spreads([o.run_figures() for o in runs if o.ok]))) is not None}
    for arm, runs in per_arm:
        s = spreads([o.run_figures() for o in runs if o.ok])
        if arm.name == BASELINE:
            figures = figures_of(s)
            verdict = (no_tokens_verdict() if unread_hit_rate(s)
                       else None if figures is None else baseline_verdict(figures, others, thresholds))
        else:
            verdict = judge_spread(s, base_spreads or None, thresholds)
        results.append(ArmResult(arm, runs, verdict))
    return tuple(results)

