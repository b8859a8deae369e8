"""``kvtier purge`` over an S3 bucket: the s3 tier's :attr:`~kvtier.core.tiers.registry.TierSpec.purge` hook.

Objects are ``<s3_key_prefix><namespace hex>[-<keyspace>]/<chunk key hex>`` (:mod:`kvtier.core.tiers.s3`;
the keyspace, 16 hex digits, only under a ``shared_secret``).  The purge asks for the namespace
"directories" under the prefix (one delimited LIST), lists those the selector admits (one LIST
page per 1,000 objects), keeps the objects whose name parses as above, and reads each one's
header (a ranged GET of its first 64 bytes, :func:`~kvtier.core.tiers.sharedvalue.peek`): only an
object whose header names the same namespace and chunk key as its name is a kvtier value and may
be removed; any other is kept and named as a problem.  Removal is S3's bulk ``DeleteObjects``,
1,000 keys per request.  Bytes are the objects' sizes from the LIST (header and payload).

Age: an object is written once with one ``PUT`` and never rewritten (kvtier checks with a ``HEAD``
first), so its ``Last-Modified`` is when it was written (the purge's and the server's clocks
compared: keep them in NTP).

Tenant: values carry no tenant record (their format, :mod:`kvtier.core.tiers.sharedvalue`, has no
spare bytes, as for the redis tier), so ``--salt``/``--lora`` match no object, and every object
they would have looked at is reported as of an unknown tenant.

Every request is bounded by ``s3_timeout_s`` (and ``s3_connect_timeout_s``), with
``s3_max_retries`` retries; a failure is a :class:`~kvtier.core.purge.PurgeFailed` naming the
endpoint and bucket, an unreachable server said as such before any credential is blamed.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.core.purge import NamespacePurge, PurgeFailed, PurgeSelector
from kvtier.core.tiers.s3client import describe_failure, make_store, where
from kvtier.core.tiers.s3settings import S3Settings, s3_settings
from kvtier.core.tiers.sharedvalue import HEADER_BYTES, peek

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

TIER = "s3"
DELETE_BATCH = 1000
"""Keys per ``DeleteObjects`` request (S3 takes at most 1000)."""
_DIR = re.compile(r"([0-9a-f]{32})(?:-[0-9a-f]{16})?")
_CHUNK = re.compile(r"[0-9a-f]{32}")


@dataclass
class _Found:
    namespace: bytes
    key: bytes
    path: str
    size: int


def purge(config: KVTierConfig, selector: PurgeSelector, dry_run: bool) -> list[NamespacePurge] | None:
    """Purge the configured bucket (see the module docstring); ``None`` without ``s3_bucket``.

    Returns:
        one :class:`~kvtier.core.purge.NamespacePurge` per namespace with objects the selector
        admits (by namespace hex), plus an empty one per namespace the selector names that has none.

    Raises:
        PurgeFailed: the server cannot be reached, refuses the credentials, or has no such bucket.
        UserError: plain HTTP without ``s3_allow_http``, unreadable credentials, obstore missing
            (:func:`~kvtier.core.tiers.s3client.make_store`).
    """
    settings = s3_settings(config)
    if not settings.s3_bucket:
        return None
    store = make_store(settings, settings.s3_timeout_s)
    results: dict[bytes, NamespacePurge] = {ns: NamespacePurge(TIER, ns) for ns in sorted(selector.namespaces)}
    try:
        asyncio.run(_purge(store, settings, selector, dry_run, results))
    except Exception as exc:  # noqa: BLE001 - obstore's errors (and a dropped connection): one sentence
        raise PurgeFailed(failure_sentence(exc, settings)) from None
    return [results[ns] for ns in sorted(results)]


def failure_sentence(exc: BaseException, settings: S3Settings) -> str:
    """Why a request to the bucket failed, in one sentence: unreachable (said first), no such
    bucket, or refused credentials (:func:`~kvtier.core.tiers.s3client.describe_failure`)."""
    state, detail = describe_failure(exc, settings, settings.s3_connect_timeout_s)
    address = where(settings)
    if state == "unreachable":
        return f"the S3 server at {address} could not be reached ({detail}); check --s3-endpoint-url and that it is up"
    if state == "no bucket":
        return f"the S3 server at {address} has no bucket {settings.s3_bucket!r}; check --s3-bucket"
    if state == "auth failed":
        return (f"the S3 server at {address} refused the purge ({detail}); fix AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY or --s3-credentials-file")
    return f"the S3 server at {address} did not answer the purge ({detail}); check that the server is up"


async def _purge(store: Any, settings: S3Settings, selector: PurgeSelector, dry_run: bool,
                 results: dict[bytes, NamespacePurge]) -> None:
    import obstore

    prefix = settings.s3_key_prefix
    listing = await obstore.list_with_delimiter_async(store, prefix.rstrip("/") or None)
    dirs = []
    for common in listing["common_prefixes"]:
        name = common[len(prefix):].rstrip("/") if common.startswith(prefix) else ""
        match = _DIR.fullmatch(name)
        if match is not None and selector.wants_namespace(bytes.fromhex(match.group(1))):
            dirs.append((bytes.fromhex(match.group(1)), common.rstrip("/")))
    gate = asyncio.Semaphore(settings.s3_concurrency)
    for namespace, directory in dirs:
        result = results.setdefault(namespace, NamespacePurge(TIER, namespace))
        found: list[_Found] = []
        async for page in obstore.list(store, directory, chunk_size=1000):
            for meta in page:
                name = meta["path"][len(directory) + 1:]
                if not _CHUNK.fullmatch(name) or not selector.old_enough(meta["last_modified"].timestamp()):
                    continue
                if selector.needs_tenant:  # values hold no tenant record (module docstring)
                    result.unknown_tenant += 1
                    continue
                found.append(_Found(namespace, bytes.fromhex(name), meta["path"], int(meta["size"])))
        known = await asyncio.gather(*(_is_kvtier_value(store, f, gate) for f in found))
        chosen = []
        for item, verdict in zip(found, known, strict=True):
            if verdict is None:  # deleted meanwhile
                continue
            if not verdict:
                result.problem(f"{item.path} is not a kvtier value of this name (its header differs); kept")
                continue
            chosen.append(item)
        if not dry_run:
            batches = [chosen[i:i + DELETE_BATCH] for i in range(0, len(chosen), DELETE_BATCH)]
            for batch in batches:
                await obstore.delete_async(store, [item.path for item in batch])
        result.chunks += len(chosen)
        result.bytes += sum(item.size for item in chosen)


async def _is_kvtier_value(store: Any, item: _Found, gate: asyncio.Semaphore) -> bool | None:
    """Whether the object's header names its namespace and chunk key; ``None`` when it is gone."""
    import obstore

    async with gate:
        try:
            try:
                head = bytes(await obstore.get_range_async(store, item.path, start=0, length=HEADER_BYTES))
            except Exception as exc:
                if "non-partial" not in str(exc):
                    raise
                # a gateway that ignores Range (rclone serve s3) answers the whole object: read its first part only
                got = await obstore.get_async(store, item.path)
                head = b""
                async for part in got.stream(min_chunk_size=HEADER_BYTES):
                    head += bytes(part)
                    if len(head) >= HEADER_BYTES:
                        break
        except FileNotFoundError:
            return None
    header = peek(memoryview(head)[:HEADER_BYTES])
    return header is not None and header.namespace == item.namespace and header.key == item.key
