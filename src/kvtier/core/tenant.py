"""Who a chunk was saved for: the tenant record stored with a chunk so that ``kvtier purge
--salt``/``--lora`` can find it later (issue 22 item 3).

A chunk key folds the request's ``cache_salt`` and LoRA adapter into its root
(:func:`kvtier.core.keys.request_root`), so neither can be recovered from a stored chunk.  The
record keeps, next to the chunk, a digest of each:

1. the scheduler, which sees the request, turns ``cache_salt`` and the LoRA adapter's name into a
   :class:`TenantId` (:meth:`TenantId.of`: 16-byte BLAKE3 digests, derive-key contexts
   :data:`SALT_CONTEXT` / :data:`LORA_CONTEXT`; the raw salt never leaves the scheduler) and
   ships it with the save job;
2. the store writing the chunk keys each digest by its namespace (:func:`record`: BLAKE3 keyed
   by a key derived from the namespace digest), so equal salts under two models give unrelated
   bytes, and writes the 48-byte :data:`RECORD_BYTES` record into the value envelope
   (:mod:`kvtier.core.envelope`).

The record crosses the tier interface as an argument, never as thread state: a write takes the
:data:`Writer` (``Tier.put(key, data, tenant)``), and a read fills the :data:`TenantRecords` dict
its caller passes with the records of the values it verified (``Tier.get_many(keys, dsts,
records)``, :func:`note_verified`).

Layout of the record (little-endian)::

    offset  size  field
    0       4     magic b"KVTN"
    4       1     record version (1)
    5       1     flags: bit 0 a salt was given, bit 1 a LoRA adapter was given
    6       2     zero
    8       16    keyed digest of the cache_salt (zero without one)
    24      16    keyed digest of the LoRA adapter's name (zero without one)
    40      8     XXH3-64 of bytes 0..39

A record that is absent (all zero: a chunk saved before this record existed, or by a writer that
did not know its tenant) is **unknown**: ``--salt``/``--lora`` never match it, and ``kvtier
purge`` reports how many chunks were left for that reason.  One that is present but fails its
check (:func:`read` raises :class:`DamagedRecord`) is never trusted: the purge leaves the chunk
alone and names it as a problem.  A request without a
salt writes a known record with flag bit 0 clear: it is never matched by ``--salt``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import blake3
import xxhash

MAGIC = b"KVTN"
VERSION = 1
RECORD_BYTES = 48
DIGEST_BYTES = 16
SALT_CONTEXT = "kvtier tenant v1 cache_salt"
LORA_CONTEXT = "kvtier tenant v1 lora name"
NAMESPACE_KEY_CONTEXT = "kvtier tenant v1 namespace key"
HAS_SALT = 1
HAS_LORA = 2
_FIELDS = struct.Struct("<4sBBH16s16s")  # 40 bytes, then their XXH3-64
_ZERO_DIGEST = bytes(DIGEST_BYTES)


@dataclass(frozen=True)
class TenantId:
    """A request's tenant as the scheduler ships it to the workers: unkeyed digests.

    Attributes:
        salt: 16-byte digest of ``cache_salt`` (``b""``: the request had none).
        lora: 16-byte digest of the LoRA adapter's name (``b""``: the base model).
    """

    salt: bytes = b""
    lora: bytes = b""

    @property
    def quota_key(self) -> bytes:
        """The tenant quotas' key (:mod:`kvtier.core.quota`): the salt digest (``b""``: no salt)."""
        return self.salt

    @classmethod
    def of(cls, cache_salt: str | None, lora_name: str | None) -> TenantId:
        """The tenant of a request with this ``cache_salt`` (vLLM ``Request.cache_salt``) and LoRA
        adapter name (``Request.lora_request.lora_name``); ``None`` for either when absent."""
        return cls(_id(SALT_CONTEXT, cache_salt), _id(LORA_CONTEXT, lora_name))


@dataclass(frozen=True)
class RecordedTenant:
    """A chunk's tenant known only by the record a verified shared value or chunk file carried (a
    chunk read from the redis, s3 or disk tier and promoted into the cpu tier, issue 22): the keyed digests cannot be
    turned back into a :class:`TenantId`, so the record itself travels on, and a tier that writes
    the chunk down (the disk tier's header) writes the same :data:`RECORD_BYTES` bytes.

    Attributes:
        namespace: 16-byte namespace digest the record is keyed by (:func:`record`).
        raw: the :data:`RECORD_BYTES` record as read, its own check passed (:func:`read`).
    """

    namespace: bytes
    raw: bytes

    @property
    def quota_key(self) -> bytes | None:
        """The tenant quotas' key (:mod:`kvtier.core.quota`): ``b""`` for a chunk saved without a
        ``cache_salt`` (all such requests are one tenant); ``None`` (unknown) for a salted one, whose
        salt digest the keyed record does not give back."""
        rec = decode(self.raw)
        return None if rec is None or rec.flags & HAS_SALT else b""


