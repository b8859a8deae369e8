"""What a probe of a configured shared tier found: one of four states, each with one sentence.

The probe is written once, :func:`kvtier.core.purge.probe_tier`, over the tier's blob store
(:meth:`~kvtier.core.tiers.blobs.BlobStore.ping`: connect and ask the server something harmless
within a short deadline, never a write; :meth:`~kvtier.core.tiers.blobs.BlobStore.failure`: what a
failed request means).  ``kvtier check`` and the serve-line pre-flight
(:func:`kvtier.integrations.vllm.preflight.probe_shared_tiers`) probe every configured shared tier
and warn: the tier may come up after the engine, and until then every lookup in it is a miss under
the breaker.

* ``reachable``: the server answered within the deadline;
* ``auth failed``: it answered, but refused the credentials;
* ``no bucket``: it answered, but the bucket (an object store's) does not exist: a 404 is an
  endpoint that is up, not an unreachable one;
* ``unreachable``: no answer (the host does not resolve, the port is closed, a TLS handshake or
  the deadline failed).
* ``wrong mode``: it answered, but is not the kind of server the configuration says (a Redis
  Cluster node named without ``redis_cluster``): many requests would be refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

ProbeState = Literal["reachable", "unreachable", "auth failed", "no bucket", "wrong mode"]

PROBE_DEADLINE_S = 2.0
"""Longest a probe may take, seconds, name resolution included (probes run on a daemon thread
that is abandoned at the deadline, since ``getaddrinfo`` has no timeout of its own)."""


@dataclass(frozen=True)
class ProbeResult:
    """What a probe of a shared tier found.

    Attributes:
        state: ``"reachable"``, ``"unreachable"``, ``"auth failed"`` or ``"no bucket"``.
        url: the tier's address with any password replaced by ``***``.
        detail: why, in a few words (``"connection refused"``, ``"PING answered in 1.2 ms"``).
        elapsed_s: seconds the probe took.
        auth_fix: what to change when the credentials are refused (the tier's own keys).
        address_key: the configuration key naming the address (said when it is unreachable).
    """

    state: ProbeState
    url: str
    detail: str
    elapsed_s: float
    auth_fix: str = "fix the tier's credentials"
    address_key: str = "the tier's address"
    kind: str = "shared tier"
    """What the tier is, in words (``node pool`` for the host's node tier)."""
    reach_fix: str = "open the network path"
    """The last fix offered when it is unreachable."""

    @property
    def message(self) -> str:
        """One sentence for the operator naming the state, the address and what to do."""
        kind, lookup = self.kind, f"every {self.kind.replace(' ', '-')} lookup"
        if self.state == "reachable":
            return f"{kind} {self.url} is reachable ({self.detail})"
        if self.state == "auth failed":
            return (f"{kind} {self.url}: auth failed ({self.detail}); vLLM would start, but {lookup} "
                    f"would be a miss: {self.auth_fix}")
        if self.state == "wrong mode":
            return f"{kind} {self.url} answers, but {self.detail}; vLLM would start, but many of its lookups and writes would fail"
        if self.state == "no bucket":
            return (f"{kind} {self.url}: the endpoint answers, but the bucket does not exist ({self.detail}); "
                    f"vLLM would start, but {lookup} would be a miss: create the bucket or fix its name")
        return (f"{kind} {self.url} is unreachable ({self.detail}); vLLM would start, but {lookup} "
                f"would be a miss until it answers: start it, fix {self.address_key}, or {self.reach_fix}")


def within_deadline(attempt: Callable[[float], ProbeResult], deadline_s: float, name: str,
                    late: Callable[[str, float], ProbeResult]) -> ProbeResult:
    """Run ``attempt(start)`` (``start``: its ``time.monotonic()`` start) on a daemon thread called
    ``name`` and return its result, or ``late(detail, elapsed_s)`` when it has not answered within
    ``deadline_s`` seconds (the thread is abandoned: name resolution has no timeout of its own)."""
    outcome: list[ProbeResult] = []
    start = time.monotonic()
    worker = threading.Thread(target=lambda: outcome.append(attempt(start)), name=name, daemon=True)
    worker.start()
    worker.join(deadline_s)
    if outcome:
        return outcome[0]
    return late(f"no answer within {deadline_s:g} s", time.monotonic() - start)
