"""A tier's storage as a blob store, seen from outside any engine: the verbs the operator tools
(``kvtier purge``, a reset from outside the stores, the reachability probe; all in
:mod:`kvtier.core.purge`) are written over, once for every tier.

A blob is one stored value (a chunk file, a Redis value, an S3 object), named by a
:class:`BlobRef`: the namespace and chunk key its name says, and the name itself.  The verbs:

- :meth:`BlobStore.namespaces`: the namespaces the storage holds (those it can tell without
  listing every value; a store that cannot tell says none, and its namespaces show up in
  :meth:`BlobStore.list`);
- :meth:`BlobStore.list`: the values of some namespaces (all: an empty set), in batches of at
  most :data:`LIST_BATCH`;
- :meth:`BlobStore.stat`: per value its size, when it was written and, when asked, its header
  (the namespace, chunk key and tenant record the value itself says);
- :meth:`BlobStore.delete`: remove values; per value whether it went (or why not);
- :meth:`BlobStore.ping` and :meth:`BlobStore.failure`: one harmless request, and what a failed
  request means (reachable, unreachable, refused credentials), for the probe.

A store raises :class:`StorageFailed` (one sentence naming it) when the storage does not answer.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvtier.core.errors import KVTierError

if TYPE_CHECKING:
    from kvtier.core.tiers.probe import ProbeState

LIST_BATCH = 1000
"""Values per :meth:`BlobStore.list` batch at most (S3's LIST page and bulk delete take 1,000)."""


class StorageFailed(KVTierError):
    """A tier's storage, named correctly, did not answer (a server down); the message is one
    sentence naming it."""


@dataclass(frozen=True)
class BlobRef:
    """One stored value, as its name says.

    Attributes:
        namespace: the namespace digest (16 bytes) in its name.
        key: the chunk key in its name.
        name: the value's name in the storage (a file's path, a Redis key, an object's path), for
            messages and for the store's own verbs.
        space: the key space segment of its name (a ``shared_secret``'s, 16 hex digits; the node
            pool's, 8: the key space its owner keeps beside it), ``""`` if none.
    """

    namespace: bytes
    key: bytes
    name: str
    space: str = ""


@dataclass(frozen=True)
class ValueHeader:
    """What a stored value's header says of it (the store's header reader; the envelope's).

    Attributes:
        namespace: the namespace digest it was written for.
        key: the chunk key it was written for, ``None`` if the format does not say.
        tenant: the raw tenant record (:mod:`kvtier.core.tenant`), ``None`` if the format has no
            room for one.
        key_id: the master key id an encrypted value was sealed under (:mod:`kvtier.core.keyids`),
            ``None`` if it is not encrypted.
    """

    namespace: bytes
    key: bytes | None
    tenant: bytes | None
    key_id: bytes | None = None


@dataclass(frozen=True)
class BlobStat:
    """What :meth:`BlobStore.stat` found of one value.

    Attributes:
        size: stored bytes (header and payload).
        written_s: when it was written, seconds since the epoch; ``None`` if that cannot be told.
        header: its header, when asked for and read; ``None`` otherwise.
        problem: why it cannot be judged (unreadable, not a kvtier value of this name), one phrase
            naming it; such a value is kept and reported.
        age_problem: why ``written_s`` cannot be told, when that is worth saying once (e.g. a
            server whose values outlive the TTL the purge assumes).
    """

    size: int
    written_s: float | None
    header: ValueHeader | None = None
    problem: str | None = None
    age_problem: str | None = None


class BlobStore(Protocol):
    """A tier's storage across every namespace (see the module docstring).

    Attributes:
        where: the storage's address for messages (a directory, a URL without its password).
        verifies_values: whether a value's header must be read before it is removed (storage
            other programs may write into: a bucket), not only when a tenant is asked for.
        space: the key space segment of this configuration's values (``""`` if none): a reset
            removes only those.
        auth_fix: what to change when the storage refuses the credentials.
        address_key: the configuration key naming the address.
    """

    @property
    def where(self) -> str: ...
    @property
    def verifies_values(self) -> bool: ...
    @property
    def space(self) -> str: ...
    @property
    def auth_fix(self) -> str: ...
    @property
    def address_key(self) -> str: ...

    def namespaces(self) -> builtins.list[bytes]:
        """Namespaces the storage holds that it can tell without listing every value, in any order."""
        ...

    def list(self, namespaces: frozenset[bytes]) -> Iterator[builtins.list[BlobRef]]:
        """Values of ``namespaces`` (every namespace: empty), in batches of at most :data:`LIST_BATCH`."""
        ...

    def listing_problems(self) -> builtins.list[tuple[bytes, str]]:
        """``(namespace, phrase)`` per part of the storage :meth:`list` could not list since the
        last call (e.g. a shard directory without permission), each said once."""
        ...

    def stat(self, refs: Sequence[BlobRef], header: bool) -> builtins.list[BlobStat | None]:
        """Per ref what is stored (``None``: gone meanwhile); with ``header``, its header read too."""
        ...

    def delete(self, refs: Sequence[BlobRef]) -> builtins.list[bool | str]:
        """Remove ``refs``: per ref ``True`` (removed), ``False`` (gone already) or why not (a phrase)."""
        ...

    def before_reset(self, namespace: bytes) -> str | None:
        """Make a reset of ``namespace`` outlive a crash before its values are removed (the disk
        tier's marker); ``None``, or why it could not."""
        ...

    def ping(self) -> str:
        """Send one harmless request (never a write); the request's name (``"PING"``, ``"LIST"``).

        Raises:
            Exception: the request failed; :meth:`failure` says what that means.
        """
        ...

    def failure(self, exc: BaseException, left_s: float) -> tuple[ProbeState, str]:
        """What a failed request means: ``("unreachable" | "auth failed", a few words)``;
        ``left_s``: seconds left to find out (e.g. a TCP connect)."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...
