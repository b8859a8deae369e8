"""A request's cache receipt (issue 35): which tier served which of its prompt's tokens, what the
load cost, why the first chunk that was not served missed, and what the request saved.

The receipt is what a kvtier engine returns as ``kv_transfer_params["kvtier"]`` from vLLM's
``request_finished`` (the field vLLM copies into a non-streaming completion's or chat completion's
``kv_transfer_params``, and into ``RequestOutput.kv_transfer_params`` offline), writes to the
receipt log, and sets as attributes of a request's trace span.  This module is the shape only:
building one (from the request context's events) is the integration's job, emitting one is a
:class:`ReceiptSink`'s (the split of a hit's tokens by tier that the receipts, vLLM's hit sources and
the loaded-token counters share: :func:`kvtier.integrations.vllm.worker.loader.tokens_by_tier`).

Every field is plain JSON (``msgspec.to_builtins``); :func:`decode` reads one back and raises
:class:`msgspec.ValidationError` on anything else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol

import msgspec

RECEIPT_VERSION = 1

MissReason = Literal[
    "partial_chunk",  # the prompt's tail is shorter than a chunk: always computed
    "new",  # no tier of this engine has seen it (for this tenant and model)
    "evicted",  # it was stored, and ``tier`` evicted it (the tier's ghost list remembers the key)
    "not_admitted",  # the admission filter refused to store it
    "save_dropped",  # a full write queue dropped its save
    "corrupt",  # a tier held it and it failed verification (a counted miss, never served)
    "load_failed",  # the read or the copy failed
    "deadline",  # a shared tier answered too late
    "breaker_open",  # a shared tier's breaker was open
    "reset",  # an operator reset the cache since it was stored
    "purged",  # an operator purged it
    "quota",  # a tenant quota refused to keep it
    "budget",  # a per-request or per-step load cap cut the load here
]
"""Why the first chunk of a prompt that was not served missed: the reasons an operator acts on
(``docs/receipts.md`` maps each to what to do)."""

MISS_REASONS: tuple[str, ...] = MissReason.__args__  # type: ignore[attr-defined]

NO_TIER = "none"
"""The ``tier`` label of ``kvtier_missed_tokens_total`` for a reason about no tier (``new``,
``partial_chunk``): a receipt's ``miss.tier`` ``""``."""


def miss_tier_label(tier: str) -> str:
    """The ``tier`` label a miss's tier is counted under: ``tier``, or :data:`NO_TIER` for ``""``
    (and for :data:`NO_TIER` itself), so that receipts and metrics key a miss alike."""
    return tier or NO_TIER


class ReceiptMiss(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The first prompt token not served from a cache, and why.

    Attributes:
        token: index of that token in the prompt (0-based): where the served prefix (vLLM's own
            prefix cache's and kvtier's) ends, a multiple of the engine's block size.
        reason: one of :data:`MissReason`.
        tier: the tier the reason is about (``"evicted"`` from which tier, ``"corrupt"`` in which
            tier, …); ``""`` where no tier is meant (``new``, ``partial_chunk``).
    """

    token: int
    reason: MissReason
    tier: str = ""


WHOLLY_SERVED = ReceiptMiss(0, "partial_chunk")
"""The miss a receipt's computed tokens count under when its ``miss`` is ``None`` (only the prompt's
last token was computed, which vLLM always computes): :meth:`Receipt.computed_miss`'s rule as a value,
which the scheduler's counters read without a call."""


