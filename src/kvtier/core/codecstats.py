"""Numbers of a tier's codec chain (issue 36 item 1): bytes before and after the codecs, seconds
spent in them, and values that failed to decode or decrypt (each a counted miss, never served).

Every tier below the cpu tier holds one :class:`CodecStats` in its envelope
(:class:`kvtier.core.envelope.Envelope`); only chains that change the payload count (identity
costs nothing and moves nothing).  :func:`codec_stats` finds a (possibly wrapped) tier's
counters, :func:`codec_numbers` their numbers, :func:`codec_families` turns them into the ``kvtier_codec_*`` Prometheus families.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.core import Metric


@dataclass(frozen=True)
class CodecNumbers:
    """A snapshot of :class:`CodecStats` (counters since the tier started).

    Attributes:
        encoded_bytes / stored_bytes: payload bytes into the chain on write, and out of it.
        encode_seconds: seconds in the chain on write.
        read_stored_bytes / decoded_bytes: bytes into the chain on read, and out of it.
        decode_seconds: seconds in the chain on read.
        decode_failures: values whose chain failed to decode other than by decryption.
        decrypt_failures: encrypted values that did not open (wrong or unknown key, another
            tenant's header, a flipped bit).
    """

    encoded_bytes: int = 0
    stored_bytes: int = 0
    encode_seconds: float = 0.0
    read_stored_bytes: int = 0
    decoded_bytes: int = 0
    decode_seconds: float = 0.0
    decode_failures: int = 0
    decrypt_failures: int = 0


class CodecStats:
    """Thread-safe counters of one tier's codec chain."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n: dict[str, float] = dict.fromkeys(CodecNumbers.__dataclass_fields__, 0)
        self.numbers = CodecNumbers()
        """The numbers now: a frozen snapshot replaced at each change, read without a call or the
        lock (the store's per-step stats read it; a passthrough chain never changes it)."""

    def _add(self, **values: float) -> None:
        with self._lock:
            for name, value in values.items():
                self._n[name] += value
            self.numbers = CodecNumbers(**self._n)  # type: ignore[arg-type]

    def encoded(self, before: int, after: int, seconds: float) -> None:
        self._add(encoded_bytes=before, stored_bytes=after, encode_seconds=seconds)

    def decoded(self, stored: int, after: int, seconds: float) -> None:
        self._add(read_stored_bytes=stored, decoded_bytes=after, decode_seconds=seconds)

    def failed(self, decrypt: bool) -> None:
        self._add(**({"decrypt_failures": 1} if decrypt else {"decode_failures": 1}))

    def snapshot(self) -> CodecNumbers:
        return self.numbers


def codec_stats(tier: object) -> CodecStats | None:
    """The codec counters of ``tier`` (unwrapped through ``inner``), ``None`` if it has no envelope.
    A tier's envelope is made with the tier: callers may keep the result."""
    seen = 0
    while hasattr(tier, "inner") and seen < 8:
        tier, seen = tier.inner, seen + 1
    env = getattr(tier, "envelope", None) or getattr(getattr(tier, "codec", None), "envelope", None)
    stats = getattr(env, "stats", None)
    return stats if isinstance(stats, CodecStats) else None


def codec_numbers(tier: object) -> CodecNumbers | None:
    """The codec numbers of ``tier`` now (:func:`codec_stats`), ``None`` if it has no envelope."""
    stats = codec_stats(tier)
    return stats.numbers if stats is not None else None


def codec_families(numbers: Mapping[str, CodecNumbers] | None) -> Iterator[Metric]:
    """``kvtier_codec_bytes{tier, stage}``, ``kvtier_codec_seconds{tier, direction}``,
    ``kvtier_codec_failures{tier, kind}`` (``None``: the families without samples)."""
    # (imported here: the CLI's start-up imports this module, not prometheus_client)
    from prometheus_client.core import CounterMetricFamily

    tiers = numbers or {}
    size = CounterMetricFamily("kvtier_codec_bytes", "Payload bytes through a tier's codec chain: stage "
                               "before/after on write, stored/decoded on read.", labels=["tier", "stage"])
    secs = CounterMetricFamily("kvtier_codec_seconds", "Seconds in a tier's codec chain, by direction.",
                               labels=["tier", "direction"])
    fails = CounterMetricFamily("kvtier_codec_failures", "Values whose codec chain failed (each a miss): "
                                "kind decrypt (wrong key, another tenant, damaged) or decode.",
                                labels=["tier", "kind"])
    for tier, n in tiers.items():
        for stage, value in (("before", n.encoded_bytes), ("after", n.stored_bytes),
                             ("stored", n.read_stored_bytes), ("decoded", n.decoded_bytes)):
            size.add_metric([tier, stage], value)
        secs.add_metric([tier, "encode"], n.encode_seconds)
        secs.add_metric([tier, "decode"], n.decode_seconds)
        fails.add_metric([tier, "decrypt"], n.decrypt_failures)
        fails.add_metric([tier, "decode"], n.decode_failures)
    yield size
    yield secs
    yield fails
