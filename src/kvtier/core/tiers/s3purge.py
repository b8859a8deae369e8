"""``kvtier purge`` over an S3 bucket: the s3 tier's :attr:`~kvtier.core.tiers.registry.TierSpec.purge` hook.

Objects are ``<s3_key_prefix><namespace hex>[-<keyspace>]/<chunk key hex>`` (:mod:`kvtier.core.tiers.s3`;
the keyspace, 16 hex digits, only under a ``shared_secret``).  The purge asks for the namespace
"directories" under the prefix (one delimited LIST), lists those the selector admits (one LIST
page per 1,000 objects), keeps the objects whose name parses as above, and reads each one's
header (a ranged GET of its first 112 bytes, :func:`~kvtier.core.tiers.sharedvalue.peek`): only an
object whose header names the same namespace and chunk key as its name is a kvtier value and may
be removed; any other is kept and named as a problem.  Removal is S3's bulk ``DeleteObjects``,
1,000 keys per request.  Bytes are the objects' sizes from the LIST (header and payload).

Age: an object is written once with one ``PUT`` and never rewritten (kvtier checks with a ``HEAD``
first), so its ``Last-Modified`` is when it was written (the purge's and the server's clocks
compared: keep them in NTP).

Tenant: a value of format version 2 carries its writer's tenant record in its header
(:mod:`kvtier.core.tiers.sharedvalue`, :mod:`kvtier.core.tenant`), inside the bytes the ranged GET
above reads anyway: ``--salt``/``--lora`` cost no request more than a namespace purge.  A
version-1 object (written before records) or an all-zero record is of an unknown tenant, kept and
counted; a record that fails its check is kept and named as a problem.  The record is in the
object, not in its user metadata: metadata would need a ``HEAD`` per object as well, and would
not be covered by the value's digest.

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
                found.append(_Found(namespace, bytes.fromhex(name), meta["path"], int(meta["size"])))
        heads = await asyncio.gather(*(_read_header(store, f, gate) for f in found))
        chosen = []
        for item, head in zip(found, heads, strict=True):
            if head is None:  # deleted meanwhile
                continue
            header = peek(head)
            if header is None or header.namespace != item.namespace or header.key != item.key:
                result.problem(f"{item.path} is not a kvtier value of this name (its header differs); kept")
                continue
            if selector.tenant_admits(result, namespace, header.record, item.path):
                chosen.append(item)
        if not dry_run:
            batches = [chosen[i:i + DELETE_BATCH] for i in range(0, len(chosen), DELETE_BATCH)]
            for batch in batches:
                await obstore.delete_async(store, [item.path for item in batch])
        result.chunks += len(chosen)
        result.bytes += sum(item.size for item in chosen)


async def _read_header(store: Any, item: _Found, gate: asyncio.Semaphore) -> bytes | None:
    """The object's first :data:`HEADER_BYTES` bytes (fewer when it is shorter); ``None`` when it is gone."""
    import obstore

    length = min(HEADER_BYTES, item.size)
    if length == 0:
        return b""
    async with gate:
        try:
            try:
                head = bytes(await obstore.get_range_async(store, item.path, start=0, length=length))
            except Exception as exc:
                if "non-partial" not in str(exc):
                    raise
                # a gateway that ignores Range (rclone serve s3) answers the whole object: read its first part only
                got = await obstore.get_async(store, item.path)
                head = b""
                async for part in got.stream(min_chunk_size=length):
                    head += bytes(part)
                    if len(head) >= length:
                        break
        except FileNotFoundError:
            return None
    return head[:HEADER_BYTES]
