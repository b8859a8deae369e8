"""Codecs of the value envelope (:mod:`kvtier.core.envelope`): reversible transforms of a chunk's
payload, named by a one-byte id in the envelope's codec chain.

A chain is an ordered tuple of codecs: a writer applies them first to last (``encode``), a reader
undoes them last to first (``decode``).  Only :data:`IDENTITY` (id 1) is registered today;
compression and encryption come later as codecs registered here, not as changes to any tier.  Ids
are part of the stored format: an id once written is never reused for another transform.  Id 0 is
never a codec (it marks an unused slot of the envelope's codec field).

A codec that returns its input unchanged (``passthrough``) lets the tiers keep their zero-copy
paths: the payload goes to the wire or the file straight from the caller's memory, and a read
lands straight in the caller's buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


class CodecError(ValueError):
    """A codec chain names an unknown codec, or a payload fails to decode (a miss, never a crash)."""


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
    """An ordered chain of codecs (applied first to last on write)."""

    codecs: tuple[Codec, ...]

    @property
    def ids(self) -> tuple[int, ...]:
        """The chain's codec ids, in the order applied on write."""
        return tuple(c.id for c in self.codecs)

    @property
    def passthrough(self) -> bool:
        """Every codec leaves the payload as it is: stored bytes == original bytes."""
        return all(c.passthrough for c in self.codecs)

    def encode(self, payload: memoryview) -> memoryview:
        """``payload`` through every codec, first to last (``payload`` itself for a passthrough chain)."""
        for codec in self.codecs:
            payload = codec.encode(payload)
        return payload

    def decode_into(self, stored: memoryview, dst: memoryview) -> None:
        """Undo the chain on ``stored`` (last codec first) and put the original bytes in ``dst``,
        which is exactly the original length.  No copy when ``stored`` already is ``dst``'s memory.

        Raises:
            CodecError: a codec fails, or the result is not ``dst``'s length.
        """
        data = stored
        for i in range(len(self.codecs) - 1, -1, -1):
            data = self.codecs[i].decode(data, dst.nbytes if i == 0 else _unknown(data))
        if data.nbytes != dst.nbytes:
            raise CodecError(f"decoded payload is {data.nbytes} bytes, expected {dst.nbytes}")
        if data.obj is dst.obj and _address(data) == _address(dst):
            return
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8))


def _unknown(data: memoryview) -> int:
    """Inner codecs of a chain do not record their own original length: -1 (the codec knows)."""
    return -1


def _address(view: memoryview) -> int:
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
    return Chain(tuple(codecs))


def known(codec_id: int) -> bool:
    """Whether a codec is registered under ``codec_id``."""
    return codec_id in _BY_ID
