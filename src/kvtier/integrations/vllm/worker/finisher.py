"""A synchronous load's bookkeeping, run while the forward computes: :class:`Finisher`.

A synchronous load (:mod:`~.syncload`) copies a hit into the engine's blocks on the engine's thread,
before the forward of the step that scheduled it.  What it does after the copy (unpin, the policies'
touch, the load's events and counters, its receipt's facts: :meth:`LoadPath.finish
<kvtier.integrations.vllm.worker.loader.LoadPath.finish>`, about 0.2 ms per hit of 7 chunks with the
caches cold, ``scripts/hit_cost.py --prompt-tokens 1000 --parts``) is nothing the forward needs, so
the engine's thread hands it to this thread and goes on to the forward; the forward's kernels
release the GIL, so on a host with a core to spare the bookkeeping costs the hit nothing.  vLLM's
own offload also does a load's bookkeeping after the forward: its scheduler's ``complete_load``
runs in ``update_connector_output`` (vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py).

The step looks the same from outside: the worker waits for this thread (:meth:`Finisher.join`)
before its saves (a load's pins never hold back a save of its step), before it reports its index
changes, the requests' facts and its stats, before a reset order and at shutdown.  The blocks a
load could not fill are known before the hand-off (vLLM's load errors of the same step).

Bounded: at most :data:`MAX_PENDING` hand-offs wait (past that the engine's thread runs the
bookkeeping itself), and a join waits at most :data:`JOIN_WAIT_S` (then the step goes on and the
bookkeeping lands in a later step's report; every piece of it holds its own lock).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

log = logging.getLogger(__name__)

MAX_PENDING = 256
"""Most hand-offs waiting at once (a step's synchronous loads: one per request scheduled with a hit)."""
JOIN_WAIT_S = 5.0
"""Longest the engine's thread waits for the bookkeeping handed off (about 0.2 ms a load)."""


class Finisher:
    """One thread that runs what the engine's thread hands it, in order (:meth:`submit`), and lets
    the engine's thread wait until all of it ran (:meth:`join`).  Started at the first hand-off.

    Attributes:
        pending: hand-offs not run yet (read it to skip a :meth:`join` with nothing to wait for: the
            worker's every step does, so a step with no synchronous load calls nothing here).
    """

    def __init__(self, name: str = "kvtier-finish") -> None:
        self._name = name
        self._queue: SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = SimpleQueue()
        self._done = threading.Condition()
        self.pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the thread (here, at once, when closed or :data:`MAX_PENDING` wait).
        An exception it raises is logged, never raised here."""
        with self._done:
            inline = self._closed or self.pending >= MAX_PENDING
            if not inline:
                self.pending += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
        if inline:
            _call(fn, args)
        else:
            self._queue.put((fn, args))

    def join(self, timeout_s: float = JOIN_WAIT_S) -> bool:
        """Wait until everything handed off ran, ``timeout_s`` at most; whether it did."""
        if not self.pending:  # (read without the lock: only the engine's thread adds)
            return True
        with self._done:
            if self._done.wait_for(lambda: not self.pending, timeout_s):
                return True
        log.warning("kvtier: a synchronous load's bookkeeping did not end within %.1f s; the step goes on "
                    "and it is reported later", timeout_s)
        return False

    def close(self, timeout_s: float = JOIN_WAIT_S) -> None:
        """Run what is waiting (``timeout_s`` at most), then stop the thread; later hand-offs run inline."""
        self.join(timeout_s)
        with self._done:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args = item
            _call(fn, args)
            with self._done:
                self.pending -= 1
                if not self.pending:
                    self._done.notify_all()


def _call(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("kvtier: a synchronous load's bookkeeping failed")
