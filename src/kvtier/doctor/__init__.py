"""``kvtier doctor``: is KV offload helping on a live vLLM server?

Flow: :func:`~kvtier.tools.scrape.fetch_metrics` ``/metrics`` twice ``interval`` seconds apart →
:func:`~kvtier.doctor.snapshot.parse_metrics` (prometheus_client's parser) →
:func:`~kvtier.doctor.meters.measure` (hit rate, external hit rate, TTFT p50/p99 from bucket
deltas; with kvtier's receipt metrics the miss reasons, sizes and prefill saved of
:mod:`kvtier.doctor.causes`) and :func:`~kvtier.doctor.meters.allocation` (offload GiB vLLM reports) →
:func:`~kvtier.doctor.verdict.diagnose`.  Read-only: nothing is sent to the server but two GETs.
Errors: :class:`kvtier.core.errors.UserError` for unreachable URLs and non-vLLM metrics.
"""

from kvtier.doctor.meters import Allocation, Meters, SharedTier, allocation, measure
from kvtier.doctor.quantile import histogram_quantile
from kvtier.doctor.snapshot import Snapshot, parse_metrics
from kvtier.doctor.verdict import Check, Diagnosis, diagnose

__all__ = ["Allocation", "Check", "Diagnosis", "Meters", "SharedTier", "Snapshot", "allocation", "diagnose",
           "histogram_quantile", "measure", "parse_metrics"]
