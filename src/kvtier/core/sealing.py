"""Writing a value envelope (:mod:`kvtier.core.envelope`, which documents the layout): the
layout's constants and :class:`EnvelopeWriter`, the writing half of
:class:`~kvtier.core.envelope.Envelope` (its fields, its header, a payload sealed through the
codec chain).  Reading and verifying a value, the part a hit runs, is :mod:`kvtier.core.envelope`'s.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from kvtier.core import codecs, compression, encryption  # noqa: F401 - registers the codecs
from kvtier.core.codecstats import CodecStats
from kvtier.core.envelopedigest import Hasher, mac_key

MAGIC = b"KVTE"
VERSION = 1
FIXED_BYTES = 128
"""Bytes of the header's fields, record and digest (the shared tiers' whole header)."""
DISK_HEADER_BYTES = 4096
"""The disk tier's header block: the fixed header padded so the payload starts on a 4096-byte
boundary, the largest logical block size of common devices, which ``O_DIRECT`` needs."""
DIGEST_BYTES = 16
MAX_CODECS = 5
KIND_CHECKSUM = 0
KIND_MAC = 1
LAYOUT_PAGES = 0
"""Layout id of the payload kvtier writes today: the namespace's page layout."""
FIELDS = struct.Struct("<4sBBH16s16sQQHB5s")  # 64 bytes
RECORD_BYTES = 48
"""Bytes of the tenant record (:mod:`kvtier.core.tenant`; its layout: :mod:`kvtier.core.envelope`)."""
RECORD_OFFSET = FIELDS.size
"""Offset of the tenant record."""
DIGEST_OFFSET = RECORD_OFFSET + RECORD_BYTES
"""Offset of the digest (= bytes it covers before the payload)."""
UNKNOWN_RECORD = bytes(RECORD_BYTES)
"""The record of an unknown tenant: all zero."""
assert DIGEST_OFFSET + DIGEST_BYTES == FIXED_BYTES


class RecordSource(Protocol):
    """Who a value is written for (:data:`kvtier.core.tenant.Writer`): gives its tenant record."""

    def record_in(self, namespace: bytes) -> bytes:
        """The :data:`RECORD_BYTES` tenant record for a value of ``namespace``."""
        ...


class Sealed(NamedTuple):
    """A value to store: ``header`` then ``body`` (after the codec chain: for a passthrough chain the caller's memory)."""

    header: bytes
    body: memoryview


