"""Codecs of the value envelope (:mod:`kvtier.core.envelope`): reversible transforms of a chunk's
payload, named by a one-byte id in the envelope's codec chain.

A chain is an ordered tuple of codecs: a writer applies them first to last (``encode``), a reader
undoes them last to first (``decode``).  Registered: :data:`IDENTITY` (id 1) here, AES-256-GCM
(id 16, :mod:`kvtier.core.encryption`) and compression (:mod:`kvtier.core.compression`).  Ids are
part of the stored format: an id once written is never reused for another transform.  Id 0 is
never a codec (it marks an unused slot of the envelope's codec field).

A *sealing* codec (``sealing = True``: encryption) needs the value's context
(:class:`CodecContext`: its namespace, tenant record, the operator's key ring and the envelope
header it is bound to) and so is called through ``seal``/``unseal`` instead of
``encode``/``decode``; it must be the last codec of a chain (compress, then encrypt), so the
stored length, which its header names, is known when it runs.

A codec that returns its input unchanged (``passthrough``) lets the tiers keep their zero-copy
paths: the payload goes to the wire or the file straight from the caller's memory, and a read
lands straight in the caller's buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class CodecError(ValueError):
    """A codec chain names an unknown codec, or a payload fails to decode (a miss, never a crash)."""


class DecryptError(CodecError):
    """An encrypted payload that does not open: a master key this kvtier does not hold, another
    tenant's key, a header swapped from another value, or a flipped bit (a counted miss)."""


class ForeignKeyError(DecryptError):
    """An encrypted payload sealed under a master key this kvtier does not hold (or with no key
    ring configured): another engine's, or one rotated out.  A miss, and the value is left in
    place (it is not damaged: an engine with the key reads it)."""


@dataclass(frozen=True)
class CodecContext:
    """What a sealing codec binds a payload to.

    Attributes:
        namespace: the value's 16-byte namespace digest.
        record: its :data:`~kvtier.core.envelope.RECORD_BYTES` tenant record (all zero: unknown).
        keyring: the operator's keys (:class:`kvtier.core.encryption.KeyRing`), ``None`` without.
        fields: the envelope's header bytes before its digest for a stored payload of this many
            bytes (the associated data): on write computed, on read the stored ones.
    """

    namespace: bytes
    record: bytes
    keyring: object | None
    fields: Callable[[int], bytes]


