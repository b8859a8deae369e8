"""The node tier's read: a value's payload copied out of the shared pages into the caller's buffer,
and its digest verified over the copy (what is served), never over the shared pages (one pass over
the pool; bytes changed in the pool after the check are never served).

What a load costs against the cpu tier's (a copy alone), measured on EPYC-2 with
``scripts/node_load_cost.py`` (docs/benchmarks.md, "The node tier"): the pin round trip and the
batch's bookkeeping cost little (without the digest the load is 0.94-1.13x the cpu tier's; a
header this envelope wrote is compared whole, not decoded, and the generation check is one array
pass per batch); the digest (XXH3-128, the fastest kind the envelope has, or the keyed BLAKE3 MAC
of ``shared_secret``) is the gap.  XXH3 is compute-bound on one core (0.15-0.17x of a copy over a
hot buffer, wherever the bytes sit), so fusing it with the copy (:func:`copy_hashed`) saves the
re-read of the copy but cannot hide the compute: 1.17-1.19x at load 3.5-4.5, 1.24-1.27x at load
5-8.  Two ways, per batch:

- **inline** (every single value, and every batch where the other way is not measured faster):
  the payload is copied :data:`COPY_BLOCK_BYTES` at a time and each block hashed right after, while
  it is in cache (:func:`copy_hashed`).
- **overlapped** (batches of two or more values): each value is copied whole with
  ``numpy.copyto`` (which releases the GIL) and its digest runs on a helper thread (XXH3 and
  BLAKE3 release it too) while the next value is copied, so only the last value's digest stays on
  the load's path when a core is free.  Where none is, the helper waits for one: 1.44-1.58x on
  2 CPUs at load 5-8.

A third destination is not a buffer: a :class:`Scatter` (runs in the caller's memory, an engine's
KV blocks), always inline: each run copied and then hashed from where it landed, payload order
(:func:`scatter_hashed`), so an engine's node-tier hit is one copy from the pool into its blocks.

Which way a batch takes is measured, not assumed: :class:`~kvtier.core.tiers.disk.tier.ReadChooser`
(the serial-or-split chooser the disk tier's buffered reads use too, kept with the read that runs it
per chunk: the medians of recent loads per size class, exploring the other way now and then) decides, and it never tries the overlapped way while twice the loads
in flight reach the usable CPUs (so never on 2 CPUs).  Either way a value whose digest does not
match, or that was not verified within :data:`VERIFY_WAIT_S`, is refused (``EnvelopeError``): a
miss, never served.
"""

from __future__ import annotations

import hmac
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from kvtier.core import codecs, envelope
from kvtier.core.errors import length_problem
from kvtier.core.tiers.disk.tier import ReadChooser
from kvtier.core.tiers.node.scatter import COPY_BLOCK_BYTES, Scatter, Tiles, scatter_hashed

__all__ = ["COPY_BLOCK_BYTES", "Copied", "Pending", "Scatter", "Tiles", "Verifier", "copy_hashed", "scatter_hashed",
           "settle"]

_KEY_AT = 24
"""Offset of the chunk key in an envelope header (:mod:`kvtier.core.envelope`'s layout)."""
VERIFY_WAIT_S = 30.0
"""Longest the caller waits for a value's digest from the helper thread (a miss after that)."""


class Pending:
    """A value copied into the caller's buffer whose digest is being checked on the helper thread
    (the overlapped way; an inline copy returns the value's record at once).

    :meth:`result` returns the value's tenant record (``None``: the format has none) or raises
    ``ChunkFormatError``."""

    __slots__ = ("_future",)

    def __init__(self, future: Future[bytes | None]) -> None:
        self._future = future

    def result(self) -> bytes | None:
        """Raises:
            EnvelopeError: digest mismatch, or not verified within :data:`VERIFY_WAIT_S`."""
        try:
            return self._future.result(timeout=VERIFY_WAIT_S)
        except FutureTimeout:
            raise envelope.EnvelopeError(f"not verified within {VERIFY_WAIT_S:g} s") from None


Copied = bytes | None | Pending
"""What :meth:`Verifier.copy` returns: the verified value's tenant record (``None``: its format has
none), or, overlapped, a :class:`Pending` whose :meth:`~Pending.result` gives it."""


def settle(copied: Copied) -> bytes | None:
    """The tenant record of a value :meth:`Verifier.copy` returned (waiting for its digest if it
    was overlapped).

    Raises:
        ChunkFormatError: its digest did not match, or was not checked in time."""
    return copied.result() if isinstance(copied, Pending) else copied


