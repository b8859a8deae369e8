"""Variable-length and ranged reads of a stored value envelope (:mod:`kvtier.core.envelope`), shared
by every tier below the cpu tier (the blob verbs of :class:`~kvtier.core.tiers.base.Tier`:
``get``, ``read_into``, ``get_range``).

- :func:`open_value`: a whole value verified (its digest or MAC over header and payload) and its
  payload decoded, of any length (0 included), into the caller's buffer of at least that length or
  into a new one.  A buffer too short is :class:`BufferTooSmall`, raised before a byte is written.
- :func:`payload_range`: where a slice of the payload lies in the stored value, after the header
  was checked (namespace, key, digest kind, layout, known codecs).  A value whose codec chain
  changes the payload (compressed, encrypted) has no such slice: its ranged read is a whole
  verified read, sliced.  Otherwise **the slice's bytes are not verified**: envelope version 1 has one digest over the
  whole payload and no per-range digest, so a ranged read cannot prove its bytes without reading
  them all.  A ranged read therefore serves tools and layouts that re-verify (or can afford a
  wrong byte), never KV the engine computes with: serving reads whole values.  A per-range digest
  (a later envelope version) would make ranged reads servable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, TypeVar

from kvtier.core import codecs
from kvtier.core.envelope import Envelope, EnvelopeError, EnvelopeHeader, decode_header
from kvtier.core.errors import length_problem


class BufferTooSmall(ValueError):
    """A verified value is longer than the caller's buffer (``read_into``): nothing was written;
    read again into a buffer of at least :attr:`value_bytes`.

    Attributes:
        value_bytes: the value's payload length, bytes (after its codec chain is undone).
    """

    def __init__(self, value_bytes: int, buffer_bytes: int) -> None:
        super().__init__(f"the value's payload is {value_bytes} bytes, the buffer {buffer_bytes}")
        self.value_bytes = value_bytes


class Opened(NamedTuple):
    """A verified value (:func:`open_value`): ``payload`` (a view of the caller's buffer, or of a
    new one, exactly the original length) and its tenant ``record`` (``None``: the format has none)."""

    payload: memoryview
    record: bytes | None


def check_room(value_bytes: int, dst: memoryview | bytearray | None) -> memoryview:
    """``dst[:value_bytes]`` (``dst`` ``None``: a new zeroed buffer of ``value_bytes``).

    Raises:
        BufferTooSmall: ``dst`` is shorter than ``value_bytes``.
    """
    if dst is None:
        return memoryview(bytearray(value_bytes))
    out = memoryview(dst).cast("B")
    if out.nbytes < value_bytes:
        raise BufferTooSmall(value_bytes, out.nbytes)
    return out[:value_bytes]


def open_value(env: Envelope, key: bytes, value: bytes | memoryview,
               dst: memoryview | bytearray | None = None) -> Opened:
    """Verify ``value`` (any format :func:`~kvtier.core.envelope.decode_header` reads, any payload
    length) for ``key`` and decode its payload into ``dst[:length]`` (``None``: a new buffer).

    Raises:
        BufferTooSmall: ``dst`` is shorter than the payload (checked before anything is written).
        ChunkFormatError: an unreadable header, or (:class:`~kvtier.core.envelope.EnvelopeError`) a
            value that does not belong here, a length that disagrees with the value, a digest
            mismatch or a codec that fails; ``dst`` may then hold unverified bytes.
    """
    view = memoryview(value).cast("B")
    header = decode_header(view)
    env.check(header, key, None)
    out = check_room(header.original_bytes, dst)
    if problem := length_problem(view.nbytes, header.header_bytes, header.stored_bytes):
        raise EnvelopeError(problem)
    env.verify(header, view)
    env.decode_payload(header, view, out)
    return Opened(out, header.record)


def open_bytes(env: Envelope, key: bytes, value: bytes | memoryview) -> tuple[bytes, bytes | None]:
    """:func:`open_value` into a new ``bytes`` (a tier's ``get``): the payload and its tenant
    record.  A chain that keeps the bytes (identity) copies the verified payload once, straight
    out of ``value``; another decodes into a buffer first.

    Raises:
        ChunkFormatError: as :func:`open_value`.
    """
    view = memoryview(value).cast("B")
    header = decode_header(view)
    env.check(header, key, None)
    if header.stored_bytes != header.original_bytes or not codecs.chain_of(header.codecs).passthrough:
        opened = open_value(env, key, view)
        return opened.payload.tobytes(), opened.record
    if problem := length_problem(view.nbytes, header.header_bytes, header.stored_bytes):
        raise EnvelopeError(problem)
    env.verify(header, view)
    return view[header.header_bytes:].tobytes(), header.record


def check_range(offset: int, length: int) -> None:
    """Raises ValueError for a negative ``offset`` or ``length`` (a caller's mistake, not a miss)."""
    if offset < 0 or length < 0:
        raise ValueError(f"a range needs offset >= 0 and length >= 0, got {offset} and {length}")


def payload_range(env: Envelope, header: EnvelopeHeader, key: bytes, offset: int,
                  length: int) -> tuple[int, int] | None:
    """Where ``payload[offset:offset + length]`` lies in the stored value: ``(start, end)`` offsets
    into the value, clipped to the payload's end (``start == end``: nothing to read), once
    ``header`` passed :meth:`~kvtier.core.envelope.Envelope.check` for ``key`` at any length; the
    payload's bytes are not verified (see the module docstring).  ``None`` when the value's codec
    chain changes the payload (compressed, encrypted: a range of the stored bytes is not a range of
    the payload): the caller then reads the whole value, verified, and slices it.

    Raises:
        ValueError: a negative ``offset`` or ``length``.
        EnvelopeError: the header does not belong here.
    """
    check_range(offset, length)
    env.check(header, key, None)
    if header.stored_bytes != header.original_bytes or not codecs.chain_of(header.codecs).passthrough:
        return None
    start = header.header_bytes + min(offset, header.stored_bytes)
    return start, header.header_bytes + min(offset + length, header.stored_bytes)


Key = TypeVar("Key", bound=bytes)


def whole_sliced(get: Callable[[Key], bytes | None], key: Key, offset: int, length: int) -> bytes | None:
    """The ranged read of a value whose codec chain changes the payload (:func:`payload_range` said
    ``None``): the whole value through ``get`` (the tier's verified whole read; ``None``: absent or
    unusable), sliced to ``payload[offset:offset + length]``."""
    whole = get(key)
    return None if whole is None else whole[offset:offset + length]
