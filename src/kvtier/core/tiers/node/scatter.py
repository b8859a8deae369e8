"""A node-tier read's destination in the caller's memory: :class:`Scatter`, runs of bytes (an engine's
KV blocks) each taking a slice of the payload, and :func:`scatter_hashed`, the copy into them that
hashes each run from where it landed, in payload order (what is verified is what is served;
:mod:`~kvtier.core.tiers.node.readcopy` checks the digest)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvtier.core import envelope

COPY_BLOCK_BYTES = 256 << 10
"""Bytes copied and hashed at a time inline (64 KiB to 1 MiB measured alike, 2026-12-05; the
digest after a whole 4 MiB copy 0.1x slower)."""


class Scatter:
    """A destination that is not one buffer: runs of bytes in the caller's memory (an engine's KV
    blocks, :mod:`kvtier.integrations.vllm.worker.direct`), each taking a slice of the payload.  A
    node-tier read into a scatter copies each run straight from the pool's pages into its target
    (the one copy a load needs, no cpu page between) and checks the digest over the payload in
    order, each run hashed from its target right after it is copied (:func:`scatter_hashed`): what
    is verified is what is served, as for a buffer.  The caller keeps the targets valid for the read.

    Attributes:
        nbytes: the payload's length (the value's, checked against its header as a buffer's is).
        offsets / targets: per run, ascending and not overlapping in the payload: where it starts in
            the payload, and the flat writable byte view it is copied into (its length is the run's).
            Payload bytes no run takes are hashed where they lie, not copied.  A :meth:`tiled`
            scatter makes these lists only when they are read (:func:`scatter_hashed` does not).
    """

    __slots__ = ("_fill", "_offsets", "_targets", "_tiled", "nbytes")

    def __init__(self, nbytes: int, offsets: list[int], targets: list[memoryview]) -> None:
        if len(offsets) != len(targets):
            raise ValueError("offsets and targets differ in length")
        end = 0
        for at, target in zip(offsets, targets):
            if at < end or target.readonly or target.format != "B" or target.ndim != 1:
                raise ValueError(f"run at {at} overlaps the one before, or its target is not flat writable bytes")
            end = at + target.nbytes
        if end > nbytes:
            raise ValueError(f"runs end at {end}, past the payload's {nbytes} bytes")
        self.nbytes = nbytes
        self._offsets, self._targets = offsets, targets
        self._fill: Callable[[], tuple[list[int], list[memoryview]]] | None = None
        self._tiled: Tiles | None = None

    @classmethod
    def built(cls, nbytes: int, offsets: list[int], targets: list[memoryview]) -> Scatter:
        """A scatter whose runs its caller computed to be what the constructor checks (ascending, not
        overlapping, within ``nbytes``, flat writable bytes: :class:`~kvtier.integrations.vllm.worker.direct.DirectTargets`
        from the cache's layout), without the check per run (a load's ~1,500 runs: ~0.5 ms)."""
        scatter = cls.__new__(cls)
        scatter.nbytes, scatter._offsets, scatter._targets = nbytes, offsets, targets
        scatter._fill = scatter._tiled = None
        return scatter

    @classmethod
    def later(cls, nbytes: int, fill: Callable[[], tuple[list[int], list[memoryview]]]) -> Scatter:
        """A scatter whose runs ``fill()`` computes (as :meth:`built`'s, unchecked) when first needed
        (:meth:`ready`): a load plans its node-tier reads without their runs, and they are built on
        the load's thread while its pin is in flight (:meth:`~kvtier.core.tiers.node.tier.NodeTier.while_fetching`),
        or at the copy at the latest."""
        scatter = cls.built(nbytes, [], [])
        scatter._fill = fill
        return scatter

    @classmethod
    def tiled(cls, lanes: Sequence[tuple[memoryview, int]], at: int, run_bytes: int) -> Scatter:
        """A scatter of ``len(lanes)`` runs of ``run_bytes`` each that tile the payload in order (run
        ``i`` is payload bytes ``i * run_bytes`` onwards) and go to ``view[at + offset:][:run_bytes]``
        of lane ``i``'s ``(view, offset)``: an engine's block of a page of one block, one lane per
        layer's run (:class:`~kvtier.integrations.vllm.worker.direct.DirectTargets`).  Nothing is built
        per run until the copy, which takes each target as it copies it (a 4,000-token hit's 744 runs:
        no list of views built and walked again); ``lanes`` is shared, not copied.  The caller checks
        that every target lies within its view (as :meth:`built`'s).

        Raises:
            ValueError: ``run_bytes`` < 1."""
        if run_bytes < 1:
            raise ValueError(f"runs of {run_bytes} bytes")
        scatter = cls.built(len(lanes) * run_bytes, [], [])
        scatter._tiled = Tiles(lanes, at, run_bytes)
        return scatter

    @property
    def unbuilt(self) -> bool:
        """Whether its runs are still to be computed (:meth:`ready`)."""
        return self._fill is not None

    @property
    def tiles(self) -> Tiles | None:
        """A :meth:`tiled` scatter's runs (``None``: its runs are lists)."""
        return self._tiled

    @property
    def offsets(self) -> list[int]:
        self._runs()
        return self._offsets

    @property
    def targets(self) -> list[memoryview]:
        self._runs()
        return self._targets

    def _runs(self) -> None:
        """A :meth:`tiled` scatter's runs as lists (once; only where they are read as lists)."""
        tiles = self._tiled
        if tiles is not None and len(self._targets) != len(tiles.lanes):
            at, n = tiles.at, tiles.run_bytes
            self._offsets = list(range(0, len(tiles.lanes) * n, n))
            self._targets = [view[at + offset:at + offset + n] for view, offset in tiles.lanes]

    def ready(self) -> Scatter:
        """This scatter with its runs computed (once).

        Raises:
            ValueError: ``fill`` refused (its runs do not fit the cache); it is asked again next time."""
        if self._fill is not None:
            self._offsets, self._targets = self._fill()
            self._fill = None
        return self


class Tiles(NamedTuple):
    """A :meth:`Scatter.tiled` scatter's runs: per run its ``(view, offset)``, the offset added to
    every run's, and the bytes of each."""

    lanes: Sequence[tuple[memoryview, int]]
    at: int
    run_bytes: int


def _scatter_tiled(hasher: envelope.Hasher | None, src: memoryview, tiles: Tiles) -> bytes:
    """:func:`scatter_hashed` of a :meth:`Scatter.tiled` scatter whose runs are at most a block each:
    each run's target taken, copied into and hashed in one pass."""
    at, n, piece = tiles.at, tiles.run_bytes, 0
    if hasher is None:
        for view, offset in tiles.lanes:
            view[at + offset:at + offset + n] = src[piece:piece + n]
            piece += n
        return b""
    update = hasher.update
    for view, offset in tiles.lanes:
        target = view[at + offset:at + offset + n]
        target[:] = src[piece:piece + n]
        update(target)
        piece += n
    return hasher.digest()


def scatter_hashed(hasher: envelope.Hasher | None, src: memoryview, dst: Scatter,
                   block_bytes: int = COPY_BLOCK_BYTES) -> bytes:
    """Copy each of ``dst``'s runs out of ``src`` (the payload, ``dst.nbytes`` long) into its target,
    ``block_bytes`` at most at a time, feeding each copied piece (the target, never ``src``) to
    ``hasher`` right after it is copied, and the payload bytes no run takes from ``src``, in payload
    order; return the digest: that of one pass over the payload as served.  ``hasher`` ``None``: the
    copies alone (bytes already verified), ``b""`` returned.

    Raises:
        ValueError: ``src`` is not ``dst.nbytes`` long, or ``block_bytes`` < 1."""
    if src.nbytes != dst.nbytes or block_bytes < 1:
        raise ValueError(f"cannot scatter {src.nbytes} bytes as {dst.nbytes} in blocks of {block_bytes}")
    if (tiles := dst._tiled) is not None and tiles.run_bytes <= block_bytes:
        return _scatter_tiled(hasher, src, tiles)
    dst.ready()
    if hasher is None:
        for at, target in zip(dst.offsets, dst.targets):
            target[:] = src[at:at + target.nbytes]
        return b""
    update, hashed = hasher.update, 0
    for at, target in zip(dst.offsets, dst.targets):
        if at > hashed:
            update(src[hashed:at])
        n = target.nbytes
        if n <= block_bytes:
            target[:] = src[at:at + n]
            update(target)
        else:
            for piece_at in range(0, n, block_bytes):
                piece_end = min(piece_at + block_bytes, n)
                piece = target[piece_at:piece_end]
                piece[:] = src[at + piece_at:at + piece_end]
                update(piece)
        hashed = at + n
    if hashed < dst.nbytes:
        update(src[hashed:])
    return hasher.digest()
