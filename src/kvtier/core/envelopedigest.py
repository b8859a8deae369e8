"""The envelope's streaming digests (:mod:`kvtier.core.envelope`): the protocol a tier feeds
slices to, and the keyed BLAKE3 MAC of a ``shared_secret``."""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

import blake3

MAC_CONTEXT = "kvtier shared tier v1 MAC"
DIGEST_BYTES = 16


class Hasher(Protocol):
    """A streaming digest: ``update`` with slices in order, then ``digest``."""

    def update(self, data: bytes | memoryview) -> object: ...

    def digest(self) -> bytes: ...


@lru_cache(maxsize=16)
def mac_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key of the MAC derived from ``shared_secret`` (derive-key context
    :data:`MAC_CONTEXT`, the one the shared value format used), so the secret keys nothing else."""
    return blake3.blake3(secret, derive_key_context=MAC_CONTEXT).digest()


class Mac:
    """The keyed BLAKE3-128 MAC, already fed ``first``."""

    __slots__ = ("_h",)

    def __init__(self, key: bytes, first: bytes | memoryview) -> None:
        self._h = blake3.blake3(first, key=key)

    def update(self, data: bytes | memoryview) -> object:
        return self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest(DIGEST_BYTES)
