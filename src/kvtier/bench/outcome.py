"""What one run of one arm of ``kvtier bench compare`` produced (:class:`ArmOutcome`), or why it
produced nothing (:class:`ArmFailure`); the per-arm aggregates are in :mod:`kvtier.bench.compare`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.arms import ArmSpec
from kvtier.bench.meters import MeterDeltas
from kvtier.bench.receipts import RunReceipts
from kvtier.bench.replicas import replica_figures
from kvtier.bench.restart import restart_figures
from kvtier.bench.results import RunResult, RunSummary
from kvtier.bench.verdict import ArmFigures, Verdict


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
        verdict: the verdict of this run alone (tests and single runs; the comparison's verdict
            is per arm, :attr:`kvtier.bench.compare.ArmResult.verdict`).
        repeat: which run of the arm this was (0-based).
        load_avg_1m: the machine's 1-minute load average when the run's workload started.
        replica_meters: per server of the arm, its counter deltas (``meters`` is their sum; empty
            when they could not be read).
        replica_logs: every server's log, in replica order (a restarted replica's second log after them).
        receipts: a kvtier arm's receipts beside its metrics (:mod:`kvtier.bench.comparereceipts`).
        restart_meters: with a planned restart (:mod:`kvtier.bench.restart`), the restarted
            replica's counter deltas from its answering again to the end of the run.
    """

    arm: ArmSpec
    log_path: Path
    startup_s: float
    run: RunResult | None
    meters: MeterDeltas | None
    failure: ArmFailure | None
    verdict: Verdict | None = None
    repeat: int = 0
    load_avg_1m: float | None = None
    replica_meters: tuple[MeterDeltas, ...] = ()
    replica_logs: tuple[Path, ...] = ()
    receipts: RunReceipts | None = None
    restart_meters: MeterDeltas | None = None

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
            "request_per_s": summary.request_per_s if summary else 0.0,
            "num_requests": summary.num_ok if summary else 0,
        }

    def run_figures(self) -> dict[str, float | None]:
        """Every figure :mod:`kvtier.bench.spread` aggregates, for this run (``None`` = not measured)."""
        summary, meters = self.summary(), self.meters
        ttft = summary.ttft_s if summary is not None else None
        return {"prefix_hit_rate": meters.prefix_hit_rate if meters else None,
                "engine_hit_rate": meters.engine_hit_rate if meters else None,
                "external_hit_rate": (meters.external_hit_rate or 0.0) if meters else None,
                "ttft_p50_s": ttft.p50 if ttft else None, "ttft_p99_s": ttft.p99 if ttft else None,
                "output_tok_per_s": summary.output_tok_per_s if summary else None,
                "request_per_s": summary.request_per_s if summary else None,
                **(restart_figures(self.run, self.restart_meters) if self.run is not None else {})}

    def replica_figures(self) -> list[dict[str, float | None]]:
        """Per server of the arm: :func:`kvtier.bench.replicas.replica_figures` (empty without meters)."""
        if self.run is None or not self.replica_meters:
            return []
        return replica_figures(self.run, self.replica_meters)
