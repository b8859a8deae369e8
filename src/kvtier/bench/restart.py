"""One replica restarted mid-run: ``bench compare --replicas N --restart-replica-at FRACTION``.

An operator restarts a replica (a new image, a config change, a node drained): the load balancer
stops sending it requests, the requests it is serving finish, it gets SIGTERM and stops gracefully,
the same server starts again and the balancer sends it requests once it answers.  What a restart
costs a cache is what it loses: vLLM's native CPU offload tier and kvtier's cpu tier live in the
server's memory and are gone; kvtier's disk tier (a directory of the host), and its redis and node
tiers (servers of their own) are still there.  The comparison shows the difference as the hit rate
and TTFT of the restarted replica's requests after its restart.

The plan (:class:`RestartPlan`): replica :data:`RESTARTED_REPLICA` is restarted once
``ceil(FRACTION x requests)`` of the workload's requests have been sent, the same point for every
arm and run.  The client (:mod:`kvtier.bench.client`, through :class:`Router`):

1. from then on sends no new request to that replica: a request whose turn it is (request ``k`` to
   replica ``k mod N``) goes to the live replicas instead, round robin over them, as a load
   balancer does with a replica its health check took out; no request waits for the restart;
2. waits until the replica's requests in flight have finished (at most the stall timeout), so none
   is cut off by the restart;
3. restarts it (:meth:`kvtier.bench.replicas.ReplicaSet.restart`: ``/metrics`` scraped, SIGTERM
   with the server's graceful stop, the same server started on the same port, ``/metrics`` scraped
   once it answers: its counters start again from zero), in a thread, while the workload goes on;
4. sends it its requests again once it answers ``/v1/models``.  No warm-up request is sent to the
   restarted server, as an operator's readiness probe sends none: the first request after the
   restart carries the server's first-call costs, the same in every arm.

A replica that does not come back ends the run as a failure of the arm (its start-up error named);
the planned restart itself fails no request.

A plan with ``hold`` (a balancer with session affinity, which keeps a client's requests for its
replica) changes step 1: a request whose turn is the restarted replica's waits until that replica
answers again and is then sent there, instead of going to a live replica; every other request goes
on as before.  The wait is bounded by the restart's own drain and start deadlines (a replica that
does not come back aborts the run, and the held request is then sent to a live replica).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvtier.bench.meters import MeterDeltas
from kvtier.bench.results import Percentiles, RestartEvent, RunResult

RESTARTED_REPLICA = 0
"""The replica a planned restart stops and starts again (0-based)."""

RESTART_KEYS = ("restart_hit_rate", "restart_ttft_p50_s", "restart_ttft_p99_s", "restart_requests",
                "restart_down_s", "restart_rerouted")
"""A run's restart figures (:func:`restart_figures`)."""


