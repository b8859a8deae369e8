"""Where the asynchronous loads' ends meet: :class:`Outcomes`, written by the loader threads
(:meth:`LoadPath.finish <kvtier.integrations.vllm.worker.loader.LoadPath.finish>`) and taken by the
engine's thread (:meth:`AsyncLoader.take <kvtier.integrations.vllm.worker.side.AsyncLoader.take>`).

Made once, with the loader (:class:`~kvtier.integrations.vllm.worker.loader.LoadPath`); a load's path
reads and writes its fields, it calls nothing here.  No vLLM import.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future


class Outcomes:
    """Loads ended on the loader threads (:meth:`LoadPath.finish`) and not yet taken by the engine's
    thread (:meth:`~.side.AsyncLoader.take`); every field is read and written under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ended = threading.Condition(self.lock)  # notified when a load ends (finish)
        self.finished: set[str] = set()  # requests whose load ended
        self.errors: set[int] = set()  # blocks that could not be filled (one group)
        self.failed: set[str] = set()  # requests whose load failed whole (several groups; also in finished)
        self.aborted: set[str] = set()  # requests vLLM finished before their load started (skipped)
        self.inflight: dict[str, Future[None]] = {}  # req_id -> its job, from submit to finish
        # ended loads not yet taken: req_id -> (store epoch at their start, blocks filled; None: failed whole)
        self.filled: dict[str, tuple[int, tuple[int, ...] | None]] = {}
        self.version = 0  # bumped as each load ends: unchanged since a take, a take has nothing
