"""``kvtier purge`` over a Redis/Valkey server or Cluster: the redis tier's
:attr:`~kvtier.core.tiers.registry.TierSpec.purge` hook.

Keys are ``<prefix><namespace hex>:[<keyspace>:]<chunk key hex>`` (:mod:`kvtier.core.tiers.redis`;
the keyspace segment, 16 hex digits, only under a ``shared_secret``).  The purge lists them with
``SCAN MATCH`` (the prefix, glob characters escaped; in a Cluster redis-py's ``scan_iter`` visits
every primary), keeps those whose name parses as above and that the selector admits, and removes
them with ``UNLINK``, one pipeline per batch of :data:`BATCH` keys; bytes are the values' lengths
(``STRLEN``: header and payload).

Age: a value is written once with ``SET ... EX redis_ttl_s NX`` and no read refreshes its expiry, so
its age is ``redis_ttl_s`` minus what ``PTTL`` has left.  This assumes the engines that wrote it use
the same ``redis_ttl_s`` as the purge (default 86400 s; ``--redis-ttl-s``).  ``OBJECT IDLETIME``
was not used: every engine's read resets it, and a server under an LFU ``maxmemory-policy``
refuses it.

Tenant: a value of format version 2 carries its writer's tenant record in its header
(:mod:`kvtier.core.tiers.sharedvalue`, :mod:`kvtier.core.tenant`).  With ``--salt``/``--lora`` the
lookup pipeline adds a ``GETRANGE key 0 111`` per key (the header alone, never the payload): a
value whose header names the namespace and chunk key its key says and whose record matches goes;
a version-1 value (written before records) or an all-zero record is of an unknown tenant, kept and
counted; a header that is not a kvtier value's or names another chunk, and a record that fails its
check, are kept and named as problems.

Every call is bounded by the client's socket timeouts (``redis_timeout_s``); a failure is a
:class:`~kvtier.core.purge.PurgeFailed` naming the server.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from kvtier.core.config import redact_url
from kvtier.core.errors import UserError
from kvtier.core.purge import NamespacePurge, PurgeFailed, PurgeSelector
from kvtier.core.tiers.redisclear import glob_escape
from kvtier.core.tiers.redisclient import make_client
from kvtier.core.tiers.redissettings import redis_settings
from kvtier.core.tiers.sharedvalue import HEADER_BYTES, peek

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig

TIER = "redis"
BATCH = 1000
"""Keys asked per ``SCAN`` call and looked up (``STRLEN``, ``PTTL``) or removed per pipeline."""
_REST = re.compile(rb"([0-9a-f]{32}):(?:[0-9a-f]{16}:)?([0-9a-f]{32})")


def purge(config: KVTierConfig, selector: PurgeSelector, dry_run: bool) -> list[NamespacePurge] | None:
    """Purge the configured server (see the module docstring); ``None`` without ``redis_url``.

    Returns:
        one :class:`~kvtier.core.purge.NamespacePurge` per namespace with keys the selector admits
        (by namespace hex), plus an empty one per namespace the selector names that has none.

    Raises:
        PurgeFailed: the server cannot be reached, refuses the password, or answers with an error.
        UserError: a bad password file or environment variable (:func:`make_client`), or a Cluster
            node named without ``redis_cluster`` (a plain client would purge one shard only).
    """
    import redis

    settings = redis_settings(config)
    if not settings.redis_url:
        return None
    where = redact_url(settings.redis_url)
    try:
        client = make_client(settings)
    except UserError:
        raise
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:  # a Cluster seed that
        # does not answer, or a node that is not in Cluster mode
        detail = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
        raise PurgeFailed(f"the Redis server at {where} could not be reached for the purge ({detail}); check "
                          "--redis-url, that --redis-cluster is given only for a Cluster node, the password and "
                          "that the server is up") from None
    prefix = settings.redis_key_prefix.encode()
    results: dict[bytes, NamespacePurge] = {ns: NamespacePurge(TIER, ns) for ns in sorted(selector.namespaces)}
    try:
        if not settings.redis_cluster and _cluster_enabled(client):
            # a plain client scans one node only: the purge would miss every other shard's keys, silently
            raise UserError(f"the Redis server at {where} is a Cluster node; add --redis-cluster so that every "
                            "primary is purged")
        patterns = ([glob_escape(prefix + ns.hex().encode() + b":") + b"*" for ns in sorted(selector.namespaces)]
                    or [glob_escape(prefix) + b"*"])
        for pattern in patterns:
            batch: list[tuple[bytes, bytes, bytes]] = []
            for rkey in client.scan_iter(match=pattern, count=BATCH):
                match = _REST.fullmatch(rkey[len(prefix):])
                if match is None:
                    continue
                namespace = bytes.fromhex(match.group(1).decode())
                if not selector.wants_namespace(namespace):
                    continue
                batch.append((namespace, bytes.fromhex(match.group(2).decode()), rkey))
                if len(batch) >= BATCH:
                    _purge_batch(client, batch, selector, settings.redis_ttl_s, dry_run, results)
                    batch = []
            if batch:
                _purge_batch(client, batch, selector, settings.redis_ttl_s, dry_run, results)
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
        raise PurgeFailed(f"the Redis server at {where} did not answer the purge ({exc.__class__.__name__}: {exc}); "
                        "check --redis-url, the password and that the server is up") from None
    finally:
        client.close()
    return [results[ns] for ns in sorted(results)]


def _cluster_enabled(client: Any) -> bool:
    """Whether a standalone client's server runs in Cluster mode (``INFO cluster``)."""
    return bool(int(client.info("cluster").get("cluster_enabled", 0)))