def check_restart(fraction: float, replicas: int) -> None:
    """Refuse a restart plan that cannot run, before anything starts.

    Raises:
        ValueError: one sentence naming the option and the fix: ``fraction`` not strictly between 0
            and 1, or fewer than 2 replicas (no server would take the requests meanwhile).
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"--restart-replica-at {fraction:g} must be a share of the workload's requests strictly "
                         "between 0 and 1 (e.g. 0.5: restart once half of them were sent)")
    if replicas < 2:
        raise ValueError(f"--restart-replica-at needs --replicas 2 or more (it is {replicas}): while one replica "
                         "restarts, the others take its requests")


@dataclass(frozen=True)
class RestartPlan:
    """Restart ``replica`` once ``at_request`` of the workload's requests have been sent; with
    ``hold``, its turns wait for it to answer again (see the module docstring)."""

    replica: int
    at_request: int
    fraction: float
    hold: bool = False

    @classmethod
    def at_fraction(cls, fraction: float, num_requests: int, replica: int = RESTARTED_REPLICA,
                    hold: bool = False) -> RestartPlan:
        """The plan for ``ceil(fraction x num_requests)`` requests, kept within 1..num_requests-1 so
        that at least one request is sent before and one after.

        Raises:
            ValueError: ``fraction`` not in (0, 1), or a workload of fewer than 2 requests.
        """
        check_restart(fraction, 2)
        if num_requests < 2:
            raise ValueError(f"--restart-replica-at needs a workload of 2 requests or more (it has {num_requests}): "
                             "one before the restart and one after")
        return cls(replica, min(num_requests - 1, max(1, math.ceil(fraction * num_requests))), fraction, hold)


@dataclass(frozen=True)
class RestartHook:
    """What the client needs to carry out a plan: ``restart(replica)`` stops and starts the server
    (blocking; raises when it does not come back), and the longest wait for its requests in flight
    to finish before it is stopped (``drain_timeout_s``, seconds)."""

    plan: RestartPlan
    restart: Callable[[int], None]
    drain_timeout_s: float


class Router:
    """Which server each request of a run goes to (single event loop, no locks): request ``k`` to
    replica ``k mod N``, a replica taken down for its restart skipped (round robin over the live
    ones); counts each replica's requests in flight."""

    def __init__(self, num_replicas: int, request_ids: Sequence[str], plan: RestartPlan | None = None) -> None:
        self.home = {rid: k % num_replicas for k, rid in enumerate(request_ids)}
        self.num_replicas = num_replicas
        self.plan = plan
        self.down: set[int] = set()
        self.in_flight = [0] * num_replicas
        self.sent = 0
        self.rerouted: list[str] = []
        self.began = False
        self._turn = 0

    def restart_due(self) -> bool:
        """True once, when the plan's request count has been sent: the replica is down from now on."""
        if self.plan is None or self.began or self.sent < self.plan.at_request:
            return False
        self.began = True
        self.down.add(self.plan.replica)
        return True

    def held(self, request_id: str) -> bool:
        """True while this request waits for its replica: the plan holds and that replica is down."""
        return self.plan is not None and self.plan.hold and self.home[request_id] in self.down

    def pick(self, request_id: str) -> int:
        """The replica this request is sent to now (counted as sent and in flight there)."""
        replica = self.home[request_id]
        if replica in self.down:
            live = [i for i in range(self.num_replicas) if i not in self.down]
            replica = live[self._turn % len(live)]
            self._turn += 1
            self.rerouted.append(request_id)
        self.sent += 1
        self.in_flight[replica] += 1
        return replica

    def done(self, replica: int) -> None:
        """A request sent to ``replica`` ended (ok or not)."""
        self.in_flight[replica] -= 1


async def restart_replica(router: Router, hook: RestartHook, t_run: float,
                          reconnect: Callable[[int], Awaitable[None]]) -> RestartEvent:
    """Steps 2-4 of the module docstring for ``hook.plan`` (the replica is already down,
    :meth:`Router.restart_due`); times in the event are seconds after ``t_run`` (perf_counter)."""
    replica = hook.plan.replica
    began = time.perf_counter() - t_run
    deadline = time.perf_counter() + hook.drain_timeout_s
    while router.in_flight[replica] and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
    stopped = time.perf_counter() - t_run
    try:
        await asyncio.to_thread(hook.restart, replica)
    except Exception as exc:  # noqa: BLE001 - any failure to come back is reported, the run ends as failed
        return RestartEvent(replica, hook.plan.at_request, began, stopped, None, tuple(router.rerouted), str(exc))
    back = time.perf_counter() - t_run
    await reconnect(replica)
    router.down.discard(replica)
    return RestartEvent(replica, hook.plan.at_request, began, stopped, back, tuple(router.rerouted))


def restart_figures(run: RunResult, meters: MeterDeltas | None) -> dict[str, float | None]:
    """A run's restart figures (empty without a restart): the restarted replica's hit rate from its
    counters since it answered again (``meters``), TTFT p50/p99 (s) and count of its successful
    requests sent after it was back, seconds it took no requests (``restart_down_s``) and requests
    sent elsewhere meanwhile (``restart_rerouted``)."""
    event = run.restart
    if event is None:
        return {}
    after = run.after_restart()
    ttft = Percentiles.of([r.ttft_s for r in after if r.ok and r.ttft_s is not None])
    return {"restart_hit_rate": meters.prefix_hit_rate if meters is not None else None,
            "restart_ttft_p50_s": ttft.p50 if ttft else None, "restart_ttft_p99_s": ttft.p99 if ttft else None,
            "restart_requests": float(sum(1 for r in after if r.ok)),
            "restart_down_s": event.down_s, "restart_rerouted": float(len(event.rerouted))}
