"""The servers of one arm when ``bench compare --replicas N`` runs N of them side by side.

An operator who outgrows one engine runs N replicas behind a load balancer; without session
affinity, a conversation's next turn lands on any replica.  ``--replicas N`` reproduces that:
every arm starts N servers with the same configuration (same model, engine cache, connector
config, core pinning), the client sends request ``k`` of the workload to replica ``k mod N``
(:class:`~kvtier.bench.client.ClientOptions`), and each replica's ``/metrics`` is scraped before
and after the workload.

Figures: the arm's hit rate is the sum of the replicas' counter deltas (tokens), its TTFTs the
percentiles over every request; per replica, the same figures over its own counters and requests
(:func:`replica_figures`).  Round robin sends each replica every N-th request, so a prompt that
comes back usually lands on another replica than the one that computed it: only a tier the
replicas share (kvtier's ``redis`` and ``s3`` tiers) can serve it there.

What each replica holds of its own (:func:`replica_specs`): its process's memory (kvtier's cpu
tier, vLLM's native CPU offload tier: each server allocates its own, as on separate hosts) and
kvtier's disk tier: replica ``i`` gets ``<disk_path>/r<i>``, a local disk per host (docs/deploy.md:
"give each replica its own directory").  What they share is what the arm names as shared: the
``redis_url`` server and key prefix, the ``s3_bucket`` and key prefix, and ExampleConnector's
``shared_storage_path`` (a directory vLLM's example shares between instances by design).

Cores (:func:`replica_cores`): vLLM's CPU backend binds a server's OpenMP compute threads to the
host's cores minus the reserved ones, the same cores for every server (vllm/utils/ompmultiprocessing.py,
v0.32.0, ``VLLM_CPU_OMP_THREADS_BIND=auto``), so N replicas on one host would all compute on one set
of cores and leave the rest idle.  Each replica gets its own slice of this process's cores instead
(``VLLM_CPU_OMP_THREADS_BIND``), as separate hosts would, unless the spec or the environment already
sets a binding or the spec runs tensor parallel.  Every arm of a run gets the same slices.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtier.bench.meters import MeterDeltas, MetricsSnapshot, deltas, scrape
from kvtier.bench.results import RunResult
from kvtier.core.errors import ServerStartError
from kvtier.launch.serve import Server, ServerSpec

STORAGE_KEYS = ("disk_path",)
"""``kv_connector_extra_config`` keys naming a directory a connector writes as its host's own."""

REPLICA_FIGURE_KEYS = ("prefix_hit_rate", "engine_hit_rate", "external_hit_rate", "external_hit_tokens",
                       "ttft_p50_s", "ttft_p99_s", "num_requests")


def replica_log_paths(log_path: Path, replicas: int) -> list[Path]:
    """Server log paths: ``log_path`` itself for one replica, ``<stem>-r<i><suffix>`` for several."""
    if replicas == 1:
        return [log_path]
    return [log_path.with_name(f"{log_path.stem}-r{i}{log_path.suffix}") for i in range(replicas)]


