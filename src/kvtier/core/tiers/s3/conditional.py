"""Whether the s3 tier's server honours ``If-None-Match: *``, asked once per tier.

With ``s3_conditional_put`` each ``PUT`` carries ``If-None-Match: *`` and a server that honours it
refuses one on an existing key (``412 Precondition Failed``; AWS S3 user guide, "Add
preconditions to S3 operations with conditional requests"), so a write needs no ``HEAD`` first.
Not every gateway honours the header (``rclone serve s3`` v1.75 replaces the object and answers
``200``; some answer ``501``), so the first write asks the server once: it creates a probe object
under the namespace (a name that is no chunk key), creates it again and deletes it; a server that
accepts the second create ignores the header, and the tier then sends a ``HEAD`` before each
``PUT``.  The tier's module docstring, "Writes never replace an object", tells the whole rule.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from kvtier.core.tiers.s3.client import not_implemented
from kvtier.core.tiers.s3.objects import S3Objects

log = logging.getLogger(__name__)
PROBE_NAME = "kvtier-conditional-put-probe-"
"""Start of the probe object's name (under the namespace; never a chunk key, which is 32 hex
digits, so sweeps, clears and purges pass it by)."""


class ConditionalPut:
    """The answer to "does the server honour ``If-None-Match: *``?", asked at most once.

    Args:
        objects: the namespace's objects (the probe object goes under its prefix).
        enabled: ``s3_conditional_put``; without it the answer is ``False`` and nothing is asked.
        exists_errors: obstore's exceptions for a refused create (``AlreadyExistsError``,
            ``PreconditionError``).
        where: endpoint/bucket/prefix, for log lines.
        log_fault: ``(operation, exception)`` -> logs a failed request (the tier's rate-limited line).
    """

    def __init__(self, objects: S3Objects, enabled: bool, exists_errors: tuple[type[BaseException], ...],
                 where: str, log_fault: Callable[[str, BaseException], None]) -> None:
        self.objects = objects
        self.enabled = enabled
        self.exists_errors = exists_errors
        self.where = where
        self._log_fault = log_fault
        self.honoured: bool | None = None if enabled else False
        """Whether the server refuses a ``PUT`` with ``If-None-Match: *`` on an existing key:
        ``None`` until the first write asks it (:meth:`ask`), ``False`` without
        ``s3_conditional_put``; while not ``True`` each ``PUT`` follows a ``HEAD``."""
        self._lock: asyncio.Lock | None = None

    async def ask(self) -> bool:
        """Whether the server honours ``If-None-Match: *`` (:attr:`honoured`), asked once per
        tier: create a probe object, create it again (a server that honours the header refuses),
        delete it.  A fault raises (the write fails as any would) and the next write asks again.
        Runs on the objects' loop.

        Raises:
            obstore.exceptions.BaseError: the server failed or refused the first create.
        """
        import obstore

        if self.honoured is not None:
            return self.honoured
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.honoured is not None:  # another batch asked meanwhile
                return self.honoured
            store, requests = self.objects.store, self.objects.requests
            path = f"{self.objects.prefix}{PROBE_NAME}{uuid.uuid4().hex[:16]}"
            try:
                try:
                    async with requests():
                        await obstore.put_async(store, path, b"kvtier probe", use_multipart=False, mode="create")
                except Exception as exc:
                    if not not_implemented(exc):
                        raise
                    log.warning("kvtier s3 tier (%s): the server answers 501 Not Implemented to If-None-Match: *; "
                                "each write HEADs its object first and PUTs without the header (set "
                                "s3_conditional_put: false to skip this probe)", self.where)
                    self.honoured = False
                    return False
                try:
                    async with requests():
                        await obstore.put_async(store, path, b"kvtier probe", use_multipart=False, mode="create")
                    honoured = False
                except self.exists_errors:
                    honoured = True
            finally:
                try:
                    async with requests():
                        await obstore.delete_async(store, path)
                except Exception as exc:  # noqa: BLE001 - a left-over probe object is a few bytes no sweep counts
                    self._log_fault("delete of the conditional-put probe", exc)
            if not honoured:
                log.warning("kvtier s3 tier (%s): the server ignores If-None-Match: * (a second conditional PUT "
                            "replaced the object); each write HEADs its object first, one round trip more per "
                            "chunk (AWS S3 honours the header; rclone serve s3 does not)", self.where)
            self.honoured = honoured
            return honoured
