"""The s3 tier's bucket as a blob store (:mod:`kvtier.core.tiers.blobs`): what ``kvtier purge``, a
reset from outside the stores and the probe run over (:mod:`kvtier.core.purge`).

Objects are ``<s3_key_prefix><namespace hex>[-<keyspace>]/<chunk key hex>`` (:mod:`kvtier.core.tiers.s3.tier`;
the keyspace, 16 hex digits, only under a ``shared_secret``).  :meth:`S3Blobs.namespaces` asks for
the namespace "directories" under the prefix (one delimited LIST); :meth:`S3Blobs.list` lists those
asked for (one LIST page per 1,000 objects) and keeps the objects whose name parses as above, with
their sizes and ``Last-Modified`` from the LIST.  A bucket may hold other programs' objects, so a
value's header is always read before it is removed (:attr:`S3Blobs.verifies_values`): a ranged GET
of its first 128 bytes (the envelope's header, :data:`~kvtier.core.envelope.FIXED_BYTES`), read by
:func:`~kvtier.core.tiers.sharedvalue.peek` (the one place this module reads a value's header); only an object whose header names the same namespace and chunk key
as its name is a kvtier value and may be removed, any other is kept and named as a problem.  The
tenant record is inside those bytes: ``--salt``/``--lora`` cost no request more than a namespace
purge (the record is in the object, not in its user metadata: metadata would need a ``HEAD`` per
object as well, and would not be covered by the value's digest).  Removal is S3's bulk
``DeleteObjects``, 1,000 keys per request.  Bytes are the objects' sizes (header and payload).

Age: an object is written once with one ``PUT`` and never rewritten (kvtier checks with a ``HEAD``
first), so its ``Last-Modified`` is when it was written (the purge's and the server's clocks
compared: keep them in NTP).

Every request is bounded by ``s3_timeout_s`` (and ``s3_connect_timeout_s``), with
``s3_max_retries`` retries; a failure is a :class:`~kvtier.core.tiers.blobs.StorageFailed` naming
the endpoint and bucket, an unreachable server said as such before any credential is blamed.  The
probe LISTs at most one key under the prefix (never a write): a ``200`` is ``reachable``, a ``403``
``auth failed``, a ``404`` for the bucket (``NoSuchBucket``) ``no bucket``, a closed port or no answer
in time ``unreachable``
(:func:`~kvtier.core.tiers.s3.client.describe_failure`).
"""

from __future__ import annotations

import asyncio
import builtins
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.core.keyids import HEAD_READ_BYTES, key_id_of
from kvtier.core.tiers.blobs import LIST_BATCH, BlobRef, BlobStat, StorageFailed, ValueHeader
from kvtier.core.tiers.s3.client import describe_failure, make_store, where
from kvtier.core.tiers.s3.settings import S3Settings, s3_settings
from kvtier.core.tiers.sharedvalue import HEADER_BYTES, configured_keyspace, peek

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.probe import ProbeState

AUTH_FIX = "fix AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or s3_credentials_file"
_DIR = re.compile(r"([0-9a-f]{32})(?:-([0-9a-f]{16}))?")
_CHUNK = re.compile(r"[0-9a-f]{32}")


def open_blobs(config: KVTierConfig, deadline_s: float | None = None) -> S3Blobs | None:
    """The blob store of the configured bucket; ``None`` without ``s3_bucket``.

    Args:
        deadline_s: cap on each request's timeouts, seconds, and no retries (the probe's).

    Raises:
        ConfigError: plain HTTP without ``s3_allow_http``, unreadable credentials, obstore missing
            (:func:`~kvtier.core.tiers.s3.client.make_store`).
    """
    settings = s3_settings(config)
    if not settings.s3_bucket:
        return None
    if deadline_s is None:
        return S3Blobs(config, settings, make_store(settings, settings.s3_timeout_s))
    capped = settings.model_copy(update={"s3_connect_timeout_s": min(settings.s3_connect_timeout_s, deadline_s),
                                         "s3_timeout_s": min(settings.s3_timeout_s, deadline_s), "s3_max_retries": 0})
    return S3Blobs(config, capped, make_store(capped, deadline_s), deadline_s)


