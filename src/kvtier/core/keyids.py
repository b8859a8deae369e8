"""Which master key an encrypted value was sealed under, read from its first bytes without any key
(``kvtier purge --key-id``; :mod:`kvtier.core.encryption`): the envelope header, then the first
:data:`~kvtier.core.encryption.KEY_ID_BYTES` bytes of the stored payload."""

from __future__ import annotations

from kvtier.core import encryption, envelope
from kvtier.core.errors import ChunkFormatError

HEAD_READ_BYTES = envelope.FIXED_BYTES + encryption.KEY_ID_BYTES
"""Bytes a purge reads of a shared value (redis, s3): the header and an encrypted payload's key id."""


def key_id_of(raw: bytes | memoryview) -> bytes | None:
    """The master key id of the encrypted value whose first bytes are ``raw`` (its header and at
    least :data:`~kvtier.core.encryption.KEY_ID_BYTES` bytes of payload); ``None`` when the value
    is not encrypted (its chain does not end with ``aes-256-gcm``), is not an envelope, or ``raw``
    is too short."""
    try:
        head = envelope.decode_header(raw)
    except ChunkFormatError:
        return None
    end = head.header_bytes + encryption.KEY_ID_BYTES
    if not head.codecs or head.codecs[-1] != encryption.CODEC_ID or len(raw) < end:
        return None
    return bytes(memoryview(raw)[head.header_bytes:end])


def unopenable(raw: bytes | memoryview, keyring: encryption.KeyRing | None) -> bytes | None:
    """The master key id of the encrypted value whose first bytes are ``raw`` (as
    :func:`key_id_of`) when ``keyring`` does not hold that key (``None``: no ring, so no key is
    held); ``None`` when the value is not encrypted or the ring holds its key.  Such a value can
    never open in this process: a tier neither indexes nor offers it, and leaves it in place."""
    key_id = key_id_of(raw)
    if key_id is None or (keyring is not None and keyring.find(key_id) is not None):
        return None
    return key_id
