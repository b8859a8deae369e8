"""Encryption at rest of the lower tiers: the AES-256-GCM codec ``aes-256-gcm`` (codec id 16,
:mod:`kvtier.core.codecs`) and the operator's key ring (issue 36 item 3; docs/security.md).

Keys:

- a **master key** is the operator's secret (a file, or an environment variable: never in the
  configuration itself, never logged; :mod:`kvtier.core.keysettings` reads it).  Its **key id** is
  4 bytes of BLAKE3 ``derive_key`` (context :data:`KEY_ID_CONTEXT`) of it: printable, one-way;
- a **data key** per tenant: HKDF-SHA256 (RFC 5869; ``cryptography``'s ``HKDF``) of the master key,
  salt = the namespace digest, info = :data:`DATA_KEY_INFO` + the value's 48-byte tenant record
  (:mod:`kvtier.core.tenant`: keyed digests of ``cache_salt`` and the LoRA adapter), so every
  tenant of every model has its own key, and a value moved under another tenant's record fails;
- the **key ring**: the current master key encrypts, previous ones still decrypt (rotation);
  ``kvtier purge --key-id OLD`` removes what only an old key opens.

Stored payload of the codec (it is always last in a chain, so this is the envelope's payload)::

    offset  size  field
    0       4     key id of the master key
    4       12    nonce (random, ``os.urandom``)
    16      n     ciphertext (n = the payload's bytes before this codec)
    16+n    16    GCM tag

The associated data is the envelope header's fields before its digest (namespace, chunk key,
lengths, layout, codec chain, tenant record: :data:`kvtier.core.envelope.DIGEST_OFFSET` bytes)
followed by the key id: a header swapped between values, a changed record or length, another key
or a flipped bit fails the tag (:class:`~kvtier.core.codecs.DecryptError`, a counted miss).
Random 96-bit nonces keep the collision chance under 2^-32 for up to 2^32 values per data key
(NIST SP 800-38D section 8.3); a data key is per tenant and per master key, and rotation renews it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtier.core import codecs

CODEC_ID = 16
CODEC_NAME = "aes-256-gcm"
KEY_ID_BYTES = 4
NONCE_BYTES = 12
TAG_BYTES = 16
PREFIX_BYTES = KEY_ID_BYTES + NONCE_BYTES
OVERHEAD_BYTES = PREFIX_BYTES + TAG_BYTES
"""Bytes the codec adds to a payload (32)."""
KEY_ID_CONTEXT = "kvtier master key id v1"
DATA_KEY_INFO = b"kvtier data key v1"
MIN_MASTER_KEY_BYTES = 32


@dataclass(frozen=True)
class MasterKey:
    """One master key and its id (:data:`KEY_ID_BYTES` bytes; ``hex_id`` in tools and messages)."""

    secret: bytes = field(repr=False)
    key_id: bytes = b""

    @classmethod
    def of(cls, secret: bytes) -> MasterKey:
        """The master key ``secret`` with its derived id.

        Raises:
            ValueError: fewer than :data:`MIN_MASTER_KEY_BYTES` bytes.
        """
        if len(secret) < MIN_MASTER_KEY_BYTES:
            raise ValueError(f"a master key needs at least {MIN_MASTER_KEY_BYTES} bytes, got {len(secret)}")
        return cls(secret, key_id_of(secret))

    @property
    def hex_id(self) -> str:
        return self.key_id.hex()


def key_id_of(secret: bytes) -> bytes:
    """The :data:`KEY_ID_BYTES`-byte id of master key ``secret`` (one-way)."""
    return blake3.blake3(secret, derive_key_context=KEY_ID_CONTEXT).digest(KEY_ID_BYTES)


class KeyRing:
    """The master keys of one configuration: ``current`` encrypts, it and ``previous`` decrypt."""

    def __init__(self, current: MasterKey, previous: Sequence[MasterKey] = ()) -> None:
        self.current = current
        self._by_id = {k.key_id: k for k in (*previous, current)}

    def find(self, key_id: bytes) -> MasterKey | None:
        """The master key of ``key_id``, ``None`` if this ring does not hold it."""
        return self._by_id.get(bytes(key_id))

    @property
    def hex_ids(self) -> list[str]:
        """Every key id held, current last."""
        return [k.hex() for k in self._by_id]

    def __repr__(self) -> str:
        return f"KeyRing(current={self.current.hex_id}, held={self.hex_ids})"


def data_key(master: MasterKey, namespace: bytes, record: bytes) -> bytes:
    """The 32-byte AES key of the tenant whose record is ``record`` in ``namespace`` (see the
    module docstring)."""
    return HKDF(algorithm=SHA256(), length=32, salt=namespace,
                info=DATA_KEY_INFO + bytes(record)).derive(master.secret)


@lru_cache(maxsize=4096)
def _aead(master: MasterKey, namespace: bytes, record: bytes) -> AESGCM:
    return AESGCM(data_key(master, namespace, record))


def _ring(ctx: codecs.CodecContext) -> KeyRing:
    if not isinstance(ctx.keyring, KeyRing):
        raise codecs.ForeignKeyError("value is encrypted (aes-256-gcm) and no master key is configured "
                                  "(encryption: master_key_file or master_key_env)")
    return ctx.keyring


def stored_key_id(payload: bytes | memoryview) -> bytes | None:
    """The key id at the start of an encrypted payload, ``None`` when it is too short to hold one."""
    view = memoryview(payload).cast("B")
    return bytes(view[:KEY_ID_BYTES]) if view.nbytes >= OVERHEAD_BYTES else None


@dataclass(frozen=True)
class AesGcm:
    """The ``aes-256-gcm`` sealing codec (see the module docstring)."""

    id: int = CODEC_ID
    name: str = CODEC_NAME
    passthrough: bool = False
    sealing: bool = True

    def encode(self, data: memoryview) -> memoryview:
        raise codecs.CodecError("aes-256-gcm needs the value's context (Chain.encode with a CodecContext)")

    def decode(self, data: memoryview, original_bytes: int) -> memoryview:
        raise codecs.DecryptError("aes-256-gcm needs the value's context (Chain.decode_into with a CodecContext)")

    def seal(self, data: memoryview, ctx: codecs.CodecContext) -> memoryview:
        """``data`` encrypted under the current master key's data key for ``ctx``'s tenant, into
        one new buffer of ``data.nbytes + OVERHEAD_BYTES``."""
        ring = _ring(ctx)
        master = ring.current
        out = memoryview(bytearray(data.nbytes + OVERHEAD_BYTES))
        nonce = os.urandom(NONCE_BYTES)
        out[:KEY_ID_BYTES] = master.key_id
        out[KEY_ID_BYTES:PREFIX_BYTES] = nonce
        aad = ctx.fields(out.nbytes) + master.key_id
        _aead(master, ctx.namespace, bytes(ctx.record)).encrypt_into(nonce, data, aad, out[PREFIX_BYTES:])
        return out

    def unseal(self, data: memoryview, ctx: codecs.CodecContext, out: memoryview | None) -> memoryview:
        """The plaintext of ``data``, decrypted straight into ``out`` when it has the plaintext's
        length (else a new buffer).

        Raises:
            DecryptError: no key ring, a key id it does not hold, or the tag fails (another
                tenant's record or header, a flipped bit, a truncated value).
        """
        ring = _ring(ctx)
        if data.nbytes < OVERHEAD_BYTES:
            raise codecs.DecryptError(f"encrypted payload of {data.nbytes} bytes is shorter than its "
                                      f"{OVERHEAD_BYTES}-byte frame")
        key_id = bytes(data[:KEY_ID_BYTES])
        master = ring.find(key_id)
        if master is None:
            raise codecs.ForeignKeyError(f"value is encrypted under master key {key_id.hex()}, which this "
                                      f"kvtier does not hold (held: {', '.join(ring.hex_ids)})")
        plain = data.nbytes - OVERHEAD_BYTES
        dst = out if out is not None and out.nbytes == plain else memoryview(bytearray(plain))
        aad = ctx.fields(data.nbytes) + key_id
        try:
            _aead(master, ctx.namespace, bytes(ctx.record)).decrypt_into(
                bytes(data[KEY_ID_BYTES:PREFIX_BYTES]), data[PREFIX_BYTES:], aad, dst)
        except InvalidTag:
            raise codecs.DecryptError("authentication failed (another tenant's value or header, or damaged)") from None
        return dst


AES_GCM = AesGcm()
codecs.register(AES_GCM)
