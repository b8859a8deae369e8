"""Sweep a trace over cpu capacities × eviction policies.

Sizes are GiB (2^30 bytes) of KV, total across tensor-parallel ranks (as ``--kv-offloading-size``
in vLLM); a tier holds ``floor(GiB × 2^30 / chunk_bytes)`` chunks, where ``chunk_bytes =
kv_bytes_per_token × block_tokens``.  Work shared by all runs (the engine tier, chunk parents,
Belady's future) is computed once; runs are spread over worker processes (``fork``), longest
first.

Policy names are those of :func:`kvtier.core.policies.make_policy` (``default`` included) plus
``belady`` (offline optimum, simulator-only).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from kvtier.core.errors import UserError
from kvtier.core.policies import EvictionPolicy, available_policies, make_policy
from kvtier.core.policies.registry import DEFAULT_POLICY
from kvtier.simulate.belady import BeladyPolicy, TraceOracle
from kvtier.simulate.replay import ReplayCounts, chunk_parents, engine_prefix_hits, replay
from kvtier.simulate.trace import Trace

GIB = 1 << 30
OFFLINE_POLICIES = ("belady",)


def known_policies() -> list[str]:
    """Every name accepted in a sweep."""
    return available_policies() + list(OFFLINE_POLICIES)


def policy_label(name: str) -> str:
    """Display name: ``default`` shows what it resolves to."""
    return f"default ({DEFAULT_POLICY})" if name == "default" else name


def check_policies(names: Sequence[str]) -> None:
    """Raises ValueError naming the first unknown policy and listing the known ones."""
    for name in names:
        if name not in known_policies():
            raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(known_policies())}")


@dataclass(frozen=True)
class SweepSpec:
    """What to sweep.

    Attributes:
        chunk_bytes: bytes of KV per chunk (all layers, K and V, all ranks).
        engine_gib: the engine's own prefix-cache budget (tier 0), GiB.
        cpu_gibs: cpu-tier capacities to try, GiB.
        disk_gib: disk-tier capacity, GiB (0: no disk tier).
        policies: policy names, in report order.
        shared_gib: shared-tier (Redis/Valkey) capacity, GiB (0: none).
        admission: admission policy names of the disk and shared tiers.
    """

    chunk_bytes: int
    engine_gib: float
    cpu_gibs: tuple[float, ...]
    disk_gib: float
    policies: tuple[str, ...]
    shared_gib: float = 0.0
    admission: tuple[str, str] = ("all", "all")

    def chunks(self, gib: float) -> int:
        """Chunks that fit in ``gib`` GiB."""
        return int(gib * GIB / self.chunk_bytes + 1e-6)  # whole chunks; a capacity of exactly n chunks is n


@dataclass(frozen=True)
class SweepRow:
    """One (policy, cpu capacity) run.  Ratios are of prompt tokens (token) or lookup chunks."""

    policy: str
    cpu_gib: float
    cpu_chunks: int
    counts: ReplayCounts
    block_tokens: int
    chunk_bytes: int

    def tokens(self, chunks: int) -> int:
        return chunks * self.block_tokens

    @property
    def hit_chunks(self) -> int:
        c = self.counts
        return c.engine_hits + c.cpu_hits + c.disk_hits + c.shared_hits

    @property
    def token_hit_ratio(self) -> float:
        """Prompt tokens not recomputed (served by any tier) / prompt tokens."""
        return self.tokens(self.hit_chunks) / self.counts.prompt_tokens

    def tier_token_hit_ratio(self, tier: str) -> float:
        """The share of prompt tokens served by ``tier`` (``engine``, ``cpu``, ``disk`` or ``shared``)."""
        return self.tokens(getattr(self.counts, f"{tier}_hits")) / self.counts.prompt_tokens

    @property
    def chunk_hit_ratio(self) -> float:
        """Chunks served by any tier / chunks that could hit (full chunks before the last token)."""
        return self.hit_chunks / self.counts.lookup_chunks if self.counts.lookup_chunks else 0.0

    @property
    def bytes_loaded(self) -> int:
        """Bytes loaded into the engine from the cpu, disk and shared tiers."""
        return (self.counts.cpu_hits + self.counts.disk_hits + self.counts.shared_hits) * self.chunk_bytes


@dataclass(frozen=True)
class SweepResult:
    spec: SweepSpec
    engine_chunks: int
    disk_chunks: int
    rows: list[SweepRow]
    shared_chunks: int = 0

    def curve(self, policy: str) -> list[SweepRow]:
        """Rows of one policy, by increasing cpu capacity."""
        return sorted((r for r in self.rows if r.policy == policy), key=lambda r: r.cpu_gib)


# Shared with forked workers (set before the pool starts, read-only afterwards).
_SHARED: dict[str, Any] = {}


def _make(policy: str) -> EvictionPolicy:
    if policy == "belady":
        oracle = _SHARED.get("oracle")
        if oracle is None:
            oracle = _SHARED["oracle"] = TraceOracle(_SHARED["trace"])
        return BeladyPolicy(oracle)
    return make_policy(policy)


def _run(job: tuple[str, int]) -> ReplayCounts:
    policy, cpu_chunks = job
    return replay(_SHARED["trace"], _SHARED["engine_hits"], cpu_chunks, _SHARED["disk_chunks"],
                  lambda: _make(policy), _SHARED["parents"], shared_chunks=_SHARED["shared_chunks"],
                  admission=_SHARED["admission"])


_COST_RANK = {"adaptive": 0, "prefix-freq": 0, "default": 0, "belady": 1, "s3fifo": 2, "prefix-lru": 2}


def pool_size(workers: int, runs: int) -> int:
    """Processes for ``runs`` replays: ``workers`` (0: one per CPU core), never more than ``runs``
    (a pool starts every process at once: ``--workers 100000`` for 4 runs forked 100,000)."""
    return max(1, min(workers or os.cpu_count() or 1, runs))


def _ignore_sigint() -> None:
    """Pool initializer: the worker ignores SIGINT.  Ctrl-C reaches the whole foreground process
    group, and every worker's KeyboardInterrupt printed ``Process ForkPoolWorker-N:`` under the
    command's own exit; the parent alone takes it, and leaving its ``with`` block terminates the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def replay_map(fn: Callable[[Any], Any], jobs: Iterable[Any], workers: int) -> list[Any]:
    """``[fn(job) for job in jobs]`` on ``workers`` forked processes, results in ``jobs`` order;
    in this process, one job after another, when it runs other threads (:func:`can_fork`).

    The processes share the parent's module globals, as the replays need (they are forked before
    the executor starts its own thread), and leave Ctrl-C to the parent: on any exception in the
    parent (KeyboardInterrupt included) they are terminated at once rather than finishing their
    replays.  A process that dies (the kernel's out-of-memory killer, a signal) ends the wait:
    ``multiprocessing.Pool.map`` would wait forever for the job it held.

    Raises:
        UserError: a replay process died; the sentence says how to rerun in less memory.
    """
    if not can_fork():
        return [fn(job) for job in jobs]
    context = multiprocessing.get_context("fork")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_ignore_sigint)
    # submit + result, not Executor.map: map cancels its futures as an exception leaves it, and
    # Python 3.11's executor thread then fails setting the broken pool's error on a cancelled future
    # (InvalidStateError, printed as a traceback under the command's own exit)
    try:  # submit inside: the first submit forks the processes, and Ctrl-C there must terminate them too
        futures = [pool.submit(fn, job) for job in jobs]
        results = [future.result() for future in futures]
    except BrokenProcessPool as exc:
        _terminate(pool)
        raise UserError(f"a replay process of the {workers} started died before it finished (killed by a "
                        "signal, often the out-of-memory killer: each holds a copy of the trace's state); "
                        "rerun with fewer --workers (1 replays in this process) or a shorter trace") from exc
    except BaseException:
        _terminate(pool)
        raise
    pool.shutdown(wait=True)
    return results


