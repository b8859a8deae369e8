"""Node-tier reads straight into a caller's scattered destination (issue 38: an engine's node-tier
hit copied once, from the pool's pages into its KV blocks; :class:`Scatter`,
:func:`scatter_hashed`, ``prepare_load(into=...)``).

- the digest over the payload in order, with the runs copied between its updates, is the writer's
  one-shot digest at any block size, and the runs (only they) land at their addresses;
- a changed payload byte, in a copied run or in bytes no run takes, is refused;
- through a real store and pool owner: the chunks land in the destination and are not promoted
  into the cpu tier; a chunk with a byte flipped in the pool ends the prefix there, counted corrupt,
  and a destination the caller did not give (``into`` answering ``None``) still gets a cpu page.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.core import envelope
from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.handles import NO_BUFFER
from kvtier.core.keys import ChunkKey, Namespace, chunk_keys, request_root
from kvtier.core.store import TieredStore
from kvtier.core.tiers.node import protocol
from kvtier.core.tiers.node.readcopy import COPY_BLOCK_BYTES, Scatter, Verifier, scatter_hashed
from kvtier.core.tiers.node.tier import NodeTier
from kvtier.core.tiers.wrappers import unwrap
from tests.core.test_node_readcopy import NS, SECRET, one_shot, payload

RUN = 300


def scatter_over(dst: np.ndarray, nbytes: int, runs: list[tuple[int, int, int]]) -> Scatter:
    """A :class:`Scatter` whose runs ``(payload offset, offset in dst, bytes)`` go into ``dst``."""
    view = memoryview(dst)
    return Scatter(nbytes, [r[0] for r in runs], [view[r[1]:r[1] + r[2]] for r in runs])


def shuffled_runs(nbytes: int, seed: int) -> list[tuple[int, int, int]]:
    """Whole runs of :data:`RUN` bytes over ``nbytes`` (a shorter tail left out), every third one left
    out too, each placed somewhere else in a destination of ``nbytes`` (a permutation of the run
    slots: as blocks lie in a cache)."""
    starts = list(range(0, nbytes - RUN + 1, RUN))
    places = np.random.default_rng(seed).permutation(len(starts))
    return [(at, int(places[i]) * RUN, RUN) for i, at in enumerate(starts) if i % 3 != 1]


@pytest.mark.parametrize("secret", [None, SECRET], ids=["xxh3", "mac"])
@pytest.mark.parametrize("block_bytes", [1, 7, 1000, COPY_BLOCK_BYTES])
def test_the_scattered_copy_digests_the_whole_payload_in_order_and_moves_only_its_runs(secret, block_bytes):
    env = envelope.Envelope(NS, secret)
    for nbytes in (0, 1, RUN - 1, RUN, 10 * RUN + 17, 7 * 1000 + 3):
        body = payload(nbytes, 70 + nbytes)
        fields = env.header(bytes(16), body)[:envelope.DIGEST_OFFSET]
        runs = shuffled_runs(nbytes, nbytes)
        dst = np.full(nbytes, 0xEE, dtype=np.uint8)
        digest = scatter_hashed(env.hasher(fields), memoryview(body), scatter_over(dst, nbytes, runs), block_bytes)
        assert digest == one_shot(secret, fields, body), nbytes
        want = np.full(nbytes, 0xEE, dtype=np.uint8)
        src = np.frombuffer(body, dtype=np.uint8)
        for at, to, n in runs:
            want[to:to + n] = src[at:at + n]
        assert np.array_equal(dst, want), nbytes


def test_the_verifier_refuses_a_changed_byte_copied_or_not_and_serves_the_rest():
    """A stored value read into a scatter: its record back and its runs in place; one byte changed in
    a run that is copied, or in a run no destination takes, refused (``EnvelopeError``: a miss)."""
    env = envelope.Envelope(NS)
    verifier = Verifier(env)
    verifier.block_bytes = 1000
    key = ChunkKey(bytes(range(100, 116)))
    nbytes = 30 * RUN
    body = payload(nbytes, 5)
    value = bytearray(env.header(bytes(key), body) + body)
    runs = shuffled_runs(nbytes, 1)
    dst = np.zeros(nbytes, dtype=np.uint8)
    assert verifier.copy(key, memoryview(value), scatter_over(dst, nbytes, runs), True) == env.record(None)
    assert all(bytes(dst[to:to + n]) == body[at:at + n] for at, to, n in runs)
    skipped = RUN + 5  # the second run: no destination takes it (shuffled_runs leaves every third out)
    assert not any(at <= skipped < at + n for at, _, n in runs)
    for at in (runs[0][0], runs[-1][0] + RUN - 1, skipped):
        changed = bytearray(value)
        changed[envelope.FIXED_BYTES + at] ^= 0x04
        with pytest.raises(envelope.EnvelopeError, match="digest mismatch"):
            verifier.copy(key, memoryview(changed), scatter_over(dst, nbytes, runs), False)
    with pytest.raises(envelope.EnvelopeError, match="is not the expected"):  # a scatter of another length
        verifier.copy(key, memoryview(value), scatter_over(dst, nbytes - 1, runs[:-1]), False)
    verifier.close()


def test_runs_that_overlap_or_pass_the_payload_and_targets_that_are_not_writable_bytes_are_refused():
    buf = memoryview(bytearray(200))
    for offsets, targets in (([0, 10], [buf[:20], buf[20:25]]), ([90], [buf[:20]]), ([0], [memoryview(b"x" * 5)]),
                             ([0], [memoryview(np.zeros(4, np.float32))]), ([0], [buf.cast("B", (10, 20))])):
        with pytest.raises(ValueError):
            Scatter(100, offsets, targets)
    assert Scatter(100, [0, 20], [buf[:20], buf[20:100]]).nbytes == 100  # the same runs, adjacent and within
    with pytest.raises(ValueError, match="differ in length"):
        Scatter(10, [0], [])
    with pytest.raises(ValueError, match="cannot scatter"):
        scatter_hashed(None, memoryview(b"abc"), Scatter(2, [], []))


CHUNK_TOKENS = 16
DIRECT_NS = Namespace("direct-test", "uint8", 1, 1, 1, "flat", chunk_tokens=CHUNK_TOKENS)


def two_engines(socket: str, chunk: int) -> tuple[TieredStore, TieredStore]:
    """Two engines' stores (a cpu tier of 16 ``chunk``-byte chunks over the node pool at ``socket``,
    5 s deadlines): A saves, B loads."""
    config = KVTierConfig.from_dict({"chunk_tokens": CHUNK_TOKENS, "cpu_gib": 16 * chunk / GiB, "tiers": ["cpu", "node"],
                                     "node_socket": socket, "shared_deadline_s": 5.0,
                                     "shared_transfer_deadline_s": 5.0, "node_timeout_s": 5.0})
    return TieredStore(config, DIRECT_NS, chunk), TieredStore(config, DIRECT_NS, chunk)


def test_a_store_reads_node_chunks_into_the_callers_blocks_without_promoting_them(node_server):
    """Engine A's store saves 4 chunks to the pool; engine B's store loads them with ``into`` giving
    chunks 0-2 a scatter over a "KV cache" (each chunk's runs spread over it) and chunk 3 none: 0-2
    land in the cache and not in B's cpu tier, 3 in a cpu page; with read-ahead, reads into the
    caller's runs are all done before ``prepare_load`` returns.  Then a byte of chunk 1 is flipped
    in the pool: B's next load ends after chunk 0 (chunk 1 counted corrupt), chunk 0 in place."""
    chunk = 24 * RUN
    a, b = two_engines(node_server.socket, chunk)
    try:
        chain = chunk_keys(request_root(DIRECT_NS, cache_salt="d"), np.arange(4 * CHUNK_TOKENS), CHUNK_TOKENS)
        datas = [np.frombuffer(payload(chunk, 90 + i), dtype=np.uint8) for i in range(4)]
        a.put(chain, datas)
        assert a.flush(60.0) and a.stats().tiers["node"].num_chunks == 4
        cache = np.zeros(4 * chunk, dtype=np.uint8)
        runs = {pos: [(at, to + pos * chunk, n) for at, to, n in shuffled_runs(chunk, pos)] for pos in range(3)}
        gave: list[int] = []

        def into(pos: int) -> Scatter | None:
            gave.append(pos)
            return scatter_over(cache, chunk, runs[pos]) if pos in runs else None

        handle = b.prepare_load(chain, into=into)
        assert handle.wait(30.0) and handle.num_chunks == 4 and gave == [0, 1, 2, 3]
        assert [buf is NO_BUFFER for buf in handle.buffers] == [True, True, True, False]
        assert np.array_equal(handle.buffers[3], datas[3])
        b.complete_load(handle, True)
        for pos in range(3):
            assert all(np.array_equal(cache[to:to + n], datas[pos][at:at + n]) for at, to, n in runs[pos]), pos
        assert [b.index.cpu.contains(k) for k in chain] == [False, False, False, True]  # only chunk 3 promoted
        assert b.stats().tiers["node"].load_hit_chunks == 4

        # with read-ahead (as the engine's loader asks), reads into the caller's runs are one batch
        # now: no background reads (io_threads is 2, three chunks), every chunk in place on return
        cache[:] = 0
        handle = b.prepare_load(chain[:3], read_ahead=True, into=into)
        assert handle.pending is None and handle.ready_chunks() == handle.num_chunks == 3
        b.complete_load(handle, True)
        assert all(np.array_equal(cache[to:to + n], datas[2][at:at + n]) for at, to, n in runs[2])

        inner = unwrap(b.index.shared[0].tier)
        assert isinstance(inner, NodeTier)
        reply, pool, serial = inner.client.call(protocol.Pin(bytes(inner.namespace), [bytes(chain[1])], []))
        (lease, page, nbytes, _gen), = reply.leases
        pool.value(page, nbytes)[envelope.FIXED_BYTES + chunk // 2] ^= 0x01
        inner.client.release_later(serial, [lease])
        cache[:] = 0
        handle = b.prepare_load(chain[:3], into=into)
        assert handle.wait(30.0) and handle.num_chunks == 1
        b.complete_load(handle, True)
        assert all(np.array_equal(cache[to:to + n], datas[0][at:at + n]) for at, to, n in runs[0])
        assert b.stats().tiers["node"].corrupt_chunks == 1
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("block_bytes", [1, 2, 64])
def test_a_scatter_writes_nowhere_but_its_targets(block_bytes):
    """The bytes around a run's target stay as they were, whether the run is copied whole or in pieces."""
    dst = np.full(64, 7, dtype=np.uint8)
    env = envelope.Envelope(NS)
    digest = scatter_hashed(env.hasher(b""), memoryview(bytes(range(10))), Scatter(10, [2], [memoryview(dst)[30:35]]),
                            block_bytes)
    assert list(dst[28:37]) == [7, 7, 2, 3, 4, 5, 6, 7, 7] and int(np.count_nonzero(dst == 7)) == 59
    assert digest == one_shot(None, b"", bytes(range(10)))


def test_deferred_scatters_are_built_on_the_loading_thread_while_the_pin_is_in_flight(node_server, monkeypatch):
    """A load whose ``into`` hands out scatters without their runs (:meth:`Scatter.later`, as the
    engine's :class:`~kvtier.integrations.vllm.worker.direct.DirectTargets` does): the pin is sent,
    then each scatter's runs are computed once, on the thread that called ``prepare_load``, then
    the owner's answer is read on that thread too (the pin needs no other thread:
    :class:`~kvtier.core.tiers.split.BoundsItself`), and the chunks land in them.  A scatter whose
    runs cannot be built fails the load on the caller's thread (a ``ValueError``), not the tier: the
    next load is served."""
    chunk = 24 * RUN
    a, b = two_engines(node_server.socket, chunk)
    try:
        chain = chunk_keys(request_root(DIRECT_NS, cache_salt="later"), np.arange(3 * CHUNK_TOKENS), CHUNK_TOKENS)
        datas = [np.frombuffer(payload(chunk, 40 + i), dtype=np.uint8) for i in range(3)]
        a.put(chain, datas)
        assert a.flush(60.0)
        inner = unwrap(b.index.shared[0].tier)
        assert isinstance(inner, NodeTier)
        events: list[tuple[str, int]] = []
        real_frame, real_recv = protocol.frame, inner.client._recv

        def frame(request):  # what the engine sends, as it is sent
            events.append((f"sent {type(request).__name__}", threading.get_ident()))
            return real_frame(request)

        def recv(sock, deadline=None):
            events.append(("answer read", threading.get_ident()))
            return real_recv(sock, deadline)
        monkeypatch.setattr(protocol, "frame", frame)
        inner.client._recv = recv  # type: ignore[method-assign]
        cache = np.zeros(3 * chunk, dtype=np.uint8)
        runs = {pos: [(at, to + pos * chunk, n) for at, to, n in shuffled_runs(chunk, pos)] for pos in range(3)}

        def into(pos: int) -> Scatter:
            def fill() -> tuple[list[int], list[memoryview]]:
                events.append(("fill", threading.get_ident()))
                built = scatter_over(cache, chunk, runs[pos])
                return built.offsets, built.targets
            return Scatter.later(chunk, fill)

        handle = b.prepare_load(chain, read_ahead=True, into=into)
        assert handle.ready_chunks() == handle.num_chunks == 3
        b.complete_load(handle, True)
        me = threading.get_ident()
        pin = events.index(("sent Pin", me))
        assert events[pin:pin + 5] == [("sent Pin", me)] + [("fill", me)] * 3 + [("answer read", me)]
        assert sum(e[0] == "fill" for e in events) == 3  # each scatter's runs built once
        for pos in range(3):
            assert all(np.array_equal(cache[to:to + n], datas[pos][at:at + n]) for at, to, n in runs[pos]), pos

        def refused() -> tuple[list[int], list[memoryview]]:
            raise ValueError("block ids outside the cache")
        with pytest.raises(ValueError, match="outside the cache"):
            b.prepare_load(chain[:1], read_ahead=True, into=lambda pos: Scatter.later(chunk, refused))
        assert b.index.shared[0].tier.breaker.state.name.lower() == "closed"
        cache[:] = 0
        handle = b.prepare_load(chain[:1], read_ahead=True, into=into)
        assert handle.num_chunks == 1
        b.complete_load(handle, True)
        assert all(np.array_equal(cache[to:to + n], datas[0][at:at + n]) for at, to, n in runs[0])
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("block_bytes", [RUN - 1, RUN, COPY_BLOCK_BYTES])
def test_a_tiled_scatter_digests_and_lands_as_the_same_runs_built_as_lists(block_bytes):
    """:meth:`Scatter.tiled` (runs tiling the payload, each at its lane's view + an offset): the digest
    is the writer's one-shot digest and each run lands where the equivalent built scatter puts it,
    whether the runs are copied in one pass (at most a block each) or in pieces (a smaller block);
    its runs read as lists are those; a run whose target is past its view is refused."""
    env = envelope.Envelope(NS)
    lanes_n, at = 6, 2 * RUN
    body = payload(lanes_n * RUN, 9)
    fields = env.header(bytes(16), body)[:envelope.DIGEST_OFFSET]
    caches = [np.zeros(6 * RUN, dtype=np.uint8) for _ in range(3)]
    lanes = [(memoryview(caches[i % 3]), (i // 3) * RUN) for i in range(lanes_n)]
    tiled = Scatter.tiled(lanes, at, RUN)
    assert tiled.nbytes == len(body) and tiled.tiles is not None
    assert scatter_hashed(env.hasher(fields), memoryview(body), tiled, block_bytes) == one_shot(None, fields, body)
    want = [np.zeros(6 * RUN, dtype=np.uint8) for _ in range(3)]
    built = Scatter(len(body), [i * RUN for i in range(lanes_n)],
                    [memoryview(want[i % 3])[at + (i // 3) * RUN:][:RUN] for i in range(lanes_n)])
    scatter_hashed(None, memoryview(body), built)
    assert all(np.array_equal(c, w) for c, w in zip(caches, want))
    assert tiled.offsets == built.offsets and [bytes(t) for t in tiled.targets] == [bytes(t) for t in built.targets]
    past = Scatter.tiled([(memoryview(caches[0]), 5 * RUN)], at, RUN)
    with pytest.raises(ValueError):
        scatter_hashed(env.hasher(fields), memoryview(body[:RUN]), past)
