"""Synthetic request traces in Mooncake format, one generator per traffic regime (seeded).

Every regime emits Mooncake records (``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids`` with one id per ``block_tokens`` block, the last one possibly partial), built from
*prompts as token counts*: a prompt is a list of segments, and a block's id is fixed by the whole
prefix before it, exactly as chained KV keys are, so equal ids mean equal prefixes::

    turn 1:  [sys 1200 tok][user 300][                ]   ids a b c(partial)
    turn 2:  [sys 1200 tok][user 300][answer 400][u2 ] ids a b d e f(partial)   (c's block grew:
                                                                                  new content)

Regimes (``REGIMES``; parameters are the fields of each ``*Params`` class, documented there and
in docs/simulate.md):

- ``chat``: multi-turn conversations; each turn re-sends the conversation so far; lognormal
  think time between turns; many conversations never return.
- ``agent``: sessions of tool loops behind a long system prompt shared by every session of the
  same agent; short, tool-latency gaps between steps.
- ``rag``: a system prompt, then a retrieved document drawn from a Zipf-popular set, then a
  unique question.
- ``batch``: scan-once jobs (a shared instruction, then a unique document) with a small hot set
  of repeated prompts mixed in (scan resistance).
- ``cycle``: a fixed set of prompts requested round-robin, with a little order jitter: a working
  set that cycles (LRU's worst case whenever the cache is smaller than the set).

All randomness comes from one ``random.Random(seed)``; the same parameters and seed give the same
file.  Prompts are never generated, only their lengths and block identities.

This module holds :func:`generate` and names the public parts of the others: the regimes'
parameters and :func:`make_params` (:mod:`~kvtier.simulate.synth_params`), the block identities
and :class:`Record` (:mod:`~kvtier.simulate.synth_blocks`), the regimes' request streams
(:mod:`~kvtier.simulate.synth_regimes`).
"""

from __future__ import annotations

import random
from typing import Any

from kvtier.simulate.synth_blocks import Blocks, Record
from kvtier.simulate.synth_params import REGIMES, SynthError, make_params
from kvtier.simulate.synth_regimes import STREAMS

__all__ = ["MAX_REQUESTS", "MAX_TRACE_BLOCKS", "REGIMES", "Record", "SynthError", "generate", "make_params"]

MAX_REQUESTS = 1_000_000
"""Most requests in one generated trace: a million takes tens of seconds to generate and write and
is past what a simulation needs; a typo such as ``--requests 1000000000000`` would run for hours."""
MAX_TRACE_BLOCKS = 20_000_000
"""Most block ids in one generated trace (about 0.7 GiB of memory while it is built)."""


def generate(regime: str, params: Any, num_requests: int, seed: int, block_tokens: int = 512) -> list[Record]:
    """``num_requests`` records of ``regime`` in arrival order (see the module docstring).

    Raises:
        SynthError: ``num_requests`` not from 1 to :data:`MAX_REQUESTS`, ``block_tokens`` not
            from 1 to :data:`~kvtier.core.config.MAX_CHUNK_TOKENS`, unknown regime.
    """
    from kvtier.core.config import MAX_CHUNK_TOKENS

    if num_requests <= 0 or block_tokens <= 0:
        raise SynthError(f"--requests ({num_requests}) and --block-tokens ({block_tokens}) must be positive")
    if num_requests > MAX_REQUESTS:
        raise SynthError(f"--requests {num_requests:,} is more than the {MAX_REQUESTS:,} one trace holds (a million "
                         "takes tens of seconds to generate; more would run for hours); lower --requests")
    if block_tokens > MAX_CHUNK_TOKENS:
        raise SynthError(f"--block-tokens {block_tokens:,} is more than {MAX_CHUNK_TOKENS:,}, longer than any "
                         "model's context, so no prompt would fill a block; use Mooncake's 512 or kvtier's "
                         "chunk_tokens")
    if regime not in REGIMES:
        raise SynthError(f"unknown regime {regime!r}; choose one of {', '.join(REGIMES)}")
    rng = random.Random(f"kvtier-synth/{regime}/{seed}")
    blocks = Blocks(block_tokens)
    stream: Any = STREAMS[regime]
    out = []
    num_ids = 0
    for record in stream(params, rng, blocks):
        out.append(record)
        num_ids += len(record.hash_ids)
        if num_ids > MAX_TRACE_BLOCKS:
            raise SynthError(f"the trace would hold more than {MAX_TRACE_BLOCKS:,} block ids after {len(out):,} of "
                             f"{num_requests:,} requests; lower --requests or the *_tokens parameters, or raise "
                             "--block-tokens")
        if len(out) == num_requests:
            break
    return out