def can_fork() -> bool:
    """Whether the replays may fork: the platform has ``fork`` and this process runs no thread but
    its main one.  A child forked while another thread holds a lock (an I/O buffer's, an allocator's)
    inherits it held and can block forever on its first use: Python 3.12 warns of it ("This process
    is multi-threaded, use of fork() may lead to deadlocks in the child"), and a replay forked from a
    pytest-xdist worker (whose execnet I/O thread runs) hung so.  ``kvtier simulate`` runs single-
    threaded; a program that calls the sweep from a threaded process gets its replays one by one."""
    return "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1


TERMINATE_GRACE_S = 5.0
"""How long :func:`_terminate` waits for SIGTERMed replay processes before it SIGKILLs those left."""


def _terminate(pool: ProcessPoolExecutor) -> None:
    """Stop ``pool``'s processes now (Python 3.14's ``terminate_workers``; before it, the executor's
    own process table); the jobs not done fail as a broken pool's do, and nobody waits for them.

    Bounded: a process still alive ``TERMINATE_GRACE_S`` after its SIGTERM is SIGKILLed (one forked
    just as the SIGTERM came can lose it, and the executor's thread then joined it forever: Ctrl-C to
    ``simulate`` printed its line and never exited), and the executor's thread is joined before this
    returns, so that Python 3.11's exit hook does not wake it through a pipe it is closing (``OSError:
    [Errno 9] Bad file descriptor`` under the command's own exit)."""
    processes: list[Any] = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)  # read now: shutdown() forgets it
    stop = getattr(pool, "terminate_workers", None)
    if stop is not None:
        stop()
    else:
        for process in processes:
            process.terminate()
        pool.shutdown(wait=False)  # the executor's thread sees them gone and fails the jobs left
    pending = [process.sentinel for process in processes]
    deadline = time.monotonic() + TERMINATE_GRACE_S
    while pending and (left_s := deadline - time.monotonic()) > 0:
        ready = multiprocessing.connection.wait(pending, timeout=left_s)
        pending = [sentinel for sentinel in pending if sentinel not in ready]
    for process in processes:
        if process.sentinel in pending:
            process.kill()
    if manager is not None:
        manager.join(timeout=TERMINATE_GRACE_S)


