"""Deferred saves as the scheduler sees them: which are still running on some rank, and which
finished requests therefore keep their blocks (``async_saves``; :mod:`kvtier.integrations.vllm.worker.saves`).

A deferred save job gets a number when it is shipped (:meth:`DeferredSaves.ship`); every rank
reports the number once the save ended there (``RankReport.saves_ended``, folded by
:meth:`DeferredSaves.ended`).  At ``request_finished`` a request with a number not yet reported by
every rank is held (:meth:`DeferredSaves.finish` → True: vLLM keeps its blocks) and named in the
next step's ``KVTierMetadata.held``, so that each rank reports it in ``finished_sending`` once its
own saves of it ended; one whose saves all ended is freed at once.  A preempted request's numbers
are forgotten (:meth:`DeferredSaves.forget`): the workers wait for its saves before the forward
that may reuse its blocks.  vLLM's offloading connector tracks its store jobs the same way
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py, ``get_finished``).

Bounds: one entry per deferred job not yet reported by every rank; a finished request's entries
go at once (its hold is then the workers' to end).
"""

from __future__ import annotations

from collections.abc import Iterable


class DeferredSaves:
    """Deferred save jobs not yet reported ended by every rank (see the module docstring).

    Args:
        tp_size: tensor-parallel ranks, each of which reports every job.
    """

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self._next = 0
        self._open: dict[int, tuple[str, set[int]]] = {}  # seq -> (request, ranks yet to report it)
        self._by_req: dict[str, set[int]] = {}
        self._held: set[str] = set()  # finished and held, for the next step's metadata

    def ship(self, req_id: str) -> int:
        """A deferred save job of ``req_id`` is shipped: its number."""
        seq, self._next = self._next, self._next + 1
        self._open[seq] = (req_id, set(range(self.tp_size)))
        self._by_req.setdefault(req_id, set()).add(seq)
        return seq

    def ended(self, rank: int, seqs: Iterable[int]) -> None:
        """``rank`` reports the jobs ``seqs`` ended (numbers not open any more are ignored)."""
        for seq in seqs:
            entry = self._open.get(seq)
            if entry is None:
                continue
            req_id, ranks = entry
            ranks.discard(rank)
            if not ranks:
                del self._open[seq]
                left = self._by_req.get(req_id)
                if left is not None:
                    left.discard(seq)
                    if not left:
                        del self._by_req[req_id]

    def running(self, req_id: str) -> bool:
        """A deferred save of ``req_id`` has not been reported ended by every rank."""
        return bool(self._by_req.get(req_id))

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s numbers (preempted: the workers wait for its saves in ``handle_preemptions``)."""
        for seq in self._by_req.pop(req_id, ()):
            self._open.pop(seq, None)

    def finish(self, req_id: str) -> bool:
        """``request_finished``: True (hold the blocks; named in the next ``held``) when a save runs."""
        running = self.running(req_id)
        self.forget(req_id)
        if running:
            self._held.add(req_id)
        return running

    def take_held(self) -> frozenset[str]:
        """The requests held since the last call (for this step's metadata)."""
        held, self._held = frozenset(self._held), set()
        return held
