"""Reuse-distance histogram of a trace, and the traffic regime it puts the trace in.

Reuse distance (stack distance, Mattson et al., "Evaluation techniques for storage hierarchies",
IBM Systems Journal 9(2), 1970) of an access to a chunk: the number of *distinct* chunks used
since its previous use.  An LRU tier of ``c`` chunks hits exactly the accesses whose distance is
below ``c`` (ignoring the prefix rule), so the histogram says which tier sizes help at all.
Distances are given as shares of the trace's footprint (distinct chunks), computed exactly with
a Fenwick tree over access positions (O(accesses × log accesses)).

Regimes (:func:`regime`), from the histogram:

- ``scan``: at least 60 % of chunk uses are first uses: most KV is never read again.
- ``cycling``: half or more of the reuses fall in one bucket at or above 10 % of the footprint:
  a working set that comes round at one distance (LRU's worst case for tiers just below it).
- ``short-reuse``: 80 % of reuses within 5 % of the footprint: a small tier catches most.
- ``long-reuse``: reuses spread over distances: each size step buys a little more.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.simulate.trace import Trace

BUCKETS_PCT = (1, 2, 5, 10, 20, 50, 100)
"""Upper edges of the distance buckets, % of the footprint."""


@dataclass(frozen=True)
class ReuseHistogram:
    """Counts of chunk uses by reuse distance.

    Attributes:
        footprint: distinct chunks in the trace.
        first_uses: uses of a chunk never used before.
        buckets: reuses per bucket, shape ``[len(BUCKETS_PCT)]``: bucket ``i`` holds distances in
            ``[BUCKETS_PCT[i-1] %, BUCKETS_PCT[i] %)`` of the footprint.
    """

    footprint: int
    first_uses: int
    buckets: tuple[int, ...]

    @property
    def uses(self) -> int:
        return self.first_uses + sum(self.buckets)

    def shares(self) -> list[float]:
        """First-use share, then each bucket's share of all uses."""
        total = max(self.uses, 1)
        return [self.first_uses / total] + [b / total for b in self.buckets]


def reuse_distances(trace: Trace) -> list[int | None]:
    """Exact reuse distance of every full-chunk use, in trace order (requests in arrival order, each
    request's chunks in prompt order): the distinct chunks used since the previous use of the same
    chunk, ``None`` for a first use.  Shape ``[trace.num_chunks]``; O(uses × log uses) with a
    Fenwick tree over use positions.  Shared by :func:`reuse_histogram` and the hierarchy model
    (:mod:`kvtier.simulate.hierarchy`)."""
    accesses = [key for keys in trace.chunk_keys for key in keys]
    n = len(accesses)
    tree = [0] * (n + 1)  # Fenwick tree: 1 at the position of each chunk's latest use

    def add(i: int, delta: int) -> None:
        i += 1
        while i <= n:
            tree[i] += delta
            i += i & -i

    def prefix(i: int) -> int:  # sum over positions < i
        total = 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    out: list[int | None] = []
    last: dict[int, int] = {}
    latest = 0  # distinct chunks seen so far (= prefix(n))
    for pos, key in enumerate(accesses):
        before = last.get(key)
        if before is None:
            latest += 1
            out.append(None)
        else:
            out.append(latest - prefix(before + 1))  # distinct chunks used after `before`
            add(before, -1)
        add(pos, 1)
        last[key] = pos
    return out


def reuse_histogram(trace: Trace) -> ReuseHistogram:
    """Exact reuse distances of every full-chunk use, bucketed (see the module docstring)."""
    footprint = trace.num_unique_chunks
    edges = [max(1, footprint * pct // 100) for pct in BUCKETS_PCT]
    buckets = [0] * len(edges)
    first = 0
    for distance in reuse_distances(trace):
        if distance is None:
            first += 1
            continue
        for i, edge in enumerate(edges):
            if distance < edge or i == len(edges) - 1:
                buckets[i] += 1
                break
    return ReuseHistogram(footprint, first, tuple(buckets))


def regime(hist: ReuseHistogram) -> str:
    """One of ``scan``, ``cycling``, ``short-reuse``, ``long-reuse`` (see the module docstring)."""
    reuses = sum(hist.buckets)
    if hist.uses == 0 or hist.first_uses >= 0.6 * hist.uses or reuses == 0:
        return "scan"
    far = [b for pct, b in zip(BUCKETS_PCT, hist.buckets) if pct > 10]
    if far and max(far) >= 0.5 * reuses:
        return "cycling"
    near = sum(b for pct, b in zip(BUCKETS_PCT, hist.buckets) if pct <= 5)
    return "short-reuse" if near >= 0.8 * reuses else "long-reuse"


def histogram_lines(hist: ReuseHistogram) -> list[str]:
    """The histogram as text lines (fits 80 columns): one bar per bucket."""
    labels = ["first use"] + [f"< {pct}%" if i == 0 else f"{BUCKETS_PCT[i - 1]}-{pct}%"
                              for i, pct in enumerate(BUCKETS_PCT)]
    lines = [f"reuse distance (% of {hist.footprint:,} distinct chunks), share of {hist.uses:,} chunk uses:"]
    for label, share in zip(labels, hist.shares()):
        lines.append(f"  {label:>10} {share:6.1%} " + "#" * round(share * 50))
    lines.append(f"  regime: {regime(hist)}")
    return lines
