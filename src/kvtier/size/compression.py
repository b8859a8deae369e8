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
    codec: str | None = None

    def describe(self, tier: str) -> str:
        return (f"{tier} tier compressed: {self.ratio:g}× the chunks in its bytes (stored bytes per payload "
                f"byte 1/{self.ratio:g}; R from {self.source})")


def parse_ratios(values: list[str] | None, tiers: tuple[str, ...],
                 codec_required: bool = False) -> dict[str, CompressionRatio]:
    """``TIER=R``, ``TIER=CODEC`` or ``TIER=CODEC:R`` items -> tier -> :class:`CompressionRatio`.

    ``codec_required`` (``kvtier size``, whose kvtier recipe must enable the codec that compresses):
    a bare ``TIER=R`` is refused, since no recipe could carry it.

    Raises:
        UserError: an item not of those forms, a tier not in ``tiers``, a tier twice, R not a finite
            number >= 1, a codec not in :data:`MEASURED`, or no codec where one is required.
    """
    out: dict[str, CompressionRatio] = {}
    for item in values or []:
        tier, sep, value = (part.strip() for part in item.partition("="))
        if not sep or tier not in tiers:
            if codec_required:  # size refuses a bare R: offer only forms it takes
                raise UserError(f"--compression-ratio {item!r} must be TIER=CODEC or TIER=CODEC:R with TIER one of "
                                f"{', '.join(tiers)} and CODEC one of {', '.join(MEASURED)} (e.g. "
                                f"{DISK}=blosc2-zstd-shuffle2 or {DISK}=blosc2-zstd-shuffle2:1.6).")
            raise UserError(f"--compression-ratio {item!r} must be TIER=R with TIER one of {', '.join(tiers)} and R "
                            "a ratio >= 1 or a compressing codec (e.g. disk=1.45 or disk=blosc2-zstd-shuffle2).")
        if tier in out:
            raise UserError(f"--compression-ratio gives the {tier} tier twice; give each tier once.")
        codec, colon, own = value.partition(":")
        if codec in MEASURED:
            measured, source = MEASURED[codec]
            given = _number(own) if colon else measured
            if not (math.isfinite(given) and given >= 1):
                raise UserError(f"--compression-ratio {item!r}: R after the codec must be a number >= 1 (payload "
                                "bytes per stored byte), e.g. disk=blosc2-zstd-shuffle2:1.6.")
            out[tier] = CompressionRatio(given, "--compression-ratio, as given" if colon else source, codec)
            continue
        if codec_required:
            raise UserError(f"--compression-ratio {item!r} names no codec, and only a recipe that enables one "
                            f"compresses: give {tier}=CODEC or {tier}=CODEC:R with CODEC one of {', '.join(MEASURED)}.")
        try:
            ratio = float(value)
        except ValueError:
            ratio = math.nan
        if not (math.isfinite(ratio) and ratio >= 1):
            raise UserError(f"--compression-ratio {item!r}: R must be a number >= 1 (payload bytes per stored byte) "
                            f"or one of the compressing codecs {', '.join(MEASURED)}.")
        out[tier] = CompressionRatio(ratio, "--compression-ratio, as given")
    return out


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan
