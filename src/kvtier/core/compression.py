"""Lossless compression of KV payloads: blosc2 byte shuffle + zstd level 1 (issue 36 item 2).

Chosen by measurement on real KV (a tiny test model's float32 KV from a real engine run, and the
same values rounded to bfloat16; ``scripts/codec_bench.py``, the table in docs/benchmarks.md):
shuffling the bytes of each element into planes puts the exponent bytes together, which zstd
then codes (1.45x on bf16, 1.19x on fp32), where zstd alone on the raw bytes gets 1.28x / 1.08x
and lz4 nothing (1.01x).  The mantissa bytes stay incompressible: lossless coding of KV buys
little, as FlexKV#183 measured with nvCOMP ANS (1.4x bf16, 1.1x fp8).

Codec ids (part of the stored format, never reused):

- 32 ``blosc2-zstd-shuffle2``: element size 2 (bfloat16, float16 KV);
- 33 ``blosc2-zstd-shuffle4``: element size 4 (float32 KV).

One thread per call (the tiers run several chunks at once on their own threads).  The stored
payload is blosc2's own frame (``blosc2.compress2``), which records its lengths; a frame that
does not decode, or decodes to another length than the envelope's, is a
:class:`~kvtier.core.codecs.CodecError` (a counted miss).  blosc2 is imported on first use, or when a writer's chain is prepared
(:meth:`~kvtier.core.codecs.Chain.prepare`, at a tier's start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.core import codecs


def _blosc2() -> Any:
    try:
        import blosc2
    except ImportError:  # pragma: no cover - a dependency of kvtier
        raise codecs.CodecError("compression codecs need the blosc2 package (pip install blosc2)") from None
    return blosc2


@dataclass(frozen=True)
class Blosc2Zstd:
    """blosc2 byte shuffle (element size :attr:`typesize`) + zstd level 1, one thread."""

    id: int
    name: str
    typesize: int
    passthrough: bool = False

    def prepare(self) -> None:
        """Import blosc2 now (:meth:`kvtier.core.codecs.Chain.prepare`: before any deadline)."""
        _blosc2()

    def encode(self, data: memoryview) -> memoryview:
        blosc2 = _blosc2()
        if data.nbytes == 0:
            return data
        return memoryview(blosc2.compress2(data, typesize=self.typesize, clevel=1, codec=blosc2.Codec.ZSTD,
                                           filters=[blosc2.Filter.SHUFFLE], nthreads=1))

    def decode(self, data: memoryview, original_bytes: int) -> memoryview:
        blosc2 = _blosc2()
        if data.nbytes == 0:
            return data
        try:
            if original_bytes > 0:
                import numpy as np  # (here: blosc2 imports it anyway; the CLI's start-up imports this module, not numpy)

                out = np.empty(original_bytes, dtype=np.uint8)
                blosc2.decompress2(data, dst=out, nthreads=1)
                return out.data.cast("B")
            return memoryview(blosc2.decompress2(data, nthreads=1))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise codecs.CodecError(f"blosc2 frame does not decode ({exc})") from None


BLOSC2_ZSTD_2 = Blosc2Zstd(32, "blosc2-zstd-shuffle2", 2)
BLOSC2_ZSTD_4 = Blosc2Zstd(33, "blosc2-zstd-shuffle4", 4)
codecs.register(BLOSC2_ZSTD_2)
codecs.register(BLOSC2_ZSTD_4)