Writer = TenantId | RecordedTenant
"""Who a chunk is written for: a request's tenant, or the record a verified value or file carried."""

TenantRecords = dict[bytes, RecordedTenant]
"""Where a read puts the tenant records of the values it verified: chunk key -> record.  The
caller passes one to a tier's ``get_into``/``get_many`` (``records=``) and reads it afterwards:
the records travel with the read, explicitly, on whatever thread verifies them."""


def note_verified(records: TenantRecords | None, namespace: bytes, key: bytes, raw: bytes | memoryview | None) -> None:
    """A value of chunk ``key`` in ``namespace`` whose digest covers the tenant record ``raw``
    (:data:`RECORD_BYTES` bytes; ``None``: its format has none) was verified: keep the record in
    ``records`` (``None``: the caller does not collect them).  An absent record (unknown) or one
    that fails its own check (:class:`DamagedRecord`) is not kept: the chunk's tenant stays
    unknown.  Call it only after verification passed; readers of one dict note distinct keys."""
    if records is None or raw is None:
        return
    raw = bytes(raw[:RECORD_BYTES])
    if decode(raw) is not None:
        records[bytes(key)] = RecordedTenant(bytes(namespace), raw)


def _id(context: str, value: str | None) -> bytes:
    if value is None:
        return b""
    return blake3.blake3(value.encode(), derive_key_context=context).digest(DIGEST_BYTES)


@lru_cache(maxsize=4096)
def _keyed(namespace: bytes, ident: bytes) -> bytes:
    if not ident:
        return _ZERO_DIGEST
    key = blake3.blake3(namespace, derive_key_context=NAMESPACE_KEY_CONTEXT).digest()
    return blake3.blake3(ident, key=key).digest(DIGEST_BYTES)


def record(namespace: bytes, tenant: Writer) -> bytes:
    """The :data:`RECORD_BYTES` record of ``tenant`` for a chunk of ``namespace`` (16-byte digest).
    A :class:`RecordedTenant` gives its own bytes when it was keyed by ``namespace``, else an
    all-zero (unknown) record: keyed digests cannot be keyed anew."""
    if isinstance(tenant, RecordedTenant):
        return tenant.raw if tenant.namespace == namespace else bytes(RECORD_BYTES)
    flags = (HAS_SALT if tenant.salt else 0) | (HAS_LORA if tenant.lora else 0)
    fields = _FIELDS.pack(MAGIC, VERSION, flags, 0, _keyed(namespace, tenant.salt), _keyed(namespace, tenant.lora))
    return fields + xxhash.xxh3_64_digest(fields)


class Record(NamedTuple):
    """A decoded record: the flags and the two keyed digests."""

    flags: int
    salt: bytes
    lora: bytes


class DamagedRecord(ValueError):
    """A record that is not all zero (so a writer put one there) but fails its check: another
    magic or version, or its checksum fails.  Never trusted: ``kvtier purge`` leaves the chunk
    alone and names it as a problem."""


def read(raw: bytes | memoryview) -> Record | None:
    """The record in ``raw`` (at least :data:`RECORD_BYTES` bytes); ``None`` when absent (all zero:
    the writer did not know its tenant, or wrote before records existed).

    Raises:
        DamagedRecord: not all zero, and a short record, another magic or version, or a checksum mismatch.
    """
    raw = bytes(raw[:RECORD_BYTES])
    if raw == bytes(RECORD_BYTES):
        return None
    if len(raw) < RECORD_BYTES or raw[:4] != MAGIC:
        raise DamagedRecord("its tenant record is not one this kvtier writes")
    if xxhash.xxh3_64_digest(raw[:_FIELDS.size]) != raw[_FIELDS.size:RECORD_BYTES]:
        raise DamagedRecord("its tenant record fails its checksum")
    _magic, version, flags, _zero, salt, lora = _FIELDS.unpack(raw[:_FIELDS.size])
    if version != VERSION:
        raise DamagedRecord(f"its tenant record is of version {version}, which this kvtier does not read")
    return Record(flags, salt, lora)


def decode(raw: bytes | memoryview) -> Record | None:
    """The record in ``raw`` (at least :data:`RECORD_BYTES` bytes); ``None`` when unknown (absent,
    another version, or a checksum mismatch: :func:`read` tells those apart)."""
    try:
        return read(raw)
    except DamagedRecord:
        return None


def matches(rec: Record, namespace: bytes, cache_salt: str | None, lora_name: str | None) -> bool:
    """Whether a known record of a chunk of ``namespace`` was written for ``cache_salt`` (when not
    ``None``) and for the LoRA adapter ``lora_name`` (when not ``None``)."""
    if cache_salt is not None and not (rec.flags & HAS_SALT and
                                       rec.salt == _keyed(namespace, _id(SALT_CONTEXT, cache_salt))):
        return False
    return lora_name is None or bool(rec.flags & HAS_LORA and
                                     rec.lora == _keyed(namespace, _id(LORA_CONTEXT, lora_name)))
