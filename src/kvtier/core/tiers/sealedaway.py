"""A shared tier's lookup that never offers a value this process cannot open (issue 36).

A value sealed under a master key the process's key ring does not hold (another engine's key, a
key rotated out) can never be served here: offered by a lookup, it would be planned, counted by
vLLM as an external prefix-cache hit, fail its load and be recomputed, at every request that
shares the prefix.  Nothing scans a shared tier (redis, s3), so its lookup checks instead: with a
key ring configured, the redis and s3 tiers' ``contains_many`` reads each value's first
:data:`LOOKUP_HEAD_BYTES` (its envelope header and the stored payload's key id:
:mod:`kvtier.core.keyids`; Redis: ``GETRANGE`` in the lookup's one pipeline instead of
``EXISTS``; S3: a ranged ``GET`` after the ``HEAD``) and answers "absent" for such a value.  The
scheduler's lookups and the workers' run the same tier code, so no process offers it; the value
is left on the server for the engines that hold the key.  Without a key ring the lookup stays
``EXISTS``/``HEAD`` (no header is read) and a load that meets an encrypted value is a counted miss.

Counted: :class:`SealedAway` counts each such value once per process as a decrypt failure in the
tier's codec numbers (:class:`~kvtier.core.codecstats.CodecStats`), remembering the last
:data:`SEALED_AWAY_MAX` keys (about 3 MiB) so that lookups asking again do not count again; a key
it forgot is counted once more when met again.  The answer itself needs no memory: every lookup
reads the key id afresh, so a value rewritten under a held key (after a ``purge --key-id`` and a
new write) is offered at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.core import keyids
from kvtier.core.codecstats import CodecStats
from kvtier.core.encryption import KeyRing
from kvtier.core.keys import ChunkKey

LOOKUP_HEAD_BYTES = keyids.HEAD_READ_BYTES
"""Bytes a lookup with a key ring reads of each value: the envelope header and an encrypted payload's key id (132)."""
SEALED_AWAY_MAX = 16384
"""Keys of unopenable values a tier remembers (most recent kept), so each is counted once."""


class SealedAway:
    """The keys a shared tier's lookups found sealed under keys its ring lacks (see the module docstring).

    Args:
        keyring: the tier's key ring (``None``: lookups do not read headers; :attr:`reads_heads` is false).
        stats: the tier's codec numbers, where each newly met value is counted as a decrypt failure.
        max_keys: keys remembered at most (oldest forgotten first).
    """

    def __init__(self, keyring: KeyRing | None, stats: CodecStats, max_keys: int = SEALED_AWAY_MAX) -> None:
        self.keyring = keyring
        self.stats = stats
        self.max_keys = max(max_keys, 1)
        self._keys: OrderedDict[ChunkKey, None] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def reads_heads(self) -> bool:
        """Whether lookups read each value's head (a key ring is configured)."""
        return self.keyring is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def openable(self, keys: Sequence[ChunkKey], heads: Sequence[bytes | None]) -> list[bool]:
        """Per key, whether its value is present (``heads[i]``: its first :data:`LOOKUP_HEAD_BYTES`
        bytes, ``None`` or empty: absent) and not sealed under a key the ring lacks; each such
        value newly met is counted once."""
        out: list[bool] = []
        for key, head in zip(keys, heads, strict=True):
            if not head:
                out.append(False)
                continue
            if keyids.unopenable(head, self.keyring) is None:
                out.append(True)
                continue
            out.append(False)
            self._met(key)
        return out

    def _met(self, key: ChunkKey) -> None:
        with self._lock:
            if key in self._keys:
                self._keys.move_to_end(key)
                return
            self._keys[key] = None
            if len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        self.stats.failed(True)