MISMATCH = "digest mismatch (corrupt, or written without the shared secret)"


def _digest_matches(hasher: envelope.Hasher, expected: bytes) -> None:
    if not hmac.compare_digest(hasher.digest(), expected):
        raise envelope.EnvelopeError(MISMATCH)


def copy_hashed(hasher: envelope.Hasher, src: memoryview, out: memoryview,
                block_bytes: int = COPY_BLOCK_BYTES) -> bytes:
    """Copy ``src`` into ``out`` (both flat byte views of one length) ``block_bytes`` at a time,
    feeding each block of ``out`` (the copy, never ``src``) to ``hasher`` right after it is copied,
    while it is in the CPU cache; return ``hasher.digest()``: the digest of one pass over ``out``
    (any ``block_bytes``, any length, 0 included).

    Raises:
        ValueError: ``out`` and ``src`` differ in length, or ``block_bytes`` < 1."""
    if out.nbytes != src.nbytes or block_bytes < 1:
        raise ValueError(f"cannot copy {src.nbytes} bytes into {out.nbytes} in blocks of {block_bytes}")
    for at in range(0, out.nbytes, block_bytes):
        block = out[at:at + block_bytes]
        block[:] = src[at:at + block_bytes]
        hasher.update(block)
    return hasher.digest()


def _verify(env: envelope.Envelope, head: bytes, out: memoryview) -> bytes:
    """The digest of ``head``'s fields and ``out`` (the copy) checked against ``head``'s; the tenant
    record ``head`` carries (``head``: an envelope's :data:`~kvtier.core.envelope.FIXED_BYTES`)."""
    h = env.hasher(head[:envelope.DIGEST_OFFSET])
    h.update(out)
    _digest_matches(h, head[envelope.DIGEST_OFFSET:envelope.FIXED_BYTES])
    return head[envelope.RECORD_OFFSET:envelope.DIGEST_OFFSET]


