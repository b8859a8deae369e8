"""``kvtier bench-store --codecs``: a tier's throughput with each codec chain against the identity
chain on the same tier, the same machine and the same chunks, in one run (issue 36 item 4).

Each round writes the chunks with ``put_many`` and reads them back with ``get_many`` through a
tier built as the engine builds it (:func:`kvtier.core.tiers.factory.make_tier` with ``codecs:
{tier: chain}``), the identity tier and the chain's tier alternating who goes first; the chunks
are deleted after each round.  Encrypting chains use a random master key made for the run (an
environment variable of this process only).  The chunks are KV-like: float32 values of a
normal distribution scaled like activations, rounded to bfloat16 (their exponents compress, their
mantissas do not, as real KV's: scripts/codec_bench.py measures real KV).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.core.errors import UserError

if TYPE_CHECKING:
    from kvtier.bench.storebench import StoreBenchResult

KEY_VARIABLE = "KV_BENCH_STORE_MASTER_KEY"
"""The environment variable the run's master key is put in (this process only)."""


def parse_chains(text: str) -> list[tuple[str, ...]]:
    """``--codecs`` as chains: ``;`` between chains, ``,`` between the codecs of one.

    Raises:
        UserError: an empty chain or a chain the configuration refuses (one sentence).
    """
    from kvtier.core.codecs import CodecError, chain_of, names

    chains = [tuple(c.strip() for c in part.split(",") if c.strip()) for part in text.split(";")]
    if not chains or not all(chains):
        raise UserError(f"--codecs {text!r} must list codec chains separated by ';', the codecs of one by ',', "
                        "e.g. 'aes-256-gcm;blosc2-zstd-shuffle2,aes-256-gcm'")
    for chain in chains:
        try:
            chain_of(chain)
        except CodecError as exc:
            raise UserError(f"--codecs: {exc}; choose from {', '.join(names())}") from None
    return chains


def kv_like_chunks(num: int, chunk_bytes: int, seed: int = 7) -> list[np.ndarray]:
    """``num`` chunks of bfloat16 bits of normally distributed values (see the module docstring)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        values = (rng.standard_normal(chunk_bytes // 2) * 0.1).astype(np.float32)
        out.append((values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8))
    return out


def bench_chains(tier: str, settings: dict[str, Any], chains: Sequence[tuple[str, ...]], chunk_mib: float,
                 total_mib: float, repeats: int) -> tuple[list[StoreBenchResult], list[str]]:
    """Rows (``io`` = the chain) of tier ``tier`` built from ``settings`` with each chain, against
    identity on the same tier, and one note per chain (bytes stored per byte given).

    Raises:
        UserError: the tier could not be built, or lost or changed a chunk.
    """
    from prometheus_client import CollectorRegistry

    from kvtier.bench.storebench import MiB, StoreBenchResult, _rate, _timed
    from kvtier.core.codecstats import codec_numbers
    from kvtier.core.config import KVTierConfig
    from kvtier.core.keys import ChunkKey
    from kvtier.core.tiers.base import GetResult, PutResult
    from kvtier.core.tiers.factory import TierContext, make_tier

    os.environ.setdefault(KEY_VARIABLE, os.urandom(32).hex())
    chunk_bytes = int(chunk_mib * MiB)
    num = max(2, int(total_mib / chunk_mib))
    datas = kv_like_chunks(num, chunk_bytes)
    dsts = [np.zeros(chunk_bytes, dtype=np.uint8) for _ in range(num)]

    def build(chain: tuple[str, ...]) -> Any:
        config = KVTierConfig.from_dict({**settings, "codecs": {tier: list(chain)},
                                         "encryption": {"master_key_env": KEY_VARIABLE}})
        made = make_tier(tier, TierContext(config, os.urandom(16), chunk_bytes, 1, CollectorRegistry()))
        if made is None:
            raise UserError(f"the {tier} tier could not be built from {', '.join(settings)}")
        return made

    rows: list[StoreBenchResult] = []
    notes: list[str] = []
    for chain in chains:
        base, coded = build(("identity",)), build(chain)
        times: dict[str, list[float]] = {"ref_put": [], "put": [], "ref_get": [], "get": []}
        try:
            for r in range(repeats):
                keys = [ChunkKey(os.urandom(16)) for _ in range(num)]

                def put(t: Any, keys: list[ChunkKey] = keys) -> None:
                    if t.put_many(keys, [d.data for d in datas]) != [PutResult.STORED] * num:
                        raise UserError(f"the {tier} tier did not store every chunk; give it room for --total-mib")

                def get(t: Any, keys: list[ChunkKey] = keys) -> None:
                    if t.get_many(keys, [d.data for d in dsts]) != [GetResult.HIT] * num:
                        raise UserError(f"the {tier} tier lost a chunk during the codec benchmark")

                pairs = [("ref_put", lambda b=base: put(b)), ("put", lambda c=coded: put(c)),
                         ("ref_get", lambda b=base: get(b)), ("get", lambda c=coded: get(c))]
                if r % 2:
                    pairs = [pairs[1], pairs[0], pairs[3], pairs[2]]
                for name, fn in pairs:
                    times[name].append(_timed(fn))
                if not np.array_equal(dsts[-1], datas[-1]):
                    raise UserError(f"the {tier} tier returned wrong bytes with codecs {','.join(chain)}")
                base.delete_many(keys)
                coded.delete_many(keys)
            numbers = codec_numbers(coded)
        finally:
            base.close()
            coded.close()
        label = "+".join(chain)
        for op in ("put", "get"):
            rate = _rate(num * chunk_bytes, statistics.median(times[op]))
            ref = _rate(num * chunk_bytes, statistics.median(times[f"ref_{op}"]))
            rounds = [b / t for t, b in zip(times[op], times[f"ref_{op}"], strict=True)]
            rows.append(StoreBenchResult(tier, op, chunk_mib, rate, ref, rate / ref, io=label, threads=1,
                                         ratio_min=min(rounds), ratio_max=max(rounds)))
        if numbers is not None and numbers.encoded_bytes:
            notes.append(f"{tier} {label} at {chunk_mib:g} MiB: {numbers.stored_bytes / numbers.encoded_bytes:.4f} "
                         "bytes stored per payload byte (reference: identity on the same tier)")
    return rows, notes
