"""The s3 tier's reachability probe (:attr:`~kvtier.core.tiers.registry.TierSpec.probe`): one LIST
of at most one key under the tier's prefix, within a short deadline, never a write.

``kvtier check`` and the serve-line pre-flight run it (:mod:`kvtier.core.tiers.probe`): a
``200`` is ``reachable``; a ``403`` is ``auth failed`` (fix the credentials:
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or ``s3_credentials_file``); a ``404`` for the
bucket (``NoSuchBucket``) is ``no bucket``; a closed port or no answer in time is ``unreachable``.  Reachability is judged first
(:func:`~kvtier.core.tiers.s3client.describe_failure`): without credentials obstore asks the
instance metadata endpoint before the server, so that error alone would blame the credentials of
an endpoint that is not even up; a TCP connect to the endpoint tells the two apart.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.probe import PROBE_DEADLINE_S, ProbeResult, within_deadline
from kvtier.core.tiers.s3client import describe_failure, make_store, where
from kvtier.core.tiers.s3settings import S3Settings, s3_settings

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

AUTH_FIX = "fix AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or s3_credentials_file"


def probe_s3(config: KVTierConfig, deadline_s: float = PROBE_DEADLINE_S) -> ProbeResult:
    """LIST at most one object under ``s3_key_prefix`` of ``s3_bucket``, within ``deadline_s`` seconds.

    Raises:
        ConfigError: no bucket, obstore missing, plain HTTP without ``s3_allow_http`` or unreadable
            credentials (the pre-flight reports those itself, as errors).
    """
    settings = s3_settings(config)
    if not settings.s3_bucket:
        raise ConfigError("probe_s3 needs a config with s3_bucket set")
    capped = settings.model_copy(update={"s3_connect_timeout_s": min(settings.s3_connect_timeout_s, deadline_s),
                                         "s3_timeout_s": min(settings.s3_timeout_s, deadline_s), "s3_max_retries": 0})
    store = make_store(capped, deadline_s)
    address = where(settings)
    return within_deadline(lambda start: _list_one(store, capped, address, start, deadline_s), deadline_s,
                           "kvtier-s3-probe",
                           lambda detail, elapsed_s: _result("unreachable", address, detail, elapsed_s))


def _result(state: str, address: str, detail: str, elapsed_s: float) -> ProbeResult:
    return ProbeResult(state, address, detail, elapsed_s, auth_fix=AUTH_FIX,  # type: ignore[arg-type]
                       address_key="s3_endpoint_url or s3_bucket")


def _list_one(store: Any, settings: S3Settings, address: str, start: float, deadline_s: float) -> ProbeResult:
    import obstore

    try:
        stream = obstore.list(store, settings.s3_key_prefix.rstrip("/") or None, chunk_size=1)
        next(iter(stream), None)
    except Exception as exc:  # noqa: BLE001 - any failure: said as unreachable, no bucket or auth failed
        left = deadline_s - (time.monotonic() - start)
        state, detail = describe_failure(exc, settings, left)
        return _result(state if state in ("auth failed", "no bucket") else "unreachable", address, detail,
                       time.monotonic() - start)
    elapsed = time.monotonic() - start
    return _result("reachable", address, f"LIST answered in {elapsed * 1000:.1f} ms", elapsed)