def _purge_batch(client: Any, batch: list[tuple[bytes, bytes, bytes]], selector: PurgeSelector, ttl_s: int,
                 dry_run: bool, results: dict[bytes, NamespacePurge]) -> None:
    """Look up (and unless ``dry_run`` remove) one batch of ``(namespace, chunk key, redis key)``."""
    per_key = 3 if selector.needs_tenant else 2
    pipe = client.pipeline(transaction=False)
    for _ns, _key, rkey in batch:
        pipe.strlen(rkey)
        pipe.pttl(rkey)
        if selector.needs_tenant:
            pipe.getrange(rkey, 0, HEADER_BYTES - 1)  # the header, with the tenant record: never the payload
    answers = pipe.execute()
    chosen: list[tuple[bytes, bytes, int]] = []
    for i, (namespace, key, rkey) in enumerate(batch):
        size, pttl = int(answers[per_key * i]), int(answers[per_key * i + 1])
        if pttl == -2 or size == 0:  # expired or removed meanwhile
            continue
        result = results.setdefault(namespace, NamespacePurge(TIER, namespace))
        if selector.older_than_s is not None:
            if pttl < 0:  # no expiry: not written by kvtier's SET ... EX; its age is unknown
                continue
            if pttl > (ttl_s + 1) * 1000:  # more left than the TTL assumed: the engines' redis_ttl_s is longer,
                # every age here reads too young and --older-than would quietly remove nothing
                problem = (f"a value has {pttl / 1000:,.0f} s left to live, more than redis_ttl_s {ttl_s:,} s: the "
                           "engines use a longer redis_ttl_s, so ages cannot be told; pass theirs with "
                           "--redis-ttl-s (values kept)")
                if problem not in result.problems:
                    result.problem(problem)
                continue
            written_s = selector.now - (ttl_s - pttl / 1000.0)
            if not selector.old_enough(written_s):
                continue
        if selector.needs_tenant and not _tenant_admits(selector, result, namespace, key, rkey,
                                                        bytes(answers[per_key * i + 2] or b"")):
            continue
        chosen.append((namespace, rkey, size))
    if not chosen:
        return
    if dry_run:
        removed = [1] * len(chosen)
    else:
        pipe = client.pipeline(transaction=False)
        for _ns, rkey, _size in chosen:
            pipe.unlink(rkey)
        removed = [int(n) for n in pipe.execute()]
    for (namespace, _rkey, size), gone in zip(chosen, removed):
        if gone:
            results[namespace].chunks += 1
            results[namespace].bytes += size


def _tenant_admits(selector: PurgeSelector, result: NamespacePurge, namespace: bytes, key: bytes, rkey: bytes,
                   head: bytes) -> bool:
    """Whether the value whose first bytes are ``head`` goes under the selector's tenant (see the
    module docstring; problems and unknown tenants counted in ``result``)."""
    name = rkey.decode(errors="replace")
    header = peek(head)
    if header is None or header.namespace != namespace or header.key != key:
        result.problem(f"{name} is not a kvtier value of this name (its header differs); kept")
        return False
    return selector.tenant_admits(result, namespace, header.record, name)
