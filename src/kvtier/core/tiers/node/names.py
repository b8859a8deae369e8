"""The names values have in the node pool: one key space per ``shared_secret`` (docs/node.md,
"Isolation").

The redis and s3 tiers put a secret's key space in each value's key, so engines with another
secret, or none, never find (fail to verify, and delete) each other's values.  The pool does the
same with two numbers, both derived from the secret, neither revealing it:

- the **pool name** of a chunk key, the key the owner indexes a value by (with its namespace), the
  presence table fingerprints and the value's envelope carries (so an owner that restarts indexes
  it again from its header): the chunk key itself without a secret; under a secret, the key
  enciphered by AES-128 (one block, a permutation of the 16 bytes) under a key derived from the
  secret (BLAKE3 ``derive_key``, context :data:`NAME_CONTEXT`).  The same chunk key has another name
  in every key space, so an engine never looks up, pins or deletes another space's values; and the
  permutation is undone (:meth:`PoolNames.keys_of`), so ``keys`` and ``clear`` name chunk keys.
- the **space**, a 32-bit number the owner keeps beside each value (the high half of its head in
  the pool, :mod:`~kvtier.core.tiers.node.pool`) so that ``keys``, ``clear`` and a reset from
  outside the engines touch one key space only: 0 without a secret, else the first 32 bits of
  the redis and s3 tiers' key space segment (:func:`kvtier.core.tiers.sharedvalue.keyspace`; its
  first 8 hex digits), never 0.

The namespace and the tenant record are the engine's own, unchanged: ``kvtier purge --namespace``
and the tenant filters work over every key space.
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.tiers.sharedvalue import KEYSPACE_CONTEXT

NAME_CONTEXT = "kvtier node pool v1 chunk key names"
NO_SPACE = 0
"""The space of values written without a secret (and of every value an older owner published)."""


def space_of(secret: bytes | None) -> int:
    """The key space of ``secret`` (:data:`NO_SPACE` without one): the first 32 bits of its
    :func:`~kvtier.core.tiers.sharedvalue.keyspace` segment read as a big-endian number, 1 if
    those are all zero."""
    if secret is None:
        return NO_SPACE
    return int.from_bytes(blake3.blake3(secret, derive_key_context=KEYSPACE_CONTEXT).digest(length=4), "big") or 1


def space_hex(space: int) -> str:
    """How a key space is written for the tools (``BlobRef.space``): ``""`` for :data:`NO_SPACE`,
    else 8 hex digits (the first 8 of the redis and s3 tiers' segment for the same secret)."""
    return "" if space == NO_SPACE else f"{space:08x}"


class PoolNames:
    """The pool names and the key space of one secret's values (see the module docstring).

    Args:
        secret: the shared secret, or ``None`` (names are the chunk keys, space 0).
    """

    def __init__(self, secret: bytes | None) -> None:
        self.space = space_of(secret)
        self._cipher = None if secret is None else Cipher(
            algorithms.AES(blake3.blake3(secret, derive_key_context=NAME_CONTEXT).digest(length=16)),
            modes.ECB())  # one block per key: a keyed permutation of each 16-byte key on its own

    def names(self, keys: Sequence[bytes]) -> list[bytes]:
        """The pool name of each of ``keys`` (16 bytes each).

        Raises:
            ValueError: under a secret, a key is not :data:`~kvtier.core.keys.KEY_BYTES` long.
        """
        if self._cipher is None:
            return [bytes(k) for k in keys]
        if keys and set(map(len, keys)) != {KEY_BYTES}:  # (one block per key: a key of another length would shift the rest)
            raise ValueError(f"a chunk key is {KEY_BYTES} bytes; got lengths {sorted(set(map(len, keys)))}")
        coder = self._cipher.encryptor()
        out = coder.update(b"".join(keys)) + coder.finalize()
        return [out[i:i + KEY_BYTES] for i in range(0, len(out), KEY_BYTES)]

    def name(self, key: bytes) -> bytes:
        """The pool name of one chunk key (:meth:`names`)."""
        return self.names([key])[0]

    def keys_of(self, names: Sequence[bytes]) -> list[ChunkKey]:
        """The chunk keys whose pool names ``names`` are (:meth:`names` undone).

        Raises:
            ValueError: under a secret, a name is not :data:`~kvtier.core.keys.KEY_BYTES` long.
        """
        if self._cipher is None:
            return [ChunkKey(bytes(n)) for n in names]
        if names and set(map(len, names)) != {KEY_BYTES}:
            raise ValueError(f"a pool name is {KEY_BYTES} bytes; got lengths {sorted(set(map(len, names)))}")
        coder = self._cipher.decryptor()
        out = coder.update(b"".join(names)) + coder.finalize()
        return [ChunkKey(out[i:i + KEY_BYTES]) for i in range(0, len(out), KEY_BYTES)]
