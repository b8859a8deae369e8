"""``prefix-repetition``: N distinct shared prefixes of P tokens, cycled, each with a fresh suffix.

Same knobs and defaults as vLLM's ``prefix_repetition`` benchmark dataset
(vllm/benchmarks/datasets: ``PrefixRepetitionRandomDataset``, defaults prefix 256, suffix 256,
10 prefixes, output 128).  One difference: vLLM shuffles the requests; here request ``i`` uses
prefix ``i mod N`` (round robin), the order that defeats an LRU cache holding fewer than ``N``
prefixes, so the run forces evictions as soon as ``N * P`` tokens exceed the engine's cache.
``shuffle=True`` gives a seeded shuffled order instead.

Request ``i``::

    [ prefix[i mod N] (P tokens) | suffix[i] (S tokens, never repeated) ]
"""

from __future__ import annotations

import numpy as np

from kvtier.bench.workload import (
    DOMAIN_PREFIX,
    DOMAIN_SUFFIX,
    BenchRequest,
    TokenSpace,
    Workload,
    WorkloadError,
    check_at_least,
)

DEFAULT_PREFIX_LEN = 256
DEFAULT_SUFFIX_LEN = 256
DEFAULT_NUM_PREFIXES = 10
DEFAULT_OUTPUT_LEN = 128


MIN_REQUEST_RATE = 0.001
"""Slowest ``--request-rate`` accepted, requests/s: one request every 1,000 s."""
MAX_REQUEST_RATE = 1_000_000.0
"""Fastest ``--request-rate`` accepted, requests/s: past any server; faster is closed loop's job."""


def check_prefix_repetition(*, num_requests: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                            output_len: int, request_rate: float | None) -> None:
    """Check the knobs of :func:`prefix_repetition_workload` (same meanings) without building it.

    Raises:
        WorkloadError: a knob is out of range.
    """
    check_at_least((("--num-requests", num_requests, 1), ("--prefix-len", prefix_len, 0),
                    ("--suffix-len", suffix_len, 0), ("--num-prefixes", num_prefixes, 1),
                    ("--output-len", output_len, 1)))
    if prefix_len + suffix_len == 0:
        raise WorkloadError("--prefix-len and --suffix-len are both 0; give the prompt at least one token")
    if request_rate is not None and not MIN_REQUEST_RATE <= request_rate <= MAX_REQUEST_RATE:  # nan fails both
        raise WorkloadError(f"--request-rate {request_rate} must be from {MIN_REQUEST_RATE:g} to {MAX_REQUEST_RATE:,.0f} "
                            "requests per second; omit it for a closed loop")


def prefix_repetition_workload(tokens: TokenSpace, *, num_requests: int, prefix_len: int = DEFAULT_PREFIX_LEN,
                               suffix_len: int = DEFAULT_SUFFIX_LEN, num_prefixes: int = DEFAULT_NUM_PREFIXES,
                               output_len: int = DEFAULT_OUTPUT_LEN, request_rate: float | None = None,
                               shuffle: bool = False) -> Workload:
    """Build the workload.

    Args:
        tokens: token space (seed, vocabulary range).
        num_requests: requests in total.
        prefix_len, suffix_len: tokens of the shared prefix and of the fresh suffix.
        num_prefixes: distinct prefixes.
        output_len: completion tokens per request.
        request_rate: requests per second, evenly spaced (open loop); ``None`` = all at time 0
            (closed loop under the client's concurrency limit).
        shuffle: seeded shuffled order instead of round robin.

    Raises:
        WorkloadError: a knob is out of range.
    """
    check_prefix_repetition(num_requests=num_requests, prefix_len=prefix_len, suffix_len=suffix_len,
                            num_prefixes=num_prefixes, output_len=output_len, request_rate=request_rate)
    order = np.arange(num_requests) % num_prefixes
    if shuffle:
        order = np.random.default_rng([tokens.seed, DOMAIN_PREFIX, 1]).permutation(order)
    prefixes = [tokens.block(DOMAIN_PREFIX, (p,), prefix_len) for p in range(num_prefixes)]
    seen: set[int] = set()
    requests = []
    for i, p in enumerate(int(x) for x in order):
        prompt = prefixes[p] + tokens.block(DOMAIN_SUFFIX, (i,), suffix_len)
        requests.append(BenchRequest(
            request_id=f"prefix-{i}", prompt_token_ids=prompt, max_tokens=output_len,
            arrival_s=0.0 if request_rate is None else i / request_rate,
            shared_prefix_tokens=prefix_len if p in seen else 0))
        seen.add(p)
    params: dict[str, object] = {
        "num_requests": num_requests, "prefix_len": prefix_len, "suffix_len": suffix_len,
        "num_prefixes": num_prefixes, "output_len": output_len, "request_rate": request_rate,
        "shuffle": shuffle, "seed": tokens.seed}
    return Workload(name="prefix-repetition", params=params, requests=tuple(requests))