class ReceiptSaved(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What this request added to the cache.

    Attributes:
        chunks: chunks newly stored per tier (``{"cpu": 3, "disk": 3}``); a chunk already held is
            not counted.
        dropped: chunks not stored, per reason (``{"save_dropped": 1, "quota": 2}``); the keys are
            :data:`MissReason` values.
    """

    chunks: dict[str, int] = {}
    dropped: dict[str, int] = {}


class ReceiptPin(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The TTL pin this request asked for (``kv_transfer_params["kvtier_pin_ttl_s"]``-style).

    Attributes:
        granted: whether the pin was taken.
        ttl_s: the pin's time to live, seconds (0 when refused).
        reason: why it was refused (the sentence the log gives), ``""`` when granted.
    """

    granted: bool
    ttl_s: float = 0.0
    reason: str = ""


class Receipt(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request's cache receipt.

    Attributes:
        version: :data:`RECEIPT_VERSION`.
        request_id: vLLM's request id.
        prompt_tokens: the prompt's length, tokens.
        tokens: ``{"engine": n, "<tier>": n, …, "computed": n}``: tokens from vLLM's own prefix
            cache, from each kvtier tier that served some, and computed; the values sum to
            ``prompt_tokens``, and ``engine`` plus the tiers equal vLLM's
            ``usage.prompt_tokens_details.cached_tokens``.
        load_ms: per tier, milliseconds the request's load from it took as the request saw it
            (read + verify + copy).
        waited_steps: engine steps the request was parked waiting for a load.
        miss: the first token not served and why; ``None`` when the whole prompt was served
            (then ``computed`` is 0, or only the engine's last recomputed token).
        saved: what the request stored.
        pin: the TTL pin asked for, ``None`` when none was.
        top_miss: the first token a lower tier served (a hit, but not from the top tier) and why
            the top tier did not hold it (``tier`` is the top tier's name; ``reason`` ``evicted``,
            ``reset``, …, or ``new``: it never held it or forgot); ``None`` when no lower tier served.
            (Added after version 1's first draft; optional, so older readers' receipts still decode.)
    """

    request_id: str
    prompt_tokens: int
    tokens: dict[str, int]
    load_ms: dict[str, float] = {}
    waited_steps: int = 0
    miss: ReceiptMiss | None = None
    saved: ReceiptSaved = ReceiptSaved()
    pin: ReceiptPin | None = None
    version: int = RECEIPT_VERSION
    top_miss: ReceiptMiss | None = None

    def cached_tokens(self) -> int:
        """Tokens not computed (the engine's and every tier's): vLLM's ``cached_tokens``."""
        return sum(n for name, n in self.tokens.items() if name != "computed")

    def computed_miss(self) -> tuple[str, str]:
        """The ``(reason, tier)`` its computed tokens count under in ``kvtier_missed_tokens_total``:
        its ``miss``'s, or ``("partial_chunk", "")`` when ``miss`` is ``None`` (only the prompt's last
        token was computed, which vLLM always computes).  The metric and every reader of receipts
        (bench, doctor) use this one rule, so their sums agree (docs/receipts.md, "Metrics")."""
        miss = self.miss if self.miss is not None else WHOLLY_SERVED
        return miss.reason, miss.tier

    def to_builtins(self) -> dict[str, object]:
        """The receipt as plain JSON types (what ``kv_transfer_params["kvtier"]`` holds)."""
        out = msgspec.to_builtins(self)
        assert isinstance(out, dict)
        return out


def decode(data: bytes | str | dict[str, object]) -> Receipt:
    """A receipt from JSON text or from its :meth:`Receipt.to_builtins` form.

    Raises:
        msgspec.ValidationError: a field is missing, unknown or of the wrong type.
        msgspec.DecodeError: ``data`` is not JSON.
    """
    if isinstance(data, dict):
        return msgspec.convert(data, Receipt)
    return msgspec.json.decode(data, type=Receipt)


class ReceiptSink(Protocol):
    """Where finished requests' receipts go besides the response: the receipt log, a trace
    exporter.  ``emit`` is called once per finished request on the scheduler's thread; it must
    not block (a bounded queue, dropping and counting when full)."""

    def emit(self, receipt: Receipt, trace_headers: Mapping[str, str] | None = None) -> None:
        """Take ``receipt``; ``trace_headers``: the request's W3C trace context (vLLM's
        ``Request.trace_headers``), for a sink that joins vLLM's trace."""

    def close(self) -> None: ...
