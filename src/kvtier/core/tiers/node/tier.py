"""The node tier on an engine: chunks in the host's shared DRAM pool (:mod:`kvtier.core.tiers.node`).

A shared tier (other engines write it, its owner evicts), used behind
:class:`~kvtier.core.tiers.guarded.GuardedTier` (:mod:`~kvtier.core.tiers.node.factory`), whose
data path it keeps (:class:`~kvtier.core.tiers.split.SplitTier`).  The owner, the presence table and the
envelopes know each key by its pool name in the secret's key space (:mod:`~kvtier.core.tiers.node.names`):

- **lookup**: read from the pool's presence table on the caller's thread while its owner beats
  (:mod:`~kvtier.core.tiers.node.presence`: no message); else one ``lookup`` message.
- **read**: ``fetch_many_by`` (the caller's thread: each wait on the socket bounded by what is
  left of the deadline, :class:`~kvtier.core.tiers.split.BoundsItself`) pins the values, one
  message for the batch, the scatters built and the values whose place this engine knows copied
  and verified while the owner answers (:mod:`~kvtier.core.tiers.node.early`: served only where
  the answer names the same place and generation); ``finish_get`` (the caller's thread, no socket) copies each other payload from
  the shared pages into the caller's buffer (the one copy a read needs) and verifies the digest
  over the copy (:mod:`~kvtier.core.tiers.node.readcopy`: in a batch, on a helper thread while the
  next value is copied where that is measured faster), then checks, once for the batch after
  every copy (:meth:`~kvtier.core.tiers.node.pool.Pool.same_generations`), that each value's
  pages still carry its pin's generation (if not, the page was reused: a miss, never a served
  byte) and queues the batch's releases.
- **write**: ``produce`` (the caller's thread) takes the envelope headers (digests);
  ``send`` (the wrapper's threads) is granted pages (one message), copies header and payload into
  them and publishes them (one message).  A write abandoned at the deadline is not published
  (its pages go back); a payload changed after its digest was taken fails verification on read.

The blob verbs (``get``, ``read_into``, ``get_range``) are :class:`~kvtier.core.tiers.envelopetier.EnvelopeTier`'s
over :meth:`NodeTier.load` (pin, copy out, generation check, release).  Raises
:class:`~kvtier.core.tiers.node.client.NodeUnavailable` on a fault (the wrapper turns it into
misses and its breaker).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.core import envelope
from kvtier.core.envelope import note_verified
from kvtier.core.errors import ChunkFormatError
from kvtier.core.keys import ChunkKey
from kvtier.core.stats import WireCounters, WireStats
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.base import ClearResult, GetResult, PutResult, TierUsage, writers
from kvtier.core.tiers.envelopetier import EnvelopeTier
from kvtier.core.tiers.loglimit import warn_unusable
from kvtier.core.tiers.node import protocol as p
from kvtier.core.tiers.node.client import NodeClient
from kvtier.core.tiers.node.early import Early, Locations, copy_early
from kvtier.core.tiers.node.memory import PoolMemory
from kvtier.core.tiers.node.names import PoolNames
from kvtier.core.tiers.node.pool import Pool
from kvtier.core.tiers.node.presence import lookup
from kvtier.core.tiers.node.readcopy import Copied, Pending, Scatter, Verifier
from kvtier.core.tiers.split import PutStream, WriteAbandoned, split_get

log = logging.getLogger(__name__)
Pins = tuple[list[tuple[int, int, int, int] | None], Pool, int, dict[int, Early]]
"""What ``fetch_many`` hands ``finish_get``: per key (lease, page, value bytes, generation) or
``None``, the mapped pool, the connection serial, and the keys copied early (by index,
:mod:`~kvtier.core.tiers.node.early`)."""


class NodeTier(PoolMemory, EnvelopeTier):
    """See the module docstring.

    Args:
        client: the connection to the owner (:class:`~kvtier.core.tiers.node.client.NodeClient`).
        namespace / secret: as :class:`~kvtier.core.tiers.envelopetier.EnvelopeTier`.
        header_wait_s: longest ``send`` waits for ``produce``'s headers, seconds.
    """

    name = "node"
    shared = True

    def __init__(self, client: NodeClient, namespace: bytes, secret: bytes | None, header_wait_s: float) -> None:
        EnvelopeTier.__init__(self, namespace, secret)
        PoolMemory.__init__(self)
        self.client = client
        self.names = PoolNames(secret)  # pool names and key space (the secret's: kvtier.core.tiers.node.names)
        client.on_map = self._mapped
        self.where = client.socket_path
        self.header_wait_s = header_wait_s
        self.wire = WireCounters()
        self.verifier = Verifier(self.envelope)
        self.locations = Locations()
        self.early_reads = 0  # values served from a copy made while their pin was in flight
        self._lock = threading.Lock()

    def _mapped(self, old: Pool | None, new: Pool) -> None:
        """The client mapped ``new`` (replacing ``old``): move the pin to it."""
        self.locations.clear()
        if old is not None:
            self.unregister_memory(old.data)
        if self.pin_pool:
            self.pin_pool_memory(new)

    def _keys(self, keys: Sequence[ChunkKey]) -> list[bytes]:
        """The pool names of ``keys``: what the owner, the presence table and the envelopes know."""
        return self.names.names(keys)

    def sealed_key(self, key: ChunkKey) -> bytes:
        return self.names.name(key)

    # ---- reads -------------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def contains_now(self, keys: Sequence[ChunkKey]) -> list[bool] | None:
        """Which of ``keys`` the pool's presence table holds, read on this thread without a
        message; ``None`` when it cannot answer now (the pool not mapped yet, its owner not
        beating, a rebuild under way): ask the owner (:meth:`contains_many`)."""
        pool = self.client.pool
        return None if pool is None else lookup(pool.slots, pool.meta, self.namespace, self._keys(keys))

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        found = self.contains_now(keys)
        if found is not None:
            return found
        reply, _, _ = self.client.call(p.Lookup(self.namespace, self._keys(keys)))
        assert isinstance(reply, p.Found)
        return reply.present

    def fetch_many(self, keys: Sequence[ChunkKey]) -> Pins:
        """(:class:`~kvtier.core.tiers.split.SplitTier`) Pin ``keys``: one message."""
        names = self._keys(keys)
        reply, pool, serial = self.client.call(lambda rel: p.Pin(self.namespace, names, rel))
        assert isinstance(reply, p.Pinned)
        return self._pinned(names, reply.leases, pool), pool, serial, {}

    def fetch_many_by(self, keys: Sequence[ChunkKey], deadline: float, during: Callable[[], None] | None,
                      dsts: Sequence[memoryview | Scatter] | None = None) -> Pins:
        """(:class:`~kvtier.core.tiers.split.BoundsItself`) :meth:`fetch_many` on the caller's thread,
        every wait ending by ``deadline`` (``NodeTimeout``, a ``TimeoutError``, past it); ``during()``
        runs while the owner answers (the scatters: :meth:`while_fetching`), then, given ``dsts``,
        the early copies into them (:func:`~kvtier.core.tiers.node.early.copy_early`, within half
        of what is left of the deadline)."""
        early: dict[int, Early] = {}
        names = self._keys(keys)

        def meanwhile() -> None:
            if during is not None:
                during()
            if dsts is not None and (pool := self.client.pool) is not None and self.verifier.inline_only():
                now = time.perf_counter()
                early.update(copy_early(self.verifier, self.locations, pool, names, dsts, now + (deadline - now) / 2))
        reply, pool, serial = self.client.call(lambda rel: p.Pin(self.namespace, names, rel), deadline, meanwhile)
        assert isinstance(reply, p.Pinned)
        return self._pinned(names, reply.leases, pool), pool, serial, early

    def _pinned(self, names: list[bytes], leases: list[Any], pool: Pool) -> list[Any]:
        """``leases``, each value's place noted for the next read's early copy."""
        self.locations.note(pool, [(n, None if pin is None else pin[1:]) for n, pin in zip(names, leases)])
        return leases

    def while_fetching(self, dsts: Sequence[memoryview | Scatter]) -> None:
        """(:class:`~kvtier.core.tiers.guarded.GuardedTier`, on the caller's thread while
        ``fetch_many``'s pin is in flight) Compute the runs of the :class:`Scatter` destinations
        that were planned without them (:meth:`Scatter.later`), so the round trip to the owner hides
        them.  One that cannot be built is left to fail at its copy (a refusal here is not the
        tier's fault)."""
        for dst in dsts:
            if isinstance(dst, Scatter) and dst.unbuilt:  # (a tiled one has nothing to build)
                with contextlib.suppress(ValueError):
                    dst.ready()

    def finish_get(self, keys: Sequence[ChunkKey], fetched: Pins, dsts: Sequence[memoryview],
                   records: TenantRecords | None = None) -> list[GetResult]:
        """(:class:`~kvtier.core.tiers.split.SplitTier`) Copy and verify each pinned value
        (:mod:`~kvtier.core.tiers.node.readcopy`), then check that its pages still carry the pin's
        generation (once for the batch, after every copy); the releases are queued, no socket is
        touched."""
        pins, pool, serial, early = fetched
        t0 = time.perf_counter()
        out: list[GetResult] = [GetResult.MISS] * len(keys)
        held = [i for i, pin in enumerate(pins) if pin is not None]
        if not held:
            return out
        taken = [pin for pin in pins if pin is not None]
        names = self._keys(keys)
        batch_bytes = sum(pin[2] for pin in taken)
        verifier = self.verifier
        cls, overlapped = verifier.begin(batch_bytes, len(held))
        data, page_bytes, copy = memoryview(pool.data), pool.page_bytes, verifier.copy  # type: ignore[arg-type]
        copied: list[Copied | ChunkFormatError] = []
        moved = corrupt = 0
        confirmed: list[int] = []  # keys whose early copy the answer confirmed (served if their pages pass too)
        try:
            for i, (_lease, page, nbytes, gen) in zip(held, taken, strict=True):
                first = early.get(i)
                if first is not None and first.pool is pool and first.where == (page, nbytes, gen):
                    copied.append(first.got)  # copied while the pin was in flight, from these very pages
                    confirmed.append(i)
                    continue
                at = page * page_bytes
                try:
                    copied.append(copy(names[i], data[at:at + nbytes], dsts[i], overlapped))
                except ChunkFormatError as exc:
                    copied.append(exc)
            fresh = pool.same_generations(taken)
            for i, pin, got, same in zip(held, taken, copied, fresh, strict=True):
                if isinstance(got, Pending):
                    try:
                        got = got.result()
                    except ChunkFormatError as exc:
                        got = exc
                if not same:
                    self.locations.forget([names[i]])
                    continue  # the page was granted again (an expired pin) while we copied: a miss, never served
                if isinstance(got, ChunkFormatError):
                    warn_unusable(self._unusable_lines, log, "kvtier node tier", keys[i].hex(), str(got), "deleted, treated as a miss")
                    corrupt += 1
                    self.locations.forget([names[i]])
                    out[i] = GetResult.CORRUPT
                    continue
                if records is not None:
                    note_verified(records, self.namespace, keys[i], got)
                moved += pin[2]
                out[i] = GetResult.HIT
        finally:
            del data
            verifier.end(cls, overlapped, batch_bytes, time.perf_counter() - t0)
            self.client.release_later(serial, [pin[0] for pin in taken])
        served_early = sum(1 for i in confirmed if out[i] is GetResult.HIT)
        if corrupt or served_early:
            with self._counts:
                self.corrupt += corrupt
                self.early_reads += served_early
        if corrupt:
            self.wire.corrupt(corrupt)
        self.wire.moved("read", moved, time.perf_counter() - t0)
        return out

    def get_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> GetResult:
        return self.get_many([key], [dst], records)[0]

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview],
                 records: TenantRecords | None = None) -> list[GetResult]:
        return split_get(self, keys, dsts, lambda: self.fetch_many(keys), self.delete_many, records)

    def load(self, key: ChunkKey) -> bytes | None:
        """The whole stored value of ``key`` copied out of the pool (the blob verbs' read)."""
        (pin,), pool, serial, _ = self.fetch_many([key])
        if pin is None:
            return None
        lease, page, nbytes, gen = pin
        try:
            value = bytes(pool.value(page, nbytes))
        finally:
            self.client.release_later(serial, [lease])
        return value if pool.same_generation(page, nbytes, gen) else None

    # ---- writes ------------------------------------------------------------------------------
    def store(self, key: ChunkKey, value: bytes) -> PutResult:
        """One whole envelope (:class:`~kvtier.core.tiers.envelopetier.EnvelopeTier`'s path)."""
        return self._write([key], [[value]], [len(value)], threading.Event())[0]

    def put(self, key: ChunkKey, data: memoryview | bytes, tenant: Writer | None = None) -> PutResult:
        return self.put_many([key], [data], [tenant])[0]

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                 tenants: Sequence[Writer | None] | None = None) -> list[PutResult]:
        """:meth:`stream_put` on this thread alone: produced, then sent."""
        stream = self.stream_put(keys, datas, tenants)
        try:
            stream.produce(time.perf_counter() + self.header_wait_s)
            return stream.send()
        finally:
            stream.abandon()

    def stream_put(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                   tenants: Sequence[Writer | None] | None = None) -> PutStream:
        """(:class:`~kvtier.core.tiers.split.SplitTier`) See the module docstring."""
        who = writers(tenants, len(keys))
        payloads = [memoryview(d).cast("B") for d in datas]
        bodies = payloads if self.envelope.chain.passthrough else [self.envelope.chain.encode(v) for v in payloads]
        headers: list[bytes] = []
        ready = threading.Event()
        abandoned = threading.Event()

        def produce(_deadline: float) -> None:
            for name, body, payload, writer in zip(self._keys(keys), bodies, payloads, who, strict=True):
                headers.append(self.envelope.header(name, body, payload.nbytes, writer))
            ready.set()

        def send() -> list[PutResult]:
            if not ready.wait(self.header_wait_s) or abandoned.is_set():
                raise WriteAbandoned("the caller gave up before the headers were taken")
            return self._write(keys, [[h, b] for h, b in zip(headers, bodies, strict=True)],
                               [envelope.FIXED_BYTES + b.nbytes for b in bodies], abandoned)
        return PutStream(send, produce, abandoned.set)

    def _write(self, keys: Sequence[ChunkKey], pieces: list[list[Any]], sizes: list[int],
               abandoned: threading.Event) -> list[PutResult]:
        t0 = time.perf_counter()
        names = self._keys(keys)
        reply, pool, _ = self.client.call(lambda rel: p.Alloc(self.namespace, names, sizes, rel, self.names.space))
        assert isinstance(reply, p.Allocated)
        out: list[PutResult] = []
        written: list[int] = []
        given_up: list[int] = []
        grants = reply.grants
        for grant, parts in zip(grants, pieces, strict=True):
            if isinstance(grant, int):
                out.append(PutResult.PRESENT if grant == p.PRESENT else PutResult.NO_ROOM)
                continue
            lease, page, _gen = grant
            if abandoned.is_set():
                given_up.append(lease)
                out.append(PutResult.FAILED)
                continue
            at = page * pool.page_bytes
            for part in parts:
                n = memoryview(part).nbytes
                pool.data[at:at + n] = memoryview(part).cast("B")  # type: ignore[call-overload]
                at += n
            written.append(lease)
            out.append(PutResult.STORED)
        if abandoned.is_set():  # given up at the deadline: publish nothing
            given_up += written
            written = []
            out = [PutResult.FAILED if r is PutResult.STORED else r for r in out]
        reply, _, _ = self.client.call(p.Commit(written, given_up))
        assert isinstance(reply, p.Done)
        ok = iter(reply.ok)
        out = [(PutResult.STORED if next(ok) else PutResult.FAILED) if r is PutResult.STORED else r for r in out]
        self.locations.note(pool, [(k, (g[1], n, g[2])) for k, g, n, r in zip(names, grants, sizes, out, strict=True)
                                   if r is PutResult.STORED and not isinstance(g, int)])  # committed: readable early
        self.wire.moved("write", sum(s for s, r in zip(sizes, out, strict=True) if r is PutResult.STORED),
                        time.perf_counter() - t0)
        return out

    # ---- the rest of the contract ---------------------------------------------------------------
    def delete(self, key: ChunkKey) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        names = self._keys(keys)
        self.locations.forget(names)
        reply, _, _ = self.client.call(p.Delete(self.namespace, names))
        assert isinstance(reply, p.Done)
        return reply.ok

    def clear(self) -> ClearResult:
        """Every value of this namespace and key space in the pool, never another's."""
        self.locations.clear()
        reply, _, _ = self.client.call(p.Clear(self.namespace, self.names.space))
        assert isinstance(reply, p.KeyList)
        return ClearResult(self.names.keys_of(reply.keys))

    def keys(self) -> list[ChunkKey]:
        """This namespace's values in the pool in this key space, least recently used first."""
        reply, _, _ = self.client.call(p.Keys(self.namespace, self.names.space))
        assert isinstance(reply, p.KeyList)
        return self.names.keys_of(reply.keys)

    def indexed(self, key: ChunkKey) -> bool:
        """Whether the pool holds ``key`` (asks the owner: the tier keeps no index of its own)."""
        return self.contains(key)

    def usage(self) -> TierUsage:
        """The pool bytes this engine is counted for (pages, headers included) as of the owner's
        last reply, without waiting (the store asks under its lock; a reply older than
        :data:`~kvtier.core.tiers.node.client.USAGE_MAX_AGE_S` is asked again in the background:
        :meth:`~kvtier.core.tiers.node.client.NodeClient.usage_now`): the values it wrote, and for the
        oldest live writer those of writers gone, so the sum over the host's engines is the pool's
        usage, once (:class:`~kvtier.core.tiers.node.protocol.UsageReply`)."""
        used, values = self.client.usage_now()
        return TierUsage(used, 0, used, values)

    def refresh_usage(self) -> TierUsage:
        """:meth:`usage` asked of the owner now (one message)."""
        self.client.call(p.Usage())
        return self.usage()

    def pool_stats(self, check: bool = False) -> p.StatsReply:
        """The whole pool's numbers (owner's view); with ``check``, its index checked too."""
        reply, _, _ = self.client.call(p.Stats(check))
        assert isinstance(reply, p.StatsReply)
        return reply

    def check(self) -> None:
        problem = self.pool_stats(check=True).problem
        assert not problem, f"node pool index: {problem}"

    def wire_stats(self) -> WireStats:
        return self.wire.snapshot(0, 0)

    def close(self) -> None:
        self.client.flush()
        self.client.close()
        self.verifier.close()
