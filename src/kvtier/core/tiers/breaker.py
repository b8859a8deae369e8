"""A circuit breaker for a remote tier: stop calling a server that keeps failing, probe until back.

States (the numbers are the ``kvtier_tier_breaker_state`` gauge):

- ``CLOSED`` (0): calls go through; ``failure_threshold`` failures in a row open the breaker;
- ``OPEN`` (2): calls are refused at once (lookups miss, writes are skipped, both counted by the
  caller) until ``probe_interval_s`` has passed;
- ``HALF_OPEN`` (1): one caller at a time is let through as a probe; a success closes the
  breaker, a failure opens it for another ``probe_interval_s``.

Thread-safe.  Times come from ``time.monotonic``.
"""

from __future__ import annotations

import enum
import threading
import time


class BreakerState(enum.IntEnum):
    """Breaker state; the value is what the state gauge shows."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """See the module docstring.

    Args:
        failure_threshold: consecutive failures that open the breaker (> 0).
        probe_interval_s: seconds between probes while open (> 0).

    Raises:
        ValueError: a non-positive argument.
    """

    def __init__(self, failure_threshold: int, probe_interval_s: float) -> None:
        if failure_threshold <= 0 or probe_interval_s <= 0:
            raise ValueError("failure_threshold and probe_interval_s must be positive")
        self.failure_threshold = failure_threshold
        self.probe_interval_s = probe_interval_s
        self.state = BreakerState.CLOSED
        self.num_opened = 0
        self._failures = 0
        self._opened_at = 0.0
        self._down_since = 0.0  # time.monotonic() when it last opened from closed
        self._probing = False
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Whether a call may go through now (a ``True`` while not closed makes the caller the probe)."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            if self._probing or time.monotonic() - self._opened_at < self.probe_interval_s:
                return False
            self.state = BreakerState.HALF_OPEN
            self._probing = True
            return True

    def success(self) -> float | None:
        """The call that was allowed succeeded.

        Returns:
            the seconds the breaker was not closed, when this success closed it; else ``None``.
        """
        with self._lock:
            self._failures = 0
            self._probing = False
            if self.state is BreakerState.CLOSED:
                return None
            self.state = BreakerState.CLOSED
            return time.monotonic() - self._down_since

    def failure(self) -> None:
        """The call that was allowed failed (timeout, connection error, server error)."""
        with self._lock:
            self._failures += 1
            self._probing = False
            if self.state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
                if self.state is BreakerState.CLOSED:
                    self._down_since = time.monotonic()
                if self.state is not BreakerState.OPEN:
                    self.num_opened += 1
                self.state = BreakerState.OPEN
                self._opened_at = time.monotonic()
