"""``CauseLimiter``: at most one log line per failure cause per interval, a new cause at once.

A failing tier fails every call (a full disk: every chunk write; a dead server: every batch), and
one warning line per call floods the log; one line per interval for all causes hides the moment
the cause changes ("No space left on device" turning into "Read-only file system"; "connection
refused" into "HTTP 404 NoSuchBucket").  The limiter keys its interval by the cause's text: a cause
not seen within the interval is logged at once, the same cause again at most once per interval,
and the line that is logged learns how many of that cause were held back since its last one.

The cause must be short and free of per-call detail (no chunk key, no object path, no timing),
or every call is a "new" cause.  Thread-safe; times come from ``time.monotonic``.
"""

from __future__ import annotations

import logging
import threading
import time

WARNING_INTERVAL_S = 10.0
"""Default seconds between two lines of the same cause."""


class CauseLimiter:
    """See the module docstring.

    Args:
        interval_s: seconds between two lines of the same cause (>= 0; 0 logs every one).
        max_causes: distinct causes remembered; past it the one logged longest ago is forgotten
            (its next occurrence is logged at once).

    Raises:
        ValueError: a negative ``interval_s`` or a ``max_causes`` below 1.
    """

    def __init__(self, interval_s: float = WARNING_INTERVAL_S, max_causes: int = 32) -> None:
        if interval_s < 0 or max_causes < 1:
            raise ValueError("interval_s must be >= 0 and max_causes >= 1")
        self.interval_s = interval_s
        self.max_causes = max_causes
        self._seen: dict[str, tuple[float, int]] = {}  # cause -> (monotonic time of its last line, held back since)
        self._lock = threading.Lock()

    def admit(self, cause: str) -> int | None:
        """Whether a line for ``cause`` may be logged now.

        Returns:
            ``None``: held back (counted, told to the next line of this cause); else the number of
            lines of this cause held back since its last logged one (0 for a new cause).
        """
        now = time.monotonic()
        with self._lock:
            last = self._seen.get(cause)
            if last is not None and now - last[0] < self.interval_s:
                self._seen[cause] = (last[0], last[1] + 1)
                return None
            self._seen.pop(cause, None)  # re-inserted last: the dict stays in order of last line
            if len(self._seen) >= self.max_causes:
                del self._seen[next(iter(self._seen))]
            self._seen[cause] = (now, 0)
            return last[1] if last is not None else 0

    def forget(self) -> None:
        """Forget every cause (the next line of any is logged at once): the fault ended."""
        with self._lock:
            self._seen.clear()


def held_back(count: int) -> str:
    """The suffix of a line that :meth:`CauseLimiter.admit` let through with ``count`` lines of its
    cause held back: ``"; 12 more like it since the last such line"`` ("" for 0)."""
    return f"; {count} more like it since the last such line" if count else ""



def warn_unusable(limiter: CauseLimiter, logger: logging.Logger, where: str, chunk: str, reason: str,
                  action: str) -> None:
    """Log ``"{where}: value of chunk {chunk} is unusable ({reason}); {action}"`` at WARNING, at most
    once per ``reason`` per ``limiter``'s interval (the tier's own limiter: a tier whose values all
    fail verification, written by another format or secret or on a bad disk, logs one line per
    cause, not one per chunk read; each is still counted by the tier), naming how many were held
    back.  ``chunk`` (a key's hex, a file's path) is left out of the cause where ``reason`` names it."""
    if (unlogged := limiter.admit(reason.replace(chunk, "…"))) is None:
        return
    logger.warning("%s: value of chunk %s is unusable (%s); %s (at most one such line per cause per %.0f s%s)",
                   where, chunk, reason, action, limiter.interval_s, held_back(unlogged))
