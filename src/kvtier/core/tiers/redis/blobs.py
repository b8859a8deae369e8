"""The redis tier's server as a blob store (:mod:`kvtier.core.tiers.blobs`): what ``kvtier purge``,
a reset from outside the stores and the probe run over (:mod:`kvtier.core.purge`).

Keys are ``<prefix><namespace hex>:[<keyspace>:]<chunk key hex>`` (:mod:`kvtier.core.tiers.redis.tier`;
the keyspace segment, 16 hex digits, only under a ``shared_secret``).  :meth:`RedisBlobs.list`
finds them with ``SCAN MATCH`` (the prefix, glob characters escaped; in a Cluster redis-py's
``scan_iter`` visits every primary) and keeps those whose name parses as above;
:meth:`RedisBlobs.stat` asks ``STRLEN`` and ``PTTL`` (or, for the header, ``GETRANGE key 0 131``:
the header and an encrypted payload's key id, never the payload, read by :func:`~kvtier.core.tiers.sharedvalue.peek`, the one
place this module reads a value's header), one pipeline per batch of :data:`~kvtier.core.tiers.blobs.LIST_BATCH`
keys; :meth:`RedisBlobs.delete` sends ``UNLINK``.  Bytes are the values' lengths (header and payload).

Age: a value is written once with ``SET ... EX redis_ttl_s NX`` and no read refreshes its expiry, so
its age is ``redis_ttl_s`` minus what ``PTTL`` has left.  This assumes the engines that wrote it use
the same ``redis_ttl_s`` as the purge (default 86400 s; ``--redis-ttl-s``); a value with more left
than that says so (its age cannot be told).  A key without expiry was not written by kvtier's
``SET ... EX``: its age is unknown.  ``OBJECT IDLETIME`` was not used: every engine's read resets
it, and a server under an LFU ``maxmemory-policy`` refuses it.

Every call is bounded by the client's socket timeouts (``redis_timeout_s``); a failure is a
:class:`~kvtier.core.tiers.blobs.StorageFailed` naming the server.  A Cluster node named without
``redis_cluster`` is refused (a plain client would list one shard only).  The probe sends ``PING``
(and ``AUTH`` when a password is configured), nothing else.
"""

from __future__ import annotations

import builtins
import contextlib
import re
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvtier.core.config import redact_url
from kvtier.core.errors import ConfigError, UserError
from kvtier.core.keyids import HEAD_READ_BYTES, key_id_of
from kvtier.core.tiers.blobs import LIST_BATCH, BlobRef, BlobStat, StorageFailed, ValueHeader
from kvtier.core.tiers.redis.clear import glob_escape
from kvtier.core.tiers.redis.failure import AUTH_FIX, ClusterNode, classify
from kvtier.core.tiers.redis.settings import RedisSettings, redis_settings
from kvtier.core.tiers.sharedvalue import configured_keyspace, peek

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.probe import ProbeState

_REST = re.compile(rb"([0-9a-f]{32}):(?:([0-9a-f]{16}):)?([0-9a-f]{32})")


def open_blobs(config: KVTierConfig, deadline_s: float | None = None) -> RedisBlobs | None:
    """The blob store of the configured server (connected on first use); ``None`` without ``redis_url``.

    Args:
        deadline_s: cap on the client's connect and call timeouts, seconds (the probe's).

    Raises:
        ConfigError: redis-py is not installed, the password or the TLS CA file cannot be read.
    """
    from kvtier.core.tiers.redis.client import redis_password, tls_ca_file

    settings = redis_settings(config)
    if not settings.redis_url:
        return None
    try:
        import redis  # noqa: F401 - the client needs it; without it the tier itself cannot start
    except ImportError:
        raise ConfigError("the redis tier needs redis-py; install it (pip install redis) or unset redis_url") from None
    redis_password(settings)  # an unreadable password file is the configuration's error, raised here
    tls_ca_file(settings)  # so is an unreadable TLS CA file (it read as "unreachable")
    if deadline_s is not None:
        settings = settings.model_copy(update={
            "redis_connect_timeout_s": min(settings.redis_connect_timeout_s, deadline_s),
            "redis_timeout_s": min(settings.redis_timeout_s, deadline_s)})
    return RedisBlobs(config, settings)


