"""What a node-tier load costs against a cpu-tier load of the same bytes, and where it goes (issue 38).

Starts its own ``kvtier node serve`` (a pool in /dev/shm, as ``bench compare``'s ``kvtier-node``
arm does: :class:`kvtier.bench.shared_node.LocalNode`), writes ``--total-mib`` MiB of
``--chunk-mib`` MiB chunks into it and into a cpu tier, then times per round, in alternating order:

- ``cpu get``: the cpu tier's load as ``kvtier bench-store`` times it (``prepare_load``, a copy of
  every chunk into the caller's buffers, ``complete_load``);
- ``node get``: the node tier's ``get_many`` as the store builds it and its mover calls it
  (``GuardedTier``, the tenant records and the misses' reasons collected: one ``pin`` message for
  the batch, each payload copied from the mapped pages into the caller's buffer and verified over
  the copy, inline or overlapped as measured, the generation check once for the batch):
  :mod:`kvtier.core.tiers.node.readcopy`;
- ``store load from the node tier``: what an engine's load of a node-tier hit runs, through a
  :class:`~kvtier.core.store.TieredStore` with the cpu and node tiers whose cpu tier is emptied
  (``clear(["cpu"])``, untimed) before each round: ``prepare_load`` (the pin, each chunk read from
  the pool into a cpu page and verified), the same copy of every chunk into the caller's buffers
  as ``cpu get``, ``complete_load``; against ``cpu get`` it is the engine's node-tier load against
  its cpu-tier load (the copy into the KV cache included in both);
- ``store load into the destinations``: what an engine's load of a node-tier hit runs now
  (:mod:`kvtier.integrations.vllm.worker.direct`): ``prepare_load(into=...)`` hands each chunk a
  :class:`~kvtier.core.tiers.node.readcopy.Scatter` of ``--run-kib`` runs over its destination
  (as a KV block's runs lie in an engine's cache), so the tier copies it there straight from the
  pool, hashing the payload in order as it goes: one copy, no cpu page, no promotion;
  ``complete_load``.  Against ``cpu get`` it is issue 38's "a load from the node tier against a
  load of the same bytes from the engine's own cpu tier";
- ``node get, B KiB blocks``: the same with the inline loop copying and hashing ``B`` KiB at a
  time (``--block-kib``, a sweep; the tier's own is
  :data:`~kvtier.core.tiers.node.readcopy.COPY_BLOCK_BYTES`);
- ``node get, digest after the copy``: each value copied whole, then hashed whole (the unfused
  way, for what the fusion buys);
- ``node get, overlapped``: with the batch's digests on the helper thread (forced on, whatever
  the CPU count);
- ``no digest (attribution)``: the copy without the digest, to attribute the gap. Never a
  tier's path: every read the tier serves is verified.
- ``no digest, in blocks (attribution)``: the copy without the digest, in the tier's blocks.
- ``digest alone (attribution)``: the digest of the same number of bytes over one hot
  :data:`~kvtier.core.tiers.node.readcopy.COPY_BLOCK_BYTES` buffer, no copy: the digest's own
  compute, so ``no digest`` + ``digest alone`` is what one core can do at best.

``--shared-secret`` writes and reads with a shared secret: the digest is the keyed BLAKE3 MAC.

Prints per variant the median time and, per round, its ratio to ``cpu get`` (median, quartiles,
range). Usage::

    python scripts/node_load_cost.py [--chunk-mib 2] [--total-mib 256] [--rounds 21] [--block-kib 64,1024]
        [--dst-offset 16]

The destinations are page-aligned (as the cpu tier's pages an engine's node-tier loads land in)
plus ``--dst-offset`` bytes (16: where numpy puts a fresh array's data).
"""

from __future__ import annotations

import argparse
import hmac
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvtier.bench.shared_node import LocalNode, NodePool
from kvtier.bench.storebench import _chunks
from kvtier.core import envelope
from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.keys import ChunkKey, Namespace, chunk_keys, request_root
from kvtier.core.store import TieredStore
from kvtier.core.tiers.factory import TierContext, make_tier
from kvtier.core.tiers.node.readcopy import COPY_BLOCK_BYTES, Copied, Scatter
from kvtier.core.tiers.node.tier import NodeTier
from kvtier.core.tiers.wrappers import unwrap

MiB = 1 << 20
Copy = Callable[[ChunkKey, memoryview, memoryview, bool], Copied]


