"""The TTL pin a request asks for, in its ``kv_transfer_params`` (issue 22 item 4): parsed once, at its
admission, and only for a request that names :data:`PIN_PARAM` (the workers pin its prompt's
chunks as they save them: ``SaveJob.pin_s``, ``TieredStore.ttl_pin``).
"""

from __future__ import annotations

import math
from typing import Any

PIN_PARAM = "kvtier_pin_s"
"""The ``kv_transfer_params`` key a request names its prompt's pin TTL with, seconds (issue 22 item 4)."""


def pin_seconds(params: Any, max_s: float) -> tuple[float, str | None]:
    """A request's pin TTL from its ``kv_transfer_params`` (OpenAI ``extra_body``), seconds.

    Returns:
        ``(ttl_s, problem)``: ``ttl_s`` 0 when the request asks for no pin or asks wrongly, capped
        at ``max_s`` (``pin_max_s``); ``problem`` one sentence for the log when the value was
        refused or cut, else ``None``.
    """
    value = params.get(PIN_PARAM) if isinstance(params, dict) else None
    if value is None:
        return 0.0, None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return 0.0, (f"kv_transfer_params.{PIN_PARAM} must be a positive number of seconds, got {value!r}; "
                     "the prompt is not pinned")
    if value > max_s:
        return max_s, f"kv_transfer_params.{PIN_PARAM}={value:g} is above pin_max_s; pinned for {max_s:g} s"
    return float(value), None
