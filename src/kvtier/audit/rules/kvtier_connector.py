"""kvtier's own connector: config keys that kvtier refuses at start-up (kvtier issue 2 § Config)."""

from __future__ import annotations

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule

_SOURCE = "kvtier config rules (issue 2 § Config: chunk size a multiple of the block size; sizes total across TP)"


def _kvtier(c: ServeConfig) -> bool:
    return c.uses("KVTierConnector")


@rule("kvtier-chunk-not-block-multiple", "error", "kvtier chunk_tokens not a multiple of --block-size",
      "Set chunk_tokens to a multiple of the block size (default 256 with vLLM's 16-token blocks).", _SOURCE,
      locate="chunk_tokens")
def kvtier_chunk(c: ServeConfig) -> str | None:
    chunk = c.connector_extra.get("chunk_tokens")
    block = int(c.number("--block-size") or 16)
    if _kvtier(c) and isinstance(chunk, int) and (chunk <= 0 or chunk % block):
        return f"chunk_tokens {chunk} is not a positive multiple of the {block}-token block size; kvtier refuses it."
    return None


@rule("kvtier-negative-size", "error", "kvtier tier size negative",
      "Give cpu_gib / disk_gib as non-negative GiB, totals across TP ranks.", _SOURCE, locate="_gib")
def kvtier_negative(c: ServeConfig) -> str | None:
    bad = [k for k in ("cpu_gib", "disk_gib") if isinstance(c.connector_extra.get(k), (int, float))
           and c.connector_extra[k] < 0]
    if _kvtier(c) and bad:
        return f"{', '.join(bad)} is negative."
    return None