def after_copy(tier: NodeTier) -> Copy:
    """Each value copied whole (``numpy.copyto``), then hashed whole: the unfused way."""
    def copy(key: ChunkKey, value: memoryview, dst: memoryview, _batched: bool) -> Copied:
        head = bytes(value[:envelope.FIXED_BYTES])
        header = envelope.decode_header(head)
        out = memoryview(dst).cast("B")
        tier.envelope.check(header, key, out.nbytes)
        np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(value, np.uint8, offset=header.header_bytes))
        h = tier.envelope.hasher(head[:envelope.DIGEST_OFFSET])
        h.update(out)
        if not hmac.compare_digest(h.digest(), header.digest):
            raise envelope.EnvelopeError("digest mismatch")
        return header.record
    return copy


def unverified(key: ChunkKey, value: memoryview, dst: memoryview, _batched: bool) -> Copied:
    """The copy alone (attribution only)."""
    header = envelope.decode_header(bytes(value[:envelope.FIXED_BYTES]))
    np.copyto(np.frombuffer(memoryview(dst).cast("B"), np.uint8),
              np.frombuffer(value, np.uint8, offset=header.header_bytes))
    return header.record


def unverified_blocks(key: ChunkKey, value: memoryview, dst: memoryview, _batched: bool) -> Copied:
    """The copy alone in :data:`~kvtier.core.tiers.node.readcopy.COPY_BLOCK_BYTES` blocks (attribution only)."""
    header = envelope.decode_header(bytes(value[:envelope.FIXED_BYTES]))
    out, src = memoryview(dst).cast("B"), value[header.header_bytes:]
    for at in range(0, out.nbytes, COPY_BLOCK_BYTES):
        out[at:at + COPY_BLOCK_BYTES] = src[at:at + COPY_BLOCK_BYTES]
    return header.record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--total-mib", type=float, default=256.0)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--page-kib", type=int, default=1024)
    parser.add_argument("--block-kib", default="64,1024", help="inline block sizes to sweep, KiB, comma-separated")
    parser.add_argument("--shared-secret", action="store_true", help="the keyed BLAKE3 MAC instead of XXH3-128")
    parser.add_argument("--run-kib", type=int, default=64, help="runs of a destination scatter (direct loads)")
    parser.add_argument("--dst-offset", type=int, default=0, help="bytes past a page boundary the destinations start")
    args = parser.parse_args()
    chunk = int(args.chunk_mib * MiB)
    num = max(2, int(args.total_mib * MiB) // chunk)
    page = args.page_kib << 10  # room for two copies of every chunk (this tier's and the store's), whole pages
    pool = NodePool.make(2 * (num + 1) * -(-(chunk + envelope.FIXED_BYTES) // page) * page / GiB + 0.01,
                         page_kib=args.page_kib)
    owner = LocalNode(pool, Path(tempfile.gettempdir()) / f"node-load-cost-{os.getpid()}.log").start()
    try:
        guarded = make_tier("node", TierContext(KVTierConfig.from_dict(
            {"node_socket": pool.socket} | ({"shared_secret": os.urandom(16).hex()} if args.shared_secret else {})),
            os.urandom(16),
                                                chunk, 1, CollectorRegistry()))
        assert guarded is not None
        inner = unwrap(guarded)
        assert isinstance(inner, NodeTier)
        run(args, chunk, num, guarded, inner)
        guarded.close()
    finally:
        owner.stop()
        pool.remove()


def run(args: argparse.Namespace, chunk: int, num: int, guarded: object, inner: NodeTier) -> None:
    datas = _chunks(num, chunk, seed=4)
    stride = -(-(chunk + args.dst_offset) // 4096) * 4096
    backing = np.frombuffer(mmap.mmap(-1, num * stride), np.uint8)  # page-aligned
    dsts = [backing[i * stride + args.dst_offset:i * stride + args.dst_offset + chunk] for i in range(num)]
    for d, s in zip(dsts, datas, strict=True):
        np.copyto(d, s)  # fault the destination pages in before any timing
    keys = [ChunkKey(os.urandom(16)) for _ in range(num)]
    assert all(r.name == "STORED" for r in guarded.put_many(keys, [d.data for d in datas]))  # type: ignore[attr-defined]
    ns = Namespace("bench", "uint8", 1, 1, chunk, "flat", chunk_tokens=16)
    store = TieredStore(KVTierConfig.from_dict({"chunk_tokens": 16, "cpu_gib": (num + 1) * chunk / GiB}), ns, chunk)
    chain = chunk_keys(request_root(ns, cache_salt="x"), np.arange(num * 16), 16)
    store.put(chain, datas)
    # an engine's store with the node tier too: its cpu tier emptied before each of its rounds (untimed),
    # so its load reads every chunk from the pool into cpu pages and the caller copies them out
    via = TieredStore(KVTierConfig.from_dict({"chunk_tokens": 16, "cpu_gib": (num + 1) * chunk / GiB,
                                              "node_socket": inner.client.socket_path}),
                      ns, chunk)
    for end in range(16, num + 16, 16):  # a bounded write queue: 16 chunks at a time reach the pool
        via.put(chain[:end], datas[:end])
        assert via.flush(60.0), "the store's writes to the node pool did not finish within 60 s"
    assert via.stats().tiers["node"].num_chunks == num, "the store did not write every chunk to the node pool"
    current, overlap, block = inner.verifier.copy, inner.verifier.overlap, inner.verifier.block_bytes
    views = [d.data for d in dsts]

    def cpu_get(through: TieredStore = store) -> None:
        handle = through.prepare_load(chain)
        try:
            assert handle.num_chunks == num and handle.wait(60.0)
            for d, b in zip(dsts, handle.buffers, strict=True):
                np.copyto(d, b)
        finally:
            through.complete_load(handle, True)

    def empty_cpu_tier() -> None:
        assert via.clear(["cpu"])["cpu"].ok

    def node(copy: Copy, overlapped: bool | None, block_bytes: int = block) -> Callable[[], None]:
        def get() -> None:
            inner.verifier.copy, inner.verifier.overlap = copy, overlapped  # type: ignore[method-assign]
            inner.verifier.block_bytes = block_bytes
            records: dict[bytes, object] = {}  # as the store's mover asks: the tenant records and the misses' reasons
            out = guarded.get_many(keys, views, records, why={})  # type: ignore[attr-defined]
            assert all(o.name == "HIT" for o in out) and np.array_equal(dsts[-1], datas[-1])
        return get

    run_bytes = args.run_kib << 10
    scatters = [Scatter(chunk, list(range(0, chunk, run_bytes)),
                        [memoryview(d)[at:at + run_bytes] for at in range(0, chunk, run_bytes)]) for d in dsts]

    def direct() -> None:
        handle = via.prepare_load(chain, into=scatters.__getitem__)
        try:
            assert handle.num_chunks == num and handle.wait(60.0)
        finally:
            via.complete_load(handle, True)

    for d in dsts:
        d[:] = 0
    empty_cpu_tier()
    direct()  # once, untimed: every chunk lands where its scatter says
    assert all(np.array_equal(d, x) for d, x in zip(dsts, datas, strict=True))

    hot = np.zeros(block, np.uint8)

    def digest_alone() -> None:
        for _ in keys:
            h = inner.envelope.hasher(bytes(envelope.DIGEST_OFFSET))
            for _at in range(0, chunk, block):
                h.update(hot)
            h.digest()

    sweep = [int(float(b) * 1024) for b in args.block_kib.split(",") if b.strip()]
    variants = [("cpu get", cpu_get), ("store load into the destinations", direct), ("node get", node(current, overlap))]
    variants += [(f"node get, {b >> 10:g} KiB blocks" if b >= 1024 else f"node get, {b} B blocks",
                  node(current, False, b)) for b in sweep if b != block]
    variants += [("node get, digest after the copy", node(after_copy(inner), False)),
                 ("node get, overlapped", node(current, True)), ("no digest (attribution)", node(unverified, False)),
                 ("no digest, in blocks (attribution)", node(unverified_blocks, False)), ("digest alone (attribution)", digest_alone)]
    variants += [("store load from the node tier", lambda: cpu_get(via))]  # last: the heaviest, away from node get
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name, fn in variants if r % 2 == 0 else variants[::-1]:
            if name in ("store load from the node tier", "store load into the destinations"):
                empty_cpu_tier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        loads.append(os.getloadavg()[0])
    store.close()
    via.close()
    print(f"{num} chunks of {args.chunk_mib:g} MiB, {args.rounds} rounds, {os.cpu_count()} CPUs, node get's "
          f"way: {'measured' if overlap is None else overlap}, {block >> 10} KiB blocks, destinations at page "
          f"+{args.dst_offset} B, digest {'BLAKE3 MAC' if args.shared_secret else 'XXH3-128'}, load {min(loads):.1f}-{max(loads):.1f}")
    for name, _ in variants:
        per = sorted(t / c for t, c in zip(times[name], times["cpu get"], strict=True))
        med = statistics.median(times[name])
        q1, q3 = per[len(per) // 4], per[(3 * len(per)) // 4]
        print(f"{name:33s} median {med * 1e3:7.1f} ms ({num * chunk / GiB / med:5.2f} GiB/s)  / cpu get per round: "
              f"median {statistics.median(per):.2f}, quartiles {q1:.2f}-{q3:.2f}, range {per[0]:.2f}-{per[-1]:.2f}")


if __name__ == "__main__":
    main()