@runtime_checkable
class Codec(Protocol):
    """One reversible transform of a payload.

    Attributes:
        id: its byte in the envelope's codec chain (1..255, unique, never reused).
        name: its name in configuration and messages.
        passthrough: ``encode`` and ``decode`` return their input (no copy, no change).
    """

    @property
    def id(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def passthrough(self) -> bool: ...

    def encode(self, data: memoryview) -> memoryview:
        """The encoded form of ``data`` (uint8 view; may be ``data`` itself)."""

    def decode(self, data: memoryview, original_bytes: int) -> memoryview:
        """The decoded form of ``data``, ``original_bytes`` long (``-1``: not recorded, an inner
        codec of a chain keeps its own).  Raises :class:`CodecError`."""


def _sealing(codec: Codec) -> bool:
    return bool(getattr(codec, "sealing", False))


@dataclass(frozen=True)
class Identity:
    """The identity codec (id 1): the payload is stored as it is."""

    id: int = 1
    name: str = "identity"
    passthrough: bool = True

    def encode(self, data: memoryview) -> memoryview:
        return data

    def decode(self, data: memoryview, original_bytes: int) -> memoryview:
        if original_bytes >= 0 and data.nbytes != original_bytes:
            raise CodecError(f"identity payload is {data.nbytes} bytes, its envelope says {original_bytes}")
        return data


IDENTITY = Identity()
_BY_ID: dict[int, Codec] = {}
_BY_NAME: dict[str, Codec] = {}


def register(codec: Codec) -> None:
    """Make ``codec`` known by its id and name (idempotent for the same object).

    Raises:
        ValueError: the id is outside 1..255, or the id or name is taken by another codec.
    """
    if not 1 <= codec.id <= 255:
        raise ValueError(f"codec id must be 1..255, got {codec.id}")
    for held in (_BY_ID.get(codec.id), _BY_NAME.get(codec.name)):
        if held is not None and held is not codec:
            raise ValueError(f"codec {codec.name!r} ({codec.id}) clashes with the registered {held.name!r} ({held.id})")
    _BY_ID[codec.id] = codec
    _BY_NAME[codec.name] = codec


register(IDENTITY)


@dataclass(frozen=True)
class Chain:
    """An ordered chain of codecs (applied first to last on write).

    Attributes:
        ids: the chain's codec ids, in the order applied on write.
        passthrough: every codec leaves the payload as it is: stored bytes == original bytes.
    """

    codecs: tuple[Codec, ...]
    # derived once: every disk read asks both (a plain attribute: no call into this module per read)
    ids: tuple[int, ...] = field(init=False, repr=False, compare=False)
    passthrough: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(c.id for c in self.codecs))
        object.__setattr__(self, "passthrough", all(c.passthrough for c in self.codecs))

    @property
    def sealed(self) -> bool:
        """The chain ends with a sealing codec (encryption)."""
        return bool(self.codecs) and _sealing(self.codecs[-1])

    def prepare(self) -> None:
        """Load now what a codec of the chain would load on its first call (a codec's optional
        ``prepare()``: compression imports blosc2, 0.87 s on EPYC-2 when idle), so that the first
        put or read of a tier does not spend its shared-tier deadline importing a library.

        Raises:
            CodecError: a codec's library is missing.
        """
        for codec in self.codecs:
            prepare = getattr(codec, "prepare", None)
            if prepare is not None:
                prepare()

    def encode(self, payload: memoryview, ctx: CodecContext | None = None) -> memoryview:
        """``payload`` through every codec, first to last (``payload`` itself for a passthrough
        chain); a sealing codec gets ``ctx``.

        Raises:
            CodecError: a codec fails (a sealing one without a key ring, among others)."""
        for codec in self.codecs:
            if _sealing(codec):
                if ctx is None:
                    raise CodecError(f"codec {codec.name!r} needs the value's context")
                payload = codec.seal(payload, ctx)  # type: ignore[attr-defined]
            else:
                payload = codec.encode(payload)
        return payload

    def decode_into(self, stored: memoryview, dst: memoryview, ctx: CodecContext | None = None) -> None:
        """Undo the chain on ``stored`` (last codec first) and put the original bytes in ``dst``,
        which is exactly the original length.  No copy when ``stored`` already is ``dst``'s memory
        (or a sealing codec opened it straight into ``dst``).

        Raises:
            CodecError: a codec fails (:class:`DecryptError`: a sealing one), or the result is not
                ``dst``'s length.
        """
        data = stored
        for i in range(len(self.codecs) - 1, -1, -1):
            codec = self.codecs[i]
            if _sealing(codec):
                if ctx is None:
                    raise DecryptError(f"codec {codec.name!r} needs the value's context")
                data = codec.unseal(data, ctx, dst if i == 0 else None)  # type: ignore[attr-defined]
            else:
                data = codec.decode(data, dst.nbytes if i == 0 else _unknown(data))
        if data.nbytes != dst.nbytes:
            raise CodecError(f"decoded payload is {data.nbytes} bytes, expected {dst.nbytes}")
        if data.obj is dst.obj and _address(data) == _address(dst):
            return
        import numpy as np  # (here: the CLI's start-up imports this module, not numpy)

        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8))


def _unknown(data: memoryview) -> int:
    """Inner codecs of a chain do not record their own original length: -1 (the codec knows)."""
    return -1


def _address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def chain_of(names_or_ids: Sequence[str | int]) -> Chain:
    """The chain of these codecs, by name or id, in write order.

    Raises:
        CodecError: a name or id no codec is registered under.
    """
    codecs: list[Codec] = []
    for item in names_or_ids:
        codec = _BY_ID.get(item) if isinstance(item, int) else _BY_NAME.get(item)
        if codec is None:
            known = ", ".join(f"{c.name} ({c.id})" for c in _BY_ID.values())
            raise CodecError(f"codec {item!r} is not one this kvtier knows (known: {known})")
        codecs.append(codec)
    for codec in codecs[:-1]:
        if _sealing(codec):
            raise CodecError(f"codec {codec.name!r} must come last in a chain (compress, then encrypt)")
    return Chain(tuple(codecs))


def names() -> list[str]:
    """The registered codecs' names, by id."""
    return [_BY_ID[i].name for i in sorted(_BY_ID)]


def known(codec_id: int) -> bool:
    """Whether a codec is registered under ``codec_id``."""
    return codec_id in _BY_ID