class RedisBlobs:
    """The kvtier values on one server or Cluster, every namespace (see the module docstring)."""

    verifies_values = False
    auth_fix = AUTH_FIX
    address_key = "redis_url"

    def __init__(self, config: KVTierConfig, settings: RedisSettings) -> None:
        assert settings.redis_url is not None
        self._config = config
        self.settings = settings
        self.where = redact_url(settings.redis_url)
        self.prefix = settings.redis_key_prefix.encode()
        self._raw: Any = None
        self._checked = False

    @property
    def searched(self) -> str:
        """What a purge searches, for its note when nothing is there: database, server, key prefix."""
        database = urlsplit(self.settings.redis_url or "").path.strip("/") or "0"
        return f"database {database} of the Redis server at {self.where} (keys starting {self.prefix.decode()!r})"

    @property
    def space(self) -> str:
        """This configuration's key space segment (its ``shared_secret``'s), ``""`` without one.

        Raises:
            StorageFailed: the secret file cannot be read.
        """
        return configured_keyspace(self._config)

    def _connect(self) -> Any:
        """The client (a Cluster client connects to its seed node here); raises what redis-py raises."""
        from kvtier.core.tiers.redis.client import make_client

        if self._raw is None:
            self._raw = make_client(self.settings)
        return self._raw

    def _client(self) -> Any:
        """The client for the listing verbs: connected, and refused if it would see one shard only.

        Raises:
            StorageFailed: the server cannot be reached.
            UserError: a Cluster node named without ``redis_cluster``.
        """
        import redis

        try:
            client = self._connect()
        except UserError:
            raise
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:  # a Cluster seed
            # that does not answer, or a node that is not in Cluster mode
            self._refuse_auth(exc)
            raise StorageFailed(self._unreached((str(exc).strip().splitlines() or [exc.__class__.__name__])[0])) \
                from None
        if not self._checked:
            with self._answering():
                clustered = not self.settings.redis_cluster and bool(
                    int(client.info("cluster").get("cluster_enabled", 0)))
            if clustered:  # a plain client scans one node only: the purge would miss every other shard's keys
                raise UserError(f"the Redis server at {self.where} is a Cluster node; add --redis-cluster so that "
                                "every primary is purged")
            self._checked = True
        return client

    def _refuse_auth(self, exc: BaseException) -> None:
        """A refused or missing password, said as ``kvtier check`` says it
        (:func:`kvtier.core.tiers.redis.failure.classify`: "auth failed"), with the flags that give it.

        Raises:
            UserError: when ``exc`` is the server refusing the credentials (the caller's to fix, not a
                failure of the server); else returns.
        """
        from kvtier.core.tiers.redis.failure import classify

        state, detail = classify(exc, self.settings)
        if state == "auth failed":
            raise UserError(f"authentication failed at the Redis server at {self.where} ({detail}); give the "
                            "password the engines use with --redis-password-env VAR or --redis-password-file FILE") \
                from None

    def _unreached(self, detail: str) -> str:
        return (f"the Redis server at {self.where} could not be reached for the purge ({detail}); check "
                "--redis-url, that --redis-cluster is given only for a Cluster node, the password and that the "
                "server is up")

    @contextlib.contextmanager
    def _answering(self) -> Iterator[None]:
        """Turn a failed call into :class:`StorageFailed` naming the server."""
        import redis

        try:
            yield
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
            self._refuse_auth(exc)
            raise StorageFailed(f"the Redis server at {self.where} did not answer the purge "
                                f"({exc.__class__.__name__}: {exc}); check --redis-url, the password and that the "
                                "server is up") from None

    def namespaces(self) -> builtins.list[bytes]:
        """None without a full ``SCAN``: the namespaces show up in :meth:`list`."""
        return []

    def list(self, namespaces: frozenset[bytes]) -> Iterator[builtins.list[BlobRef]]:
        client = self._client()
        patterns = ([glob_escape(self.prefix + ns.hex().encode() + b":") + b"*" for ns in sorted(namespaces)]
                    or [glob_escape(self.prefix) + b"*"])
        for pattern in patterns:
            batch: list[BlobRef] = []
            with self._answering():
                for rkey in client.scan_iter(match=pattern, count=LIST_BATCH):
                    match = _REST.fullmatch(rkey[len(self.prefix):])
                    if match is None:
                        continue
                    namespace = bytes.fromhex(match.group(1).decode())
                    if namespaces and namespace not in namespaces:
                        continue
                    batch.append(BlobRef(namespace, bytes.fromhex(match.group(3).decode()),
                                         rkey.decode("utf-8", "surrogateescape"), (match.group(2) or b"").decode()))
                    if len(batch) >= LIST_BATCH:
                        yield batch
                        batch = []
            if batch:
                yield batch

    def listing_problems(self) -> builtins.list[tuple[bytes, str]]:
        return []

    def stat(self, refs: Sequence[BlobRef], header: bool) -> builtins.list[BlobStat | None]:
        if not refs:
            return []
        client = self._client()
        with self._answering():
            pipe = client.pipeline(transaction=False)
            for ref in refs:
                rkey = ref.name.encode("utf-8", "surrogateescape")
                pipe.strlen(rkey)
                if header:
                    # the header, with the tenant record, and an encrypted payload's key id: never the payload
                    pipe.getrange(rkey, 0, HEAD_READ_BYTES - 1)
                else:
                    pipe.pttl(rkey)
            answers = pipe.execute()
        now = time.time()
        out: list[BlobStat | None] = []
        for i, ref in enumerate(refs):
            size, second = int(answers[2 * i]), answers[2 * i + 1]
            if size == 0:  # expired or removed meanwhile
                out.append(None)
            elif header:
                out.append(self._header(ref, size, bytes(second or b"")))
            else:
                out.append(self._aged(size, int(second), now))
        return out

    def _aged(self, size: int, pttl: int, now: float) -> BlobStat | None:
        ttl_s = self.settings.redis_ttl_s
        if pttl == -2:  # expired meanwhile
            return None
        if pttl < 0:  # no expiry: not written by kvtier's SET ... EX; its age is unknown
            return BlobStat(size, None)
        if pttl > (ttl_s + 1) * 1000:  # more left than the TTL assumed: the engines' redis_ttl_s is longer, every
            # age here reads too young and --older-than would quietly remove nothing
            return BlobStat(size, None, age_problem=(
                f"a value has {pttl / 1000:,.0f} s left to live, more than redis_ttl_s {ttl_s:,} s: the engines use a "
                "longer redis_ttl_s, so ages cannot be told; pass theirs with --redis-ttl-s (values kept)"))
        return BlobStat(size, now - (ttl_s - pttl / 1000.0))

    @staticmethod
    def _header(ref: BlobRef, size: int, head: bytes) -> BlobStat:
        found = peek(head)
        if found is None or found.namespace != ref.namespace or found.key != ref.key:
            return BlobStat(size, None, problem=f"{ref.name} is not a kvtier value of this name (its header differs); "
                            "kept")
        return BlobStat(size, None, ValueHeader(found.namespace, found.key, found.record, key_id_of(head)))

    def delete(self, refs: Sequence[BlobRef]) -> builtins.list[bool | str]:
        if not refs:
            return []
        client = self._client()
        with self._answering():
            pipe = client.pipeline(transaction=False)
            for ref in refs:
                pipe.unlink(ref.name.encode("utf-8", "surrogateescape"))
            return [bool(int(n)) for n in pipe.execute()]

    def before_reset(self, namespace: bytes) -> str | None:
        """Nothing to mark: the keys go at once."""
        return None

    def ping(self) -> str:
        """``PING``; then, without ``redis_cluster``, ``INFO cluster``: a Cluster node raises
        :class:`~kvtier.core.tiers.redis.failure.ClusterNode` (a server refusing ``INFO`` is let be)."""
        import redis

        client = self._connect()
        client.ping()
        if not self.settings.redis_cluster:
            with contextlib.suppress(redis.ResponseError):
                if int(client.info("cluster").get("cluster_enabled", 0)):
                    raise ClusterNode(self.where)
        return "PING"

    def failure(self, exc: BaseException, left_s: float) -> tuple[ProbeState, str]:
        return classify(exc, self.settings, left_s)

    def close(self) -> None:
        if self._raw is not None:
            with contextlib.suppress(Exception):  # closing a half-open client must not hide an answer
                self._raw.close()