class S3Blobs:
    """The kvtier objects in one bucket under one prefix, every namespace (see the module docstring)."""

    verifies_values = True
    auth_fix = AUTH_FIX
    address_key = "s3_endpoint_url or s3_bucket"

    def __init__(self, config: KVTierConfig, settings: S3Settings, store: Any, deadline_s: float | None = None) -> None:
        self._config = config
        self.settings = settings
        self.store = store
        self.where = where(settings)
        self._deadline_s = deadline_s
        self._dirs: list[tuple[bytes, str, str]] | None = None  # (namespace, directory, key space)
        self._meta: dict[str, tuple[int, float]] = {}  # path -> (bytes, Last-Modified) of the listed batch

    @property
    def space(self) -> str:
        """This configuration's key space segment (its ``shared_secret``'s), ``""`` without one.

        Raises:
            StorageFailed: the secret file cannot be read.
        """
        return configured_keyspace(self._config)

    def _failed(self, exc: BaseException) -> StorageFailed:
        return StorageFailed(failure_sentence(exc, self.settings))

    def _directories(self) -> builtins.list[tuple[bytes, str, str]]:
        import obstore

        if self._dirs is None:
            prefix = self.settings.s3_key_prefix
            try:
                listing = obstore.list_with_delimiter(self.store, prefix.rstrip("/") or None)
            except Exception as exc:  # noqa: BLE001 - obstore's errors (and a dropped connection): one sentence
                raise self._failed(exc) from None
            dirs = []
            for common in listing["common_prefixes"]:
                name = common[len(prefix):].rstrip("/") if common.startswith(prefix) else ""
                match = _DIR.fullmatch(name)
                if match is not None:
                    dirs.append((bytes.fromhex(match.group(1)), common.rstrip("/"), match.group(2) or ""))
            self._dirs = dirs
        return self._dirs

    def namespaces(self) -> builtins.list[bytes]:
        return list(dict.fromkeys(namespace for namespace, _dir, _space in self._directories()))

    def list(self, namespaces: frozenset[bytes]) -> Iterator[builtins.list[BlobRef]]:
        import obstore

        for namespace, directory, space in self._directories():
            if namespaces and namespace not in namespaces:
                continue
            try:
                for page in obstore.list(self.store, directory, chunk_size=LIST_BATCH):
                    batch = []
                    self._meta.clear()
                    for meta in page:
                        name = meta["path"][len(directory) + 1:]
                        if not _CHUNK.fullmatch(name):
                            continue
                        self._meta[meta["path"]] = (int(meta["size"]), meta["last_modified"].timestamp())
                        batch.append(BlobRef(namespace, bytes.fromhex(name), meta["path"], space))
                    if batch:
                        yield batch
            except StorageFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - obstore's errors (and a dropped connection): one sentence
                raise self._failed(exc) from None

    def listing_problems(self) -> builtins.list[tuple[bytes, str]]:
        return []

    def stat(self, refs: Sequence[BlobRef], header: bool) -> builtins.list[BlobStat | None]:
        found = [self._meta.get(ref.name) for ref in refs]
        if not header:
            return [None if meta is None else BlobStat(meta[0], meta[1]) for meta in found]

        async def heads() -> builtins.list[bytes | None]:
            gate = asyncio.Semaphore(self.settings.s3_concurrency)
            return await asyncio.gather(*(_read_header(self.store, ref.name, meta[0] if meta else HEADER_BYTES, gate)
                                          for ref, meta in zip(refs, found, strict=True)))

        try:
            raw = asyncio.run(heads()) if refs else []
        except Exception as exc:  # noqa: BLE001 - obstore's errors (and a dropped connection): one sentence
            raise self._failed(exc) from None
        out: list[BlobStat | None] = []
        for ref, meta, head in zip(refs, found, raw, strict=True):
            size, mtime = meta if meta is not None else (0, None)
            if head is None:  # deleted meanwhile
                out.append(None)
                continue
            value = peek(head)
            if value is None or value.namespace != ref.namespace or value.key != ref.key:
                out.append(BlobStat(size, mtime, problem=f"{ref.name} is not a kvtier value of this name (its header "
                                    "differs); kept"))
            else:
                out.append(BlobStat(size, mtime, ValueHeader(value.namespace, value.key, value.record, key_id_of(head))))
        return out

    def delete(self, refs: Sequence[BlobRef]) -> builtins.list[bool | str]:
        import obstore

        try:
            for i in range(0, len(refs), LIST_BATCH):
                obstore.delete(self.store, [ref.name for ref in refs[i:i + LIST_BATCH]])
        except Exception as exc:  # noqa: BLE001 - obstore's errors (and a dropped connection): one sentence
            raise self._failed(exc) from None
        return [True] * len(refs)

    def before_reset(self, namespace: bytes) -> str | None:
        """Nothing to mark: the objects go at once."""
        return None

    def ping(self) -> str:
        """LIST at most one object under ``s3_key_prefix``."""
        import obstore

        stream = obstore.list(self.store, self.settings.s3_key_prefix.rstrip("/") or None, chunk_size=1)
        next(iter(stream), None)
        return "LIST"

    def failure(self, exc: BaseException, left_s: float) -> tuple[ProbeState, str]:
        state, detail = describe_failure(exc, self.settings, left_s)
        if state == "auth failed":
            return "auth failed", detail
        return ("no bucket" if state == "no bucket" else "unreachable"), detail

    def close(self) -> None:
        """Nothing to release (obstore's store closes with its last reference)."""


def failure_sentence(exc: BaseException, settings: S3Settings) -> str:
    """Why a request to the bucket failed, in one sentence: unreachable (said first), no such
    bucket, or refused credentials (:func:`~kvtier.core.tiers.s3.client.describe_failure`)."""
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


async def _read_header(store: Any, path: str, size: int, gate: asyncio.Semaphore) -> bytes | None:
    """The object's first :data:`HEADER_BYTES` bytes (fewer when it is shorter); ``None`` when it is gone."""
    import obstore

    length = min(HEAD_READ_BYTES, size)  # the header and an encrypted payload's key id
    if length == 0:
        return b""
    async with gate:
        try:
            try:
                head = bytes(await obstore.get_range_async(store, path, start=0, length=length))
            except Exception as exc:
                if "non-partial" not in str(exc):
                    raise
                # a gateway that ignores Range (rclone serve s3) answers the whole object: read its first part only
                got = await obstore.get_async(store, path)
                head = b""
                async for part in got.stream(min_chunk_size=length):
                    head += bytes(part)
                    if len(head) >= length:
                        break
        except FileNotFoundError:
            return None
    return head[:HEAD_READ_BYTES]