class Verifier:
    """Copies values out of the pool and verifies them (see the module docstring); one per tier.

    Attributes:
        overlap: ``None`` (default): each batch's way as :attr:`chooser` measures best; ``True`` /
            ``False``: always overlapped / always inline (tests, ``scripts/node_load_cost.py``).
        chooser: the measurements of both ways (this tier's own).
        block_bytes: bytes copied and hashed at a time inline (:func:`copy_hashed`; default
            :data:`COPY_BLOCK_BYTES`; ``scripts/node_load_cost.py`` sweeps it).
    """

    def __init__(self, env: envelope.Envelope) -> None:
        self.env = env
        self.overlap: bool | None = None
        self.chooser = ReadChooser()
        self.block_bytes = COPY_BLOCK_BYTES
        self._helper: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False
        # the header fields before the record of a value this envelope writes, per payload length
        # (key bytes zero): a header equal to them but for the key passes every check of the
        # general path (format, version, kind, header and payload lengths, layout, codecs), so
        # it needs no decoding; only a passthrough chain's values are copied as they lie
        self._own: dict[int, tuple[bytes, bytes]] = {}
        self._own_ok = env.chain.passthrough and env.header_bytes == envelope.FIXED_BYTES

    def _own_fields(self, nbytes: int) -> tuple[bytes, bytes]:
        """The fields of an own header of a ``nbytes`` payload before the key, and from the key's end
        to the record (:data:`~kvtier.core.envelope.RECORD_OFFSET`)."""
        own = self._own.get(nbytes)
        if own is None:
            fields = self.env.fields(bytes(16), nbytes, nbytes, b"")
            own = fields[:_KEY_AT], fields[_KEY_AT + 16:]
            if len(self._own) >= 64:  # a few chunk sizes in practice; bounded whatever comes
                self._own.clear()
            self._own[nbytes] = own
        return own

    def begin(self, batch_bytes: int, values: int) -> tuple[tuple[int, int] | None, bool]:
        """Start a batch of ``values`` values, ``batch_bytes`` in all: (its class for :meth:`end`,
        whether to overlap).  A single value is always inline (nothing to overlap with)."""
        if values < 2:
            return None, False
        if self.overlap is not None:
            return None, self.overlap
        return self.chooser.begin(batch_bytes)

    def inline_only(self) -> bool:
        """Whether a batch started now is verified inline whatever its size: ``overlap`` ``False``, or
        measured without a spare core (:meth:`begin` would not overlap it: never on 2 CPUs).  Only
        then are values copied early (:mod:`~kvtier.core.tiers.node.early`, always inline)."""
        chooser = self.chooser
        return self.overlap is False or (self.overlap is None and chooser.force != "split"
                                         and 2 * (chooser.running + 1) >= chooser.cpus)

    def end(self, cls: tuple[int, int] | None, overlapped: bool, batch_bytes: int, seconds: float) -> None:
        """Record a batch :meth:`begin` started (its copies and digests took ``seconds``)."""
        if cls is not None:
            self.chooser.end(cls, overlapped, batch_bytes, seconds)

    def _executor(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._closed:
                return None
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvtier-node-verify")
            return self._helper

    def copy(self, key: bytes, value: memoryview, dst: memoryview | Scatter, overlapped: bool) -> Copied:
        """Copy ``value``'s payload into ``dst`` and check its digest: now (the value's tenant record
        is returned), or on the helper thread when ``overlapped`` (a :class:`Pending`: its
        :meth:`~Pending.result` waits for it; :func:`settle` either).  A header this envelope
        writes for ``dst``'s length and ``key`` (the key the envelope carries) is compared whole (no decoding); any other header
        is decoded and checked field by field.  A value in another format or with a codec chain
        that changes the bytes: :meth:`~kvtier.core.envelope.Envelope.open_into` on this thread.
        A :class:`Scatter` ``dst`` is always checked now (:func:`scatter_hashed`).

        Raises:
            ChunkFormatError: the header does not belong here (namespace, key, length, kind), or,
                checked now, the digest mismatches (``dst`` may then hold unverified bytes).
        """
        head = value[:envelope.FIXED_BYTES].tobytes()
        scatter = dst if isinstance(dst, Scatter) else None
        out = memoryview(b"") if scatter is not None else memoryview(dst).cast("B")  # type: ignore[arg-type]
        nbytes = scatter.nbytes if scatter is not None else out.nbytes
        if self._own_ok and value.nbytes == envelope.FIXED_BYTES + nbytes:
            before, after = self._own_fields(nbytes)
            own = head[:_KEY_AT] == before and head[_KEY_AT:_KEY_AT + 16] == key \
                and head[_KEY_AT + 16:envelope.RECORD_OFFSET] == after
        else:
            own = False
        if not own:
            header = envelope.decode_header(head)
            if header.format != envelope.FORMAT or header.stored_bytes != header.original_bytes \
                    or not codecs.chain_of(header.codecs).passthrough:
                if scatter is None:
                    return self.env.open_into(key, value, out)
                opened = bytearray(nbytes)  # decoded and verified here, then scattered
                record = self.env.open_into(key, value, memoryview(opened))
                scatter_hashed(None, memoryview(opened), scatter)
                return record
            self.env.check(header, key, nbytes)
            if problem := length_problem(value.nbytes, header.header_bytes, header.stored_bytes):
                raise envelope.EnvelopeError(problem)
            value = value[header.header_bytes:]
        else:
            value = value[envelope.FIXED_BYTES:]
        if scatter is not None:
            digest = scatter_hashed(self.env.hasher(head[:envelope.DIGEST_OFFSET]), value, scatter, self.block_bytes)
            if not hmac.compare_digest(digest, head[envelope.DIGEST_OFFSET:envelope.FIXED_BYTES]):
                raise envelope.EnvelopeError(MISMATCH)
            return head[envelope.RECORD_OFFSET:envelope.DIGEST_OFFSET]
        helper = self._executor() if overlapped else None
        if helper is not None:
            np.copyto(np.frombuffer(out, dtype=np.uint8), np.frombuffer(value, dtype=np.uint8))
            try:
                return Pending(helper.submit(_verify, self.env, head, out))
            except RuntimeError:  # closed meanwhile: verified here
                return _verify(self.env, head, out)
        digest = copy_hashed(self.env.hasher(head[:envelope.DIGEST_OFFSET]), value, out, self.block_bytes)
        if not hmac.compare_digest(digest, head[envelope.DIGEST_OFFSET:envelope.FIXED_BYTES]):
            raise envelope.EnvelopeError(MISMATCH)
        return head[envelope.RECORD_OFFSET:envelope.DIGEST_OFFSET]

    def close(self) -> None:
        """Stop the helper thread (digests in flight finish; later batches verify inline)."""
        with self._lock:
            self._closed = True
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)