def replica_cores(replicas: int, reserved_per_replica: int, cores: Sequence[int] | None = None) -> list[str] | None:
    """Each replica's ``VLLM_CPU_OMP_THREADS_BIND`` value: ``cores`` (this process's, by default)
    split into ``replicas`` equal runs after leaving ``reserved_per_replica`` free per replica (the
    scheduler's core, as vLLM reserves one), at least one core each, wrapping around when there are
    more replicas than cores; e.g. cores 0-1, 2 replicas, 1 reserved: ``["0", "1"]``; cores 0-63:
    ``["0-30", "31-61"]``.  ``None`` for one replica (vLLM's own choice stands)."""
    if replicas <= 1:
        return None
    ids = sorted(os.sched_getaffinity(0) if cores is None else cores)
    per = max(1, (len(ids) - replicas * max(0, reserved_per_replica)) // replicas)
    out = []
    for i in range(replicas):
        mine = [ids[(i * per + j) % len(ids)] for j in range(per)]
        out.append(str(mine[0]) if per == 1 else ",".join(map(str, mine)))
    return out


def _binds_itself(spec: ServerSpec) -> bool:
    """The spec (or this environment) chooses its own cores, or runs tensor parallel (one list per rank)."""
    args = " ".join(spec.extra_args)
    return ("VLLM_CPU_OMP_THREADS_BIND" in spec.env or "VLLM_CPU_OMP_THREADS_BIND" in os.environ
            or "--tensor-parallel-size" in args or "-tp" in spec.extra_args)


def replica_specs(spec: ServerSpec, replicas: int) -> list[ServerSpec]:
    """The ``replicas`` servers' specs of one arm and run: ``spec`` itself for one replica; for
    several, the same spec each, with every directory of :data:`STORAGE_KEYS` in its connector's
    ``kv_connector_extra_config`` moved to ``<dir>/r<i>`` for replica ``i`` (see the module
    docstring), and, for several, replica ``i``'s ``VLLM_CPU_OMP_THREADS_BIND`` set to its slice of
    :func:`replica_cores` (unless the spec binds its own cores).  Shared servers, buckets and key
    prefixes are left as they are.

    Raises:
        ValueError: ``replicas`` is below 1.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, not {replicas}")
    if replicas == 1:
        return [spec]
    config = spec.kv_transfer_config or {}
    extra = config.get("kv_connector_extra_config") or {}
    own = [k for k in STORAGE_KEYS if extra.get(k)]
    binds = None if _binds_itself(spec) else replica_cores(replicas, spec.reserved_cpus or 0)
    out = []
    for i in range(replicas):
        mine = spec
        if own:
            moved = {**extra, **{k: str(Path(str(extra[k])) / f"r{i}") for k in own}}
            mine = dataclasses.replace(mine, kv_transfer_config={**config, "kv_connector_extra_config": moved})
        if binds is not None:
            mine = dataclasses.replace(mine, env={**spec.env, "VLLM_CPU_OMP_THREADS_BIND": binds[i]})
        out.append(mine)
    return out


class ReplicaSet:
    """N ``vllm serve`` children, started together and stopped together.

    Attributes:
        servers: in replica order; startup_s: seconds until the slowest answered.
    """

    def __init__(self, specs: ServerSpec | Sequence[ServerSpec], log_paths: Sequence[Path]) -> None:
        """``specs``: one spec for every server, or one per server (:func:`replica_specs`), in the
        order of ``log_paths``.

        Raises:
            ValueError: no log path, or a different number of specs and log paths.
        """
        if not log_paths:
            raise ValueError("a replica set needs at least one server")
        per_server = [specs] * len(log_paths) if isinstance(specs, ServerSpec) else list(specs)
        if len(per_server) != len(log_paths):
            raise ValueError(f"{len(per_server)} server specs for {len(log_paths)} log paths")
        self.servers = [Server(s, path) for s, path in zip(per_server, log_paths, strict=True)]
        self.startup_s = 0.0
        self.log_paths = list(log_paths)
        self.restarts: dict[int, tuple[MetricsSnapshot, MetricsSnapshot]] = {}
        self._restarting: set[int] = set()

    @property
    def urls(self) -> tuple[str, ...]:
        """The servers' root URLs, in replica order."""
        return tuple(s.base_url for s in self.servers)

    def _name(self, i: int) -> str:
        return "the vLLM server" if len(self.servers) == 1 else f"replica {i}"

    def start(self, timeout_s: float = 900.0) -> None:
        """Launch every server, then wait for each (they start concurrently).

        Raises:
            ServerStartError: one of them exited or did not answer within ``timeout_s`` seconds
                (the message names the replica and its log; the others are stopped by :meth:`stop`).
        """
        for server in self.servers:
            server.launch()
        for i, server in enumerate(self.servers):
            try:
                server.wait_ready(timeout_s)
            except ServerStartError as exc:
                raise ServerStartError(str(exc) if len(self.servers) == 1 else f"replica {i}: {exc}") from None
        self.startup_s = max(s.startup_s for s in self.servers)

    def restart(self, i: int, timeout_s: float = 900.0) -> None:
        """Restart server ``i`` as an operator does (:mod:`kvtier.bench.restart`): scrape its
        ``/metrics``, stop it (SIGTERM, graceful: :meth:`Server.stop`), start the same spec on the
        same port, its log ``<stem>-restarted<suffix>`` beside the first, and scrape again once it
        answers; :attr:`restarts` ``[i]`` keeps the two scrapes (its counters start again from zero).
        While it restarts, :meth:`exit_reason` does not count its exit.

        Raises:
            ServerStartError: it did not answer within ``timeout_s`` seconds (or exited).
            MetricsError: a scrape failed.
        """
        old = self.servers[i]
        self._restarting.add(i)
        try:
            stopped = scrape(old.base_url, save_to=old.log_path.with_suffix(".metrics-restart-before.txt"))
            old.stop()
            new = Server(old.spec, old.log_path.with_name(f"{old.log_path.stem}-restarted{old.log_path.suffix}"),
                         port=old.port)
            self.servers[i] = new
            self.log_paths.append(new.log_path)
            try:
                new.start(timeout_s)
            except ServerStartError as exc:
                raise ServerStartError(f"replica {i}: {exc}") from None
            started = scrape(new.base_url, save_to=new.log_path.with_suffix(".metrics-restart-after.txt"))
            self.restarts[i] = (stopped, started)
        finally:
            self._restarting.discard(i)

    def exit_reason(self) -> str | None:
        """``None`` while every server runs (or is being restarted), else which one ended and how."""
        for i, server in enumerate(self.servers):
            if i in self._restarting:
                continue
            reason = server.exit_reason()
            if reason is not None:
                return reason if len(self.servers) == 1 else f"replica {i} {reason}"
        return None

    def scrape(self, suffix: str) -> list[MetricsSnapshot]:
        """Every server's ``/metrics``, the raw text saved beside its log as ``<log stem><suffix>``.

        Raises:
            MetricsError: a server did not answer or its text is not Prometheus format.
        """
        return [scrape(s.base_url, save_to=s.log_path.with_suffix(suffix)) for s in self.servers]

    def stop(self) -> None:
        """Stop every server (gracefully, concurrently: see :meth:`Server.stop`)."""
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            list(pool.map(lambda s: s.stop(), self.servers))


def replica_deltas(before: Sequence[MetricsSnapshot], after: Sequence[MetricsSnapshot],
                   restarts: Mapping[int, tuple[MetricsSnapshot, MetricsSnapshot]] | None = None) -> list[MeterDeltas]:
    """Per replica, the counters' increase between the two scrapes; for a replica restarted in
    between (``restarts[i]``: its scrapes before the stop and after the start,
    :meth:`ReplicaSet.restart`), the sum of the increases before and after the restart."""
    out = []
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if restarts and i in restarts:
            stopped, started = restarts[i]
            out.append(sum_deltas([deltas(b, stopped), deltas(started, a)]))
        else:
            out.append(deltas(b, a))
    return out


def sum_deltas(parts: Sequence[MeterDeltas]) -> MeterDeltas:
    """The arm's meters: every counter summed over its replicas (tokens and bytes add up)."""
    directions: dict[str, float] = {}
    for part in parts:
        for direction, value in part.kvtier_bytes.items():
            directions[direction] = directions.get(direction, 0.0) + value
    return MeterDeltas(prefix_queries=sum(p.prefix_queries for p in parts),
                       prefix_hits=sum(p.prefix_hits for p in parts),
                       external_queries=sum(p.external_queries for p in parts),
                       external_hits=sum(p.external_hits for p in parts), kvtier_bytes=directions)


def replica_figures(run: RunResult, meters: Sequence[MeterDeltas]) -> list[dict[str, float | None]]:
    """Per replica (in order): hit rates, external hit tokens, TTFT p50/p99 (s) and requests served
    of the requests sent to it (``None`` = not measured, e.g. no successful request)."""
    out: list[dict[str, float | None]] = []
    for i, m in enumerate(meters):
        summary = run.of_replica(i).summary()
        ttft = summary.ttft_s
        out.append({"prefix_hit_rate": m.prefix_hit_rate, "engine_hit_rate": m.engine_hit_rate,
                    "external_hit_rate": m.external_hit_rate or 0.0, "external_hit_tokens": m.external_hits,
                    "ttft_p50_s": ttft.p50 if ttft else None, "ttft_p99_s": ttft.p99 if ttft else None,
                    "num_requests": float(summary.num_ok)})
    return out