class EnvelopeWriter:
    """Writes envelopes of one namespace: the writing half of :class:`~kvtier.core.envelope.Envelope`.

    Args:
        namespace: 16-byte namespace digest.
        secret: the shared secret (a keyed BLAKE3 MAC), or ``None`` (XXH3-128).
        chain: codec names or ids in write order (:func:`kvtier.core.codecs.chain_of`).
        header_bytes: the payload's offset (:data:`FIXED_BYTES`; the disk tier
            :data:`DISK_HEADER_BYTES`).
        layout: layout id written (:data:`LAYOUT_PAGES`).
        keyring: the operator's master keys (:class:`~kvtier.core.encryption.KeyRing`) for a
            chain with ``aes-256-gcm`` and for reading encrypted values; ``None``: none.

    Attributes:
        stats: the chain's numbers (:class:`~kvtier.core.codecstats.CodecStats`; payload-changing chains only).

    Raises:
        ValueError: a namespace not of 16 bytes, too many codecs, or ``header_bytes`` below
            :data:`FIXED_BYTES` or above 65535.
        CodecError: an unknown codec.
    """

    hasher: Callable[[bytes | memoryview], Hasher]  # declared: the Envelope's (a read hashes with it too)

    def __init__(self, namespace: bytes, secret: bytes | None = None, chain: Sequence[str | int] = ("identity",),
                 header_bytes: int = FIXED_BYTES, layout: int = LAYOUT_PAGES,
                 keyring: encryption.KeyRing | None = None) -> None:
        if len(namespace) != 16:
            raise ValueError(f"namespace digest must be 16 bytes, got {len(namespace)}")
        if not FIXED_BYTES <= header_bytes <= 0xFFFF:
            raise ValueError(f"header_bytes must be {FIXED_BYTES}..65535, got {header_bytes}")
        self.namespace = namespace
        self.chain = codecs.chain_of(chain)
        self.chain.prepare()  # at a tier's start, not inside its first put's deadline
        if len(self.chain.codecs) > MAX_CODECS:
            raise ValueError(f"a codec chain holds at most {MAX_CODECS} codecs, got {len(self.chain.codecs)}")
        self.kind = KIND_CHECKSUM if secret is None else KIND_MAC
        self.mac_key = None if secret is None else mac_key(secret)
        self.header_bytes = header_bytes
        self.layout = layout
        ids = self.chain.ids
        self._ids = len(ids), bytes(ids) + bytes(MAX_CODECS - len(ids))
        self._known = ids  # the chain this envelope writes: known without a look-up
        self._pad = bytes(header_bytes - FIXED_BYTES)
        if self.chain.sealed and keyring is None:
            raise codecs.CodecError('codec aes-256-gcm needs a master key: set "encryption": {"master_key_file": PATH} '
                                    "in kvtier's settings (docs/security.md)")
        self.keyring = keyring
        self.stats = CodecStats()

    def record(self, writer: RecordSource | None) -> bytes:
        """The tenant record of ``writer`` in this namespace (all zero for ``None``: unknown)."""
        return UNKNOWN_RECORD if writer is None else writer.record_in(self.namespace)

    def fields(self, key: bytes, stored_bytes: int, original_bytes: int, record: bytes = UNKNOWN_RECORD) -> bytes:
        """The :data:`DIGEST_OFFSET` header bytes before the digest (which covers them)."""
        count, ids = self._ids
        return FIELDS.pack(MAGIC, VERSION, self.kind, self.header_bytes, self.namespace, key, stored_bytes,
                           original_bytes, self.layout, count, ids) + record

    def finish(self, fields: bytes, digest: bytes) -> bytes:
        """The whole :attr:`header_bytes` header: ``fields``, ``digest`` and the zero padding."""
        return fields + digest + self._pad

    def header(self, key: bytes, body: memoryview | bytes, original_bytes: int | None = None,
               writer: RecordSource | None = None) -> bytes:
        """The header of a value whose stored payload is ``body`` (its original length
        ``original_bytes``, default ``len(body)``), with ``writer``'s tenant record."""
        view = memoryview(body).cast("B")
        fields = self.fields(key, view.nbytes, view.nbytes if original_bytes is None else original_bytes,
                             self.record(writer))
        h = self.hasher(fields)
        h.update(view)
        return self.finish(fields, h.digest())

    def seal(self, key: bytes, payload: memoryview | bytes, writer: RecordSource | None = None) -> Sealed:
        """Header and body of ``payload`` through the codec chain (no copy for a passthrough chain;
        otherwise the codecs' own output buffers).

        Raises:
            CodecError: a codec fails."""
        view = memoryview(payload).cast("B")
        if self.chain.passthrough:
            return Sealed(self.header(key, view, view.nbytes, writer), view)
        record = self.record(writer)
        t0 = time.perf_counter()
        ctx = codecs.CodecContext(self.namespace, record, self.keyring,
                                  lambda stored: self.fields(key, stored, view.nbytes, record))
        body = memoryview(self.chain.encode(view, ctx)).cast("B")
        fields = self.fields(key, body.nbytes, view.nbytes, record)
        h = self.hasher(fields)
        h.update(body)
        head = self.finish(fields, h.digest())
        self.stats.encoded(view.nbytes, body.nbytes, time.perf_counter() - t0)
        return Sealed(head, body)

    def stored_bytes(self, payload_bytes: int) -> int:
        """Bytes a value of ``payload_bytes`` takes (header included) with a passthrough chain."""
        return self.header_bytes + payload_bytes

