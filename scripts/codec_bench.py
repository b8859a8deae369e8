"""Lossless compression of real KV chunks, candidate libraries side by side (issue 36 item 2).

Reads the payloads of chunk files a real engine wrote to a disk tier (``--kv-dir``: a disk tier's
namespace directory, or any directory above one; envelope chunk files, header 4096 bytes), and
measures on the same chunks, one thread each (per core):

- ``lz4`` (lz4.block, default mode) on the raw bytes;
- ``zstandard`` level 1 and 3 on the raw bytes, and level 1 on byte planes (the chunk as
  ``itemsize`` planes: every element's byte 0, then byte 1, ...; numpy transpose);
- ``blosc2`` with byte shuffle or bit shuffle, then zstd (clevel 1) or lz4 (clevel 5), ``typesize``
  the element size, one thread.

Per dtype: the payload as stored (the test models run in float32) and the same values rounded to
bfloat16 (round to nearest even, as ``torch.Tensor.to(torch.bfloat16)``): KV in the dtype real
models serve.  Reported: ratio (original / compressed bytes, all chunks), encode and decode GB/s
per core (original bytes over the best of ``--repeats`` timed passes), and whether each round trip
is exact.

Usage::

    python scripts/codec_bench.py --kv-dir /tmp/pytest-of-root/pytest-176/kvtier-disk0 [--chunks 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

HEADER_BYTES = 4096


def load_chunks(kv_dir: Path, limit: int) -> list[bytes]:
    files = sorted(kv_dir.rglob("*.kvc"))[:limit]
    if not files:
        raise SystemExit(f"no chunk files (*.kvc) under {kv_dir}")
    out = []
    for f in files:
        raw = f.read_bytes()
        if raw[:4] != b"KVTE":
            continue
        out.append(raw[HEADER_BYTES:])
    return out


def to_bf16(payload: bytes) -> bytes:
    bits = np.frombuffer(payload, dtype=np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    return rounded.astype(np.uint16).tobytes()


def candidates(itemsize: int) -> dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]]]:
    import blosc2
    import lz4.block
    import zstandard

    blosc2.set_nthreads(1)
    z1c, z3c, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()

    def planes(data: bytes) -> bytes:
        return np.frombuffer(data, dtype=np.uint8).reshape(-1, itemsize).T.tobytes()

    def unplanes(data: bytes, n: int) -> bytes:
        return np.frombuffer(data, dtype=np.uint8).reshape(itemsize, -1).T.tobytes()

    def blosc(codec: object, clevel: int, shuffle: object) -> tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]]:
        return (lambda d: blosc2.compress2(d, typesize=itemsize, clevel=clevel, codec=codec, filters=[shuffle], nthreads=1),
                lambda c, n: bytes(blosc2.decompress2(c)))

    C, F = blosc2.Codec, blosc2.Filter
    return {
        "lz4 (raw)": (lambda d: lz4.block.compress(d, store_size=True), lambda c, n: lz4.block.decompress(c)),
        "zstd-1 (raw)": (z1c.compress, lambda c, n: zd.decompress(c)),
        "zstd-3 (raw)": (z3c.compress, lambda c, n: zd.decompress(c)),
        "zstd-1 (byte planes)": (lambda d: z1c.compress(planes(d)), lambda c, n: unplanes(zd.decompress(c), n)),
        "blosc2 shuffle+zstd-1": blosc(C.ZSTD, 1, F.SHUFFLE),
        "blosc2 shuffle+lz4-5": blosc(C.LZ4, 5, F.SHUFFLE),
        "blosc2 bitshuffle+zstd-1": blosc(C.ZSTD, 1, F.BITSHUFFLE),
        "blosc2 bitshuffle+lz4-5": blosc(C.LZ4, 5, F.BITSHUFFLE),
    }


def measure(chunks: list[bytes], enc: Callable[[bytes], bytes], dec: Callable[[bytes, int], bytes],
            repeats: int) -> tuple[float, float, float, bool]:
    total = sum(len(c) for c in chunks)
    best_e = best_d = float("inf")
    packed: list[bytes] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        packed = [enc(c) for c in chunks]
        best_e = min(best_e, time.perf_counter() - t0)
        t0 = time.perf_counter()
        back = [dec(p, len(c)) for p, c in zip(packed, chunks, strict=True)]
        best_d = min(best_d, time.perf_counter() - t0)
    exact = all(b == c for b, c in zip(back, chunks, strict=True))
    return total / sum(len(p) for p in packed), total / best_e / 1e9, total / best_d / 1e9, exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-dir", type=Path, required=True)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    stored = load_chunks(args.kv_dir, args.chunks)
    print(f"{len(stored)} chunks of {len(stored[0]):,} bytes from {args.kv_dir}")
    print("| dtype | library and setting | ratio | encode GB/s/core | decode GB/s/core | exact |")
    print("|---|---|---|---|---|---|")
    for dtype, chunks, itemsize in (("float32", stored, 4), ("bfloat16", [to_bf16(c) for c in stored], 2)):
        for name, (enc, dec) in candidates(itemsize).items():
            ratio, e, d, exact = measure(chunks, enc, dec, args.repeats)
            print(f"| {dtype} | {name} | {ratio:.3f} | {e:.2f} | {d:.2f} | {'yes' if exact else 'NO'} |")


if __name__ == "__main__":
    main()
