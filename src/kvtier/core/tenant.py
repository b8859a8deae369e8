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
   bytes, and writes the 48-byte record into the value envelope (:mod:`kvtier.core.envelope`,
   which gives its layout and its check, :func:`~kvtier.core.envelope.read_record`).

The record crosses the tier interface as an argument, never as thread state: a write takes the
:data:`Writer` (``Tier.put(key, data, tenant)``), and a read fills the :data:`TenantRecords` dict
its caller passes with the records of the values it verified (``Tier.get_many(keys, dsts,
records)``, :func:`kvtier.core.envelope.note_verified`).

A record that is absent (all zero: a chunk saved before this record existed, or by a writer that
did not know its tenant) is **unknown**: ``--salt``/``--lora`` never match it, and ``kvtier
purge`` reports how many chunks were left for that reason.  One that is present but fails its
check (:func:`~kvtier.core.envelope.read_record` raises
:class:`~kvtier.core.envelope.DamagedRecord`) is never trusted: the purge leaves the chunk
alone and names it as a problem.  A request without a
salt writes a known record with flag bit 0 clear: it is never matched by ``--salt``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import blake3
import xxhash

from kvtier.core.envelope import (
    HAS_LORA,
    HAS_SALT,
    RECORD_FIELDS,
    RECORD_MAGIC,
    RECORD_VERSION,
    Record,
    RecordedTenant,
)

DIGEST_BYTES = 16
SALT_CONTEXT = "kvtier tenant v1 cache_salt"
LORA_CONTEXT = "kvtier tenant v1 lora name"
NAMESPACE_KEY_CONTEXT = "kvtier tenant v1 namespace key"
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

    def record_in(self, namespace: bytes) -> bytes:
        """This tenant's 48-byte record for a chunk of ``namespace`` (16-byte digest): its digests keyed
        by the namespace (:func:`_keyed`), the flags, and their XXH3-64."""
        flags = (HAS_SALT if self.salt else 0) | (HAS_LORA if self.lora else 0)
        fields = RECORD_FIELDS.pack(RECORD_MAGIC, RECORD_VERSION, flags, 0, _keyed(namespace, self.salt),
                                    _keyed(namespace, self.lora))
        return fields + xxhash.xxh3_64_digest(fields)


Writer = TenantId | RecordedTenant
"""Who a chunk is written for: a request's tenant, or the record a verified value or file carried
(:class:`~kvtier.core.envelope.RecordedTenant`)."""

TenantRecords = dict[bytes, RecordedTenant]
"""Where a read puts the tenant records of the values it verified: chunk key -> record.  The
caller passes one to a tier's ``get_into``/``get_many`` (``records=``) and reads it afterwards:
the records travel with the read, explicitly, on whatever thread verifies them."""


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
    """The 48-byte record of ``tenant`` for a chunk of ``namespace`` (16-byte digest).
    A :class:`~kvtier.core.envelope.RecordedTenant` gives its own bytes when it was keyed by
    ``namespace``, else an all-zero (unknown) record: keyed digests cannot be keyed anew."""
    return tenant.record_in(namespace)


def matches(rec: Record, namespace: bytes, cache_salt: str | None, lora_name: str | None) -> bool:
    """Whether a known record of a chunk of ``namespace`` was written for ``cache_salt`` (when not
    ``None``) and for the LoRA adapter ``lora_name`` (when not ``None``)."""
    if cache_salt is not None and not (rec.flags & HAS_SALT and
                                       rec.salt == _keyed(namespace, _id(SALT_CONTEXT, cache_salt))):
        return False
    return lora_name is None or bool(rec.flags & HAS_LORA and
                                     rec.lora == _keyed(namespace, _id(LORA_CONTEXT, lora_name)))
