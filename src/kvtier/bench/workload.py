"""What a workload is: an ordered list of requests with their send rules, plus deterministic tokens.

A workload never talks to a server; :mod:`kvtier.bench.client` sends it.  Send rules, per request:

* ``arrival_s``: earliest send time, seconds after the run starts (open loop).  ``0.0`` everywhere
  means "as fast as the concurrency limit allows" (closed loop).
* ``session``: requests of one session are sent one after another, each only after the previous
  one finished, plus ``think_time_s``.  ``None`` means the request depends on nothing.

Token ids are drawn from ``TokenSpace``: every (domain, key) pair maps to the same block of ids for
a given seed, on every machine (numpy's ``SeedSequence`` is specified bit-for-bit), so equal keys
give equal token prefixes on the wire and the server's prefix cache sees exactly the sharing the
workload describes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    """One completion request of a workload.

    Attributes:
        request_id: unique within the workload, stable under the seed.
        prompt_token_ids: the prompt, token ids (sent as-is to ``/v1/completions``).
        max_tokens: completion tokens to generate (sent with ``ignore_eos`` so exactly this many).
        arrival_s: earliest send time in seconds after the start of the run.
        session: name of the chain this request belongs to, or ``None`` for an independent request.
        think_time_s: seconds to wait after the previous request of the same session finished.
        shared_prefix_tokens: tokens of the prompt the workload expects to be shared with an
            earlier request (informational; reports and tests use it, the client does not).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float = 0.0
    session: str | None = None
    think_time_s: float = 0.0
    shared_prefix_tokens: int = 0

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    """A named, parameterised list of requests in send order.

    Attributes:
        name: ``trace``, ``prefix-repetition`` or ``multi-round``.
        params: the knobs that produced it (recorded in results so a run can be reproduced).
        requests: the requests, in the order the client starts them.
        notes: facts worth reporting (e.g. prompts truncated to fit the model).
    """

    name: str
    params: dict[str, object]
    requests: tuple[BenchRequest, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def num_prompt_tokens(self) -> int:
        """Sum of prompt lengths, tokens."""
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Sum of ``max_tokens``, tokens."""
        return sum(r.max_tokens for r in self.requests)


# Domains keep the token streams of different purposes apart (a trace block 7 is not a suffix 7).
DOMAIN_TRACE_BLOCK = 1
DOMAIN_PREFIX = 2
DOMAIN_SUFFIX = 3
DOMAIN_SYSTEM = 4
DOMAIN_QUESTION = 5
DOMAIN_ANSWER = 6


@dataclass(frozen=True)
class TokenSpace:
    """Deterministic token blocks drawn uniformly from ``[low, high)``.

    Attributes:
        seed: the workload seed; changing it changes every token.
        low: smallest token id used (ids below it are left alone: specials live there in most
            vocabularies).
        high: one past the largest token id used; at most the model's vocabulary size.

    Raises:
        ValueError: if the range is empty or negative.
    """

    seed: int
    low: int = 100
    high: int = 30000

    def __post_init__(self) -> None:
        if self.low < 0 or self.high <= self.low + 1:
            raise ValueError(f"token id range [{self.low}, {self.high}) is empty; give a vocabulary size above "
                             f"{self.low + 1}")
        if self.seed < 0:
            raise ValueError(f"seed {self.seed} is negative; use a seed >= 0")

    def block(self, domain: int, key: Sequence[int], length: int) -> tuple[int, ...]:
        """The ``length`` token ids named by ``(domain, *key)``; same arguments, same ids.

        ``block(d, k, n)[:m] == block(d, k, m)`` for ``m <= n``, so a partial block is a prefix
        of the full block with the same key (Mooncake's partial last block relies on this).
        """
        if length <= 0:
            return ()
        if any(k < 0 for k in key):
            raise ValueError(f"token block keys must be >= 0, got {tuple(key)}")
        rng = np.random.default_rng([self.seed, domain, *key])
        return tuple(int(t) for t in rng.integers(self.low, self.high, size=length))


def vocab_token_space(seed: int, vocab_size: int) -> TokenSpace:
    """A :class:`TokenSpace` for a model with ``vocab_size`` ids: leaves the first 100 and the
    last 100 ids (special tokens in common tokenizers) unused when the vocabulary is large enough.

    Raises:
        ValueError: if ``vocab_size`` is below 4.
    """
    if vocab_size < 4:
        raise ValueError(f"vocabulary size {vocab_size} is too small; give the model's real vocab_size")
    margin = 100 if vocab_size > 1000 else 1
    return TokenSpace(seed=seed, low=margin, high=vocab_size - margin)


class WorkloadError(ValueError):
    """A workload cannot be built from the given input; the message names the input and the fix."""


def check_at_least(knobs: tuple[tuple[str, int, int], ...]) -> None:
    """Each ``(option, value, least)`` must have ``value >= least``.

    Raises:
        WorkloadError: the first that does not, naming the option.
    """
    for name, value, low in knobs:
        if value < low:
            raise WorkloadError(f"{name} {value} must be at least {low}")
