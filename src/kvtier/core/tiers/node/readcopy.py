"""The node tier's read: a value's payload copied out of the shared pages into the caller's buffer,
and its digest verified over the copy (what is served), never over the shared pages (one pass over
the pool; bytes changed in the pool after the check could not be served).

Two costs decide a load's speed against the cpu tier's (a copy alone), measured on EPYC-2
(docs/benchmarks.md, "The node tier"):

- **The copy's block**: glibc copies a block of up to ``rep_movsb_stop_threshold`` bytes with
  ``rep movsb``, and on AMD that threshold is the L2 size (512 KiB on EPYC-2; glibc 2.36
  sysdeps/x86/dl-cacheinfo.h, ``ld.so --list-diagnostics``); there ``rep movsb`` moved 2 GiB/s
  against 7 GiB/s for larger blocks.  The payload is copied :data:`COPY_BLOCK_BYTES` at a time
  (at or above that threshold on current x86 parts, still within L2/L3 so the digest reads it
  from cache), with ``numpy.copyto``, which releases the GIL (a slice assignment of a memoryview
  holds it, stalling the engine's other threads for the whole copy).
- **The digest** (XXH3-128, the fastest kind the envelope has; or the keyed BLAKE3 MAC with
  ``shared_secret``): about a third of the copy's time when run after it on the same core.  In a
  batch of several values on a host with a core to spare (:data:`OVERLAP_MIN_CPUS`), the digest
  of value ``i`` runs on a helper thread (both hashes and ``numpy.copyto`` release the GIL) while
  value ``i + 1`` is copied, so only the last value's digest stays on the load's path.  Without
  a spare core the helper only waits for one: on EPYC-2 (2 CPUs, load 8.4) a 256 MiB batch of
  2 MiB values took 1.92× the cpu tier's get overlapped against 1.41× inline (median of 11
  interleaved rounds), so there every value is copied and hashed block by block on the caller's
  thread, as a single value always is.

Either way a value whose digest does not match, or that was not verified within
:data:`VERIFY_WAIT_S`, is refused (``EnvelopeError``): a miss, never served.
"""

from __future__ import annotations

import hmac
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from kvtier.core import codecs, envelope
from kvtier.core.keys import ChunkKey

COPY_BLOCK_BYTES = 1 << 20
"""Bytes copied and hashed at a time on the caller's thread (see the module docstring)."""
OVERLAP_MIN_CPUS = 4
"""Usable CPUs from which a batch's digests run on the helper thread (the engine's scheduler and
worker threads keep the others busy; as the disk tier's split reads, never on 2 CPUs)."""
VERIFY_WAIT_S = 30.0
"""Longest the caller waits for a value's digest from the helper thread (a miss after that)."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Pending:
    """A value copied into the caller's buffer whose digest is checked, or being checked.

    :meth:`result` returns the value's tenant record (``None``: the format has none) or raises
    ``ChunkFormatError``."""

    __slots__ = ("_error", "_future", "_record")

    def __init__(self, record: bytes | None = None, future: Future[bytes | None] | None = None) -> None:
        self._record = record
        self._future = future

    def result(self) -> bytes | None:
        """Raises:
            EnvelopeError: digest mismatch, or not verified within :data:`VERIFY_WAIT_S`."""
        if self._future is None:
            return self._record
        try:
            return self._future.result(timeout=VERIFY_WAIT_S)
        except FutureTimeout:
            raise envelope.EnvelopeError(f"not verified within {VERIFY_WAIT_S:g} s") from None


def _digest_matches(hasher: envelope.Hasher, expected: bytes) -> None:
    if not hmac.compare_digest(hasher.digest(), expected):
        raise envelope.EnvelopeError("digest mismatch (corrupt, or written without the shared secret)")


def _verify(env: envelope.Envelope, header: envelope.EnvelopeHeader, head: bytes, out: memoryview) -> bytes | None:
    """The digest of the header fields and ``out`` (the copy) checked against the header's."""
    h = env.hasher(head[:envelope.DIGEST_OFFSET])
    h.update(out)
    _digest_matches(h, header.digest)
    return header.record


class Verifier:
    """Copies values out of the pool and verifies them (see the module docstring); one per tier.

    Args:
        env: the tier's envelope (namespace, digest kind, codec chain).
        overlap: verify on the helper thread while the next value is copied (batches of two or
            more values); ``False``: every value on the caller's thread; ``None``: where this
            process may use at least :data:`OVERLAP_MIN_CPUS` CPUs.
    """

    def __init__(self, env: envelope.Envelope, overlap: bool | None = None) -> None:
        self.env = env
        self.overlap = usable_cpus() >= OVERLAP_MIN_CPUS if overlap is None else overlap
        self._helper: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _executor(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._closed:
                return None
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvtier-node-verify")
            return self._helper

    def copy(self, key: ChunkKey, value: memoryview, dst: memoryview, batched: bool) -> Pending:
        """Copy ``value``'s payload into ``dst`` and check its digest (now, or on the helper thread
        when ``batched`` and :attr:`overlap`: :meth:`Pending.result` then waits for it).  A value
        in another format or with a codec chain that changes the bytes:
        :meth:`~kvtier.core.envelope.Envelope.open_into` on this thread.

        Raises:
            ChunkFormatError: the header does not belong here (namespace, key, length, kind), or,
                checked now, the digest mismatches (``dst`` may then hold unverified bytes).
        """
        head = bytes(value[:envelope.FIXED_BYTES])
        header = envelope.decode_header(head)
        out = memoryview(dst).cast("B")
        if header.format != envelope.FORMAT or header.stored_bytes != header.original_bytes \
                or not codecs.chain_of(header.codecs).passthrough:
            return Pending(self.env.open_into(key, value, dst))
        self.env.check(header, key, out.nbytes)
        if header.stored_bytes != value.nbytes - header.header_bytes:
            raise envelope.EnvelopeError(f"payload is {value.nbytes - header.header_bytes} bytes, "
                                         f"header says {header.stored_bytes}")
        src = np.frombuffer(value, dtype=np.uint8, offset=header.header_bytes)
        target = np.frombuffer(out, dtype=np.uint8)
        helper = self._executor() if batched and self.overlap else None
        if helper is not None:
            np.copyto(target, src)
            try:
                return Pending(future=helper.submit(_verify, self.env, header, head, out))
            except RuntimeError:  # closed meanwhile: verified here
                return Pending(_verify(self.env, header, head, out))
        h = self.env.hasher(head[:envelope.DIGEST_OFFSET])
        for at in range(0, out.nbytes, COPY_BLOCK_BYTES):  # each block hashed while it is in cache
            np.copyto(target[at:at + COPY_BLOCK_BYTES], src[at:at + COPY_BLOCK_BYTES])
            h.update(out[at:at + COPY_BLOCK_BYTES])
        _digest_matches(h, header.digest)
        return Pending(header.record)

    def close(self) -> None:
        """Stop the helper thread (digests in flight finish; later batches verify inline)."""
        with self._lock:
            self._closed = True
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)