def run_sweep(trace: Trace, spec: SweepSpec, workers: int = 0) -> SweepResult:
    """Replay ``trace`` for every (policy, cpu capacity) of ``spec``.

    Args:
        trace: the trace.
        spec: capacities and policies (names checked with :func:`check_policies`).
        workers: processes, at most one per run (:func:`pool_size`); 0 picks ``min(os.cpu_count(),
            runs)``; 1 runs in this process.

    Returns:
        rows in ``spec`` order (capacity-major, then policy).

    Raises:
        ValueError: unknown policy name.
    """
    check_policies(spec.policies)
    engine_chunks = spec.chunks(spec.engine_gib)
    disk_chunks = spec.chunks(spec.disk_gib)
    _SHARED.clear()
    _SHARED.update(trace=trace, engine_hits=engine_prefix_hits(trace, engine_chunks),
                   disk_chunks=disk_chunks, parents=chunk_parents(trace),
                   shared_chunks=spec.chunks(spec.shared_gib), admission=spec.admission)
    if "belady" in spec.policies:
        _SHARED["oracle"] = TraceOracle(trace)
    jobs = [(policy, spec.chunks(gib)) for gib in spec.cpu_gibs for policy in spec.policies]
    # Slowest policies first, so the last job to finish is a short one.
    order = sorted(range(len(jobs)), key=lambda i: (_COST_RANK.get(jobs[i][0], 3), -jobs[i][1]))
    workers = pool_size(workers, len(jobs))
    if workers > 1:
        done = replay_map(_run, [jobs[i] for i in order], workers)
    else:
        done = [_run(jobs[i]) for i in order]
    counts: list[ReplayCounts | None] = [None] * len(jobs)
    for i, result in zip(order, done):
        counts[i] = result
    rows = []
    for (policy, cpu_chunks), job_counts, gib in zip(jobs, counts, [g for g in spec.cpu_gibs for _ in spec.policies]):
        assert job_counts is not None
        rows.append(SweepRow(policy, gib, cpu_chunks, job_counts, trace.block_tokens, spec.chunk_bytes))
    _SHARED.clear()
    return SweepResult(spec, engine_chunks, disk_chunks, rows, spec.chunks(spec.shared_gib))
