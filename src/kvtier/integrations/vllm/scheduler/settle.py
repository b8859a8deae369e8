"""Keep an idle engine stepping until the workers' numbers are true: pins released, first report in.

vLLM moves a connector's numbers (``KVConnectorStats``, the worker → scheduler metadata) only on
engine steps, and an engine with no request does not step.  Without help, the gauges of
``/metrics`` freeze at the last busy step: ``kvtier_pinned_chunks`` kept showing the pins of disk
writes still in flight when the last request ended (read 5 and 2 for over a minute after a run),
and ``kvtier_capacity_bytes`` read 0 after boot until the first request.

vLLM 0.32 keeps the engine loop stepping while the scheduler-side connector's
``has_pending_push_work()`` is true (vllm/v1/core/sched/scheduler.py ``Scheduler.has_requests``;
vLLM's Mooncake store connector uses it the same way, to release its pinned saves).  kvtier says
so while

- no worker has reported yet since start (one step delivers the first full snapshot of each
  rank's index and its capacities), or
- a worker's last report said it was busy (chunks pinned by loads or disk writes in flight), or
- KV events wait to be published (vLLM publishes a connector's events only on steps:
  :mod:`kvtier.integrations.vllm.scheduler.events`, rate-limited after a restart),

and at most :data:`SETTLE_S` seconds from the step where the engine ran out of scheduled work,
so a pin that never ends (a bug) cannot keep the engine spinning.  Steps taken only to settle
sleep :data:`IDLE_STEP_S` in :meth:`Settle.step`, so settling costs about 100 empty steps a
second for as long as the disk writes take.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvtier.integrations.vllm.protocol import KVTierWorkerMeta

log = logging.getLogger(__name__)

SETTLE_S = 10.0  # longest an idle engine keeps stepping for kvtier, seconds
IDLE_STEP_S = 0.01  # pause of a step taken only to settle, seconds


class Settle:
    """Whether the engine should keep stepping for kvtier's sake (see the module docstring).

    Args:
        settle_s: longest the engine steps with no scheduled work, seconds.
        clock: monotonic clock (seconds).
        more: other work that wants steps (the KV events still to publish,
            :meth:`~kvtier.integrations.vllm.scheduler.events.KVEventTracker.pending`), within the same bound.
    """

    def __init__(self, settle_s: float = SETTLE_S, clock: Callable[[], float] = time.monotonic,
                 more: Callable[[], bool] | None = None) -> None:
        self.settle_s = settle_s
        self._more = more
        self._clock = clock
        self._reported = False
        self._busy: set[int] = set()  # ranks whose last report said busy
        self._idle_since: float | None = None  # first step with no scheduled work, after the last busy one
        self._gave_up = False

    def observe(self, meta: object) -> None:
        """Fold one step's worker → scheduler metadata (any type; only kvtier's is read)."""
        if not isinstance(meta, KVTierWorkerMeta):
            return
        for rank, report in meta.ranks.items():
            self._reported = True
            if report.busy:
                self._busy.add(rank)
            else:
                self._busy.discard(rank)

    def wanted(self) -> bool:
        """The workers' numbers are not settled yet: the first report is missing or a rank is busy."""
        return not self._reported or bool(self._busy) or (self._more is not None and self._more())

    def pending(self) -> bool:
        """``has_pending_push_work``: settle wanted and the idle window not spent."""
        if not self.wanted():
            return False
        if self._idle_since is not None and self._clock() - self._idle_since > self.settle_s:
            if not self._gave_up:
                self._gave_up = True
                what = ("no worker has reported yet" if not self._reported
                        else f"ranks {sorted(self._busy)} still report pinned chunks" if self._busy
                        else "KV events still wait to be published")
                log.warning("kvtier: %s %.0f s after the engine went idle; kvtier's gauges may be stale until "
                            "the next request", what, self.settle_s)
            return False
        return True

    def step(self, idle: bool) -> None:
        """Called once per engine step: ``idle`` when the step scheduled no token and kvtier knows
        of no request (none waiting for a load either).  A step taken only to settle pauses
        :data:`IDLE_STEP_S` so that settling does not spin a core; a step with work never does."""
        if not idle:
            self._idle_since = None
            self._gave_up = False
            return
        if self._idle_since is None:
            self._idle_since = self._clock()
        if self.wanted() and not self._gave_up:
            time.sleep(IDLE_STEP_S)
