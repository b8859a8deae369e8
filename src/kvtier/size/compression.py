"""A tier's measured compression ratio for ``kvtier size`` and ``kvtier simulate`` (issue 36 item 5).

A tier whose codec chain compresses holds ``R`` times as many chunks in the same bytes (stored bytes
per payload byte = 1/R).  ``--compression-ratio TIER=R`` gives R (a number >= 1) or names the
compressing codec, whose ratio is then the one measured in docs/benchmarks.md ("Lossless
compression of KV", blosc2 byte shuffle + zstd-1 on the engine's own chunks: 1.451 for bf16, 1.186
for fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.core.errors import UserError

DISK = "disk"
"""The modelled disk tier's name, as ``--compression-ratio`` spells it (``disk=R``)."""

# codec name -> (ratio, where it was measured): docs/benchmarks.md, "Lossless compression of KV"
MEASURED = {
    "blosc2-zstd-shuffle2": (1.451, "docs/benchmarks.md, blosc2-zstd-shuffle2 on bf16 KV"),
    "blosc2-zstd-shuffle4": (1.186, "docs/benchmarks.md, blosc2-zstd-shuffle4 on fp32 KV"),
}


@dataclass(frozen=True)
class CompressionRatio:
    """One tier's ratio: ``ratio`` payload bytes per stored byte (>= 1), ``source`` where R came from."""

    ratio: float
    source: str

    def describe(self, tier: str) -> str:
        return (f"{tier} tier compressed: {self.ratio:g}× the chunks in its bytes (stored bytes per payload "
                f"byte 1/{self.ratio:g}; R from {self.source})")


def parse_ratios(values: list[str] | None, tiers: tuple[str, ...]) -> dict[str, CompressionRatio]:
    """``TIER=R`` or ``TIER=CODEC`` items -> tier -> :class:`CompressionRatio`.

    Raises:
        UserError: an item not ``TIER=R``, a tier not in ``tiers``, a tier twice, R not a finite
            number >= 1 nor a compressing codec of :data:`MEASURED`.
    """
    out: dict[str, CompressionRatio] = {}
    for item in values or []:
        tier, sep, value = (part.strip() for part in item.partition("="))
        if not sep or tier not in tiers:
            raise UserError(f"--compression-ratio {item!r} must be TIER=R with TIER one of {', '.join(tiers)} and R "
                            "a ratio >= 1 or a compressing codec (e.g. disk=1.45 or disk=blosc2-zstd-shuffle2).")
        if tier in out:
            raise UserError(f"--compression-ratio gives the {tier} tier twice; give each tier once.")
        if value in MEASURED:
            ratio, source = MEASURED[value]
            out[tier] = CompressionRatio(ratio, source)
            continue
        try:
            ratio = float(value)
        except ValueError:
            ratio = math.nan
        if not (math.isfinite(ratio) and ratio >= 1):
            raise UserError(f"--compression-ratio {item!r}: R must be a number >= 1 (payload bytes per stored byte) "
                            f"or one of the compressing codecs {', '.join(MEASURED)}.")
        out[tier] = CompressionRatio(ratio, "--compression-ratio, as given")
    return out
