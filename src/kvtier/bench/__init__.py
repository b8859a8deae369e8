"""kvtier bench: replay real traffic against an OpenAI-compatible server and say whether the cache helps.

Modules, in the order data flows:

* :mod:`~kvtier.bench.workload`: request and workload types, deterministic token blocks.
* :mod:`~kvtier.bench.trace`, :mod:`~kvtier.bench.prefix_repetition`, :mod:`~kvtier.bench.multi_round`:
  the three workloads, each deterministic under its seed.
* :mod:`~kvtier.bench.client`: the asynchronous streaming client (TTFT, ITL, end-to-end latency).
* :mod:`~kvtier.bench.results`: per-request results and summaries (p50/p90/p99, throughput).
* :mod:`~kvtier.bench.meters`: ``/metrics`` scraping and counter deltas; hit rates.
* :mod:`~kvtier.bench.verdict`: helping / hurting / no reuse from the three meters.
* :mod:`~kvtier.bench.arms`, :mod:`~kvtier.bench.compare`: start vLLM
  per arm and run the same workload against each.
* :mod:`~kvtier.bench.report`, :mod:`~kvtier.bench.plot`: table, JSON, TTFT CDF PNG, Markdown.
* :mod:`~kvtier.bench.demo`: the comparison ``make demo`` runs.

Nothing here imports vLLM: servers are separate processes.
"""
