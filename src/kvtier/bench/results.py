"""Per-request results and their summary (p50/p90/p99, throughput), as plain typed values.

Percentiles are numpy's default linear interpolation (``numpy.percentile``), the same rule as
vLLM's ``vllm bench serve``.  Latencies are seconds, throughputs per second of wall time of the
run (first send to last completion).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RequestResult:
    """What the client saw for one request.

    Attributes:
        request_id: the workload's id.
        prompt_tokens: prompt length sent, tokens.
        output_tokens: completion tokens received.
        start_s: send time, seconds after the start of the run.
        ttft_s: send to first completion token, seconds; ``None`` if none arrived.
        e2e_s: send to last byte, seconds; ``None`` if the request failed.
        itl_s: gap between consecutive completion tokens, seconds, one entry per token after the
            first (a chunk carrying ``k`` tokens contributes ``k`` equal gaps).
        error: why the request failed, or ``None``.
        replica: which server of the arm it was sent to (0-based; see :class:`~kvtier.bench.client.ClientOptions`).
    """

    request_id: str
    prompt_tokens: int
    output_tokens: int
    start_s: float
    ttft_s: float | None
    e2e_s: float | None
    itl_s: tuple[float, ...] = ()
    error: str | None = None
    replica: int = 0

    @property
    def ok(self) -> bool:
        """The request completed without error."""
        return self.error is None and self.e2e_s is not None


@dataclass(frozen=True)
class Percentiles:
    """p50/p90/p99 of a latency, seconds."""

    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles | None:
        """Percentiles of ``values``; ``None`` when there are none."""
        if not values:
            return None
        arr = np.asarray(values, dtype=float)
        p50, p90, p99 = (float(x) for x in np.percentile(arr, [50, 90, 99]))
        return cls(p50=p50, p90=p90, p99=p99, mean=float(arr.mean()))


@dataclass(frozen=True)
class RunSummary:
    """Summary of one run.

    Attributes:
        num_requests: requests in the workload; num_ok / num_failed / num_not_sent partition it.
        duration_s: first send to last completion, seconds.
        ttft_s, itl_s, e2e_s: percentiles over successful requests (``None`` if none succeeded).
        output_tok_per_s: completion tokens of successful requests per second.
        prompt_tok_per_s: prompt tokens of successful requests per second.
        request_per_s: successful requests per second.
    """

    num_requests: int
    num_ok: int
    num_failed: int
    num_not_sent: int
    duration_s: float
    ttft_s: Percentiles | None
    itl_s: Percentiles | None
    e2e_s: Percentiles | None
    output_tok_per_s: float
    prompt_tok_per_s: float
    request_per_s: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class RestartEvent:
    """A replica's planned restart during a run (:mod:`kvtier.bench.restart`); times are seconds
    after the start of the run.

    Attributes:
        replica: the restarted server; at_request: requests sent when it was taken down.
        began_s: it was taken down (no new request sent to it from here); stopped_s: its requests
            in flight had finished and it got SIGTERM; back_s: it answered again (``None``: it did not).
        rerouted: ids of the requests sent to another replica instead while it was down.
        error: why it did not come back, or ``None``.
    """

    replica: int
    at_request: int
    began_s: float
    stopped_s: float
    back_s: float | None
    rerouted: tuple[str, ...] = ()
    error: str | None = None

    @property
    def down_s(self) -> float | None:
        """Seconds the replica took no requests (``None`` when it did not come back)."""
        return None if self.back_s is None else self.back_s - self.began_s


@dataclass(frozen=True)
class RunResult:
    """A finished (or aborted) run.

    Attributes:
        results: one entry per request of the workload, in workload order.
        duration_s: first send to last completion, seconds.
        aborted: why the run stopped before sending everything (engine died, hung), or ``None``.
        failed_at: ids of the requests in flight when the first failure happened.
        restart: the planned restart of a replica during the run, if there was one.
    """

    results: tuple[RequestResult, ...]
    duration_s: float
    aborted: str | None = None
    failed_at: tuple[str, ...] = field(default_factory=tuple)
    restart: RestartEvent | None = None

    def summary(self) -> RunSummary:
        """Percentiles and throughput of the successful requests."""
        ok = [r for r in self.results if r.ok]
        not_sent = sum(1 for r in self.results if r.error is not None and r.error.startswith(NOT_SENT))
        duration = max(self.duration_s, 1e-9)
        return RunSummary(
            num_requests=len(self.results), num_ok=len(ok), num_failed=len(self.results) - len(ok) - not_sent,
            num_not_sent=not_sent, duration_s=self.duration_s,
            ttft_s=Percentiles.of([r.ttft_s for r in ok if r.ttft_s is not None]),
            itl_s=Percentiles.of([gap for r in ok for gap in r.itl_s]),
            e2e_s=Percentiles.of([r.e2e_s for r in ok if r.e2e_s is not None]),
            output_tok_per_s=sum(r.output_tokens for r in ok) / duration,
            prompt_tok_per_s=sum(r.prompt_tokens for r in ok) / duration,
            request_per_s=len(ok) / duration)

    def first_failure(self) -> RequestResult | None:
        """The failed request that was sent first (requests never sent do not count), or ``None``."""
        failed = [r for r in self.results if not r.ok and not (r.error or "").startswith(NOT_SENT)]
        return min(failed, key=lambda r: r.start_s) if failed else None

    def failure_text(self) -> str | None:
        """One sentence on the failed requests: how many of how many, and the first one's
        request id and reason (e.g. ``HTTP 400: <the server's message>``); ``None`` when every
        sent request succeeded."""
        first = self.first_failure()
        if first is None:
            return None
        s = self.summary()
        not_sent = f" ({s.num_not_sent} not sent)" if s.num_not_sent else ""
        return (f"{s.num_failed} of {s.num_requests} requests failed{not_sent}; the first, {first.request_id}: "
                f"{first.error}")

    def of_replica(self, replica: int) -> RunResult:
        """The requests sent to server ``replica`` only (same ``duration_s``: the servers of an arm
        serve side by side, so per-replica throughputs add up to the arm's)."""
        return replace(self, results=tuple(r for r in self.results if r.replica == replica))

    def after_restart(self) -> tuple[RequestResult, ...]:
        """The requests sent to the restarted replica once it was back (empty without a restart)."""
        event = self.restart
        if event is None or event.back_s is None:
            return ()
        back = event.back_s
        return tuple(r for r in self.results if r.replica == event.replica and r.start_s >= back)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (per-request results plus the summary, and the restart if there was one)."""
        return {"duration_s": self.duration_s, "aborted": self.aborted, "failed_at": list(self.failed_at),
                "summary": self.summary().to_dict(), "requests": [asdict(r) for r in self.results],
                **({"restart": asdict(self.restart)} if self.restart is not None else {})}


NOT_SENT = "not sent"
"""Error prefix of requests never sent because the run was aborted."""
