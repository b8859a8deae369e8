"""Block identities of synthetic prompts given as token counts (:mod:`kvtier.simulate.synth`): a
block's id is fixed by the whole prefix before it, as chained KV keys are, so equal ids mean equal
prefixes; and :class:`Record`, one generated request."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtier.simulate.synth_params import SynthError

MAX_PROMPT_BLOCKS = 65_536
"""Most blocks in one generated prompt (32 Mi tokens at 512 tokens a block: past every model's context)."""


@dataclass(frozen=True)
class Record:
    """One request: arrival (ms), prompt and completion lengths (tokens), block ids."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class Blocks:
    """Allocates block ids for prompts given as token counts of shared segments."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._next = 0
        self._ids: dict[tuple[Any, int], int] = {}

    def ids(self, prefix: Any, num_tokens: int) -> tuple[int, ...]:
        """Ids of a prompt of ``num_tokens`` whose content is named by ``prefix`` (a hashable that
        names the content of the *whole* prompt prefix; prompts that extend one another must use
        :meth:`extend`).  Block ``i`` gets an id keyed by ``(prefix, i, filled tokens)``."""
        out = []
        b = self.block_tokens
        check_prompt_blocks(math.ceil(num_tokens / b), num_tokens, b)
        for i in range(math.ceil(num_tokens / b)):
            filled = min(b, num_tokens - i * b)
            key = (prefix, i * b + filled)
            block = self._ids.get(key)
            if block is None:
                block = self._ids[key] = self._next
                self._next += 1
            out.append(block)
        return tuple(out)


class Prompt:
    """A prompt that grows (a conversation): full blocks keep their ids, the grown tail gets new
    ones.  ``content`` names the shared part it started from, for sharing across prompts."""

    def __init__(self, blocks: Blocks, start: tuple[int, ...], start_tokens: int) -> None:
        self._blocks = blocks
        b = blocks.block_tokens
        self.tokens = start_tokens
        self.full = list(start[: start_tokens // b])

    def extend(self, tokens: int) -> tuple[int, ...]:
        """Append ``tokens`` tokens of new content; returns the prompt's ids (last may be partial)."""
        b = self._blocks.block_tokens
        self.tokens += tokens
        check_prompt_blocks(math.ceil(self.tokens / b), self.tokens, b)
        while len(self.full) < self.tokens // b:
            self.full.append(self._fresh())
        tail = (self._fresh(),) if self.tokens % b else ()
        return tuple(self.full) + tail

    def _fresh(self) -> int:
        blocks = self._blocks
        blocks._next += 1
        return blocks._next - 1


def check_prompt_blocks(num_blocks: int, num_tokens: int, block_tokens: int) -> None:
    if num_blocks > MAX_PROMPT_BLOCKS:
        raise SynthError(f"a generated prompt reached {num_tokens:,} tokens ({num_blocks:,} blocks of {block_tokens}), "
                         f"over the generator's bound of {MAX_PROMPT_BLOCKS:,} blocks per prompt; lower the *_tokens "
                         "parameters (or mean_turns / mean_steps), or raise --block-tokens")

