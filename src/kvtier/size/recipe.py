"""The offload tier as three copy-paste configurations that agree with each other.

- kvtier connector: ``--kv-transfer-config`` with ``kv_connector_extra_config`` keys
  ``chunk_tokens``, ``cpu_gib``, ``disk_path``, ``disk_gib``; sizes are the TOTAL across TP ranks
  (kvtier's convention, the same as vLLM's flag); ``--shutdown-timeout`` so a SIGTERM lets the
  connector flush (:data:`SHUTDOWN_TIMEOUT_S`).
- vLLM native: ``--kv-offloading-backend native --kv-offloading-size GiB``, total across TP
  (operator's guide § "Sizing math"; flags from v0.11.1, § "Version gates").  Native offload is
  CPU DRAM only here; a disk share is left to kvtier or LMCache.
- LMCache: ``LMCACHE_MAX_LOCAL_CPU_SIZE`` is per rank: vLLM itself divides ``--kv-offloading-size``
  by ``tensor_parallel_size × pipeline_parallel_size`` when it configures LMCache
  (``vllm/config/vllm.py`` ``_post_init_kv_transfer_config``), so total = per-rank × TP.  The guide
  asks these two to stay consistent (§ "Sizing math", "Done when" item 2).  A disk share uses
  ``LMCACHE_LOCAL_DISK`` / ``LMCACHE_MAX_LOCAL_DISK_SIZE`` with ``LMCACHE_ENABLE_ASYNC_LOADING=False``
  (LMCache#2502, guide § "Known bugs").

With a shared Redis/Valkey tier (``redis_url``, docs/shared-tier.md) the kvtier line also names
the server and a shared-secret file, and the recipe gives the server's ``maxmemory``: the whole
tier (cpu + disk) plus ``REDIS_OVERHEAD`` for value headers (64 bytes per chunk) and Redis's own
per-key bookkeeping, with ``allkeys-lru`` so a full server evicts instead of refusing writes.  One
server serves every replica: replicas share prefixes, so it does not grow with their number.

With the object-store tier (``s3_bucket``, docs/s3.md) the kvtier line names the bucket (and an
S3-compatible server's ``s3_endpoint_url``), a shared-secret file, and either the cap
``s3_capacity_gib`` or, without one, a week's ``s3_ttl_s``; credentials never enter the line.  The
recipe adds the tier's modeled cost of one chunk (its registry record's
:class:`~kvtier.core.tiers.registry.TierModel`: bandwidth and first-byte latency) and the lifecycle
rules the bucket wants.

``LMCACHE_CHUNK_SIZE`` follows ``--chunk-tokens`` so both connectors cut the same chunks; paths are
quoted for the shell (``shlex.quote``).

The total is rounded up to a whole multiple of TP GiB, so every rank gets a whole number of GiB
and the three dialects state exactly the same bytes.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from typing import Any

from kvtier.core.configload import MAX_GIB
from kvtier.size.compression import DISK

KVTIER_CONNECTOR = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    # a kvtier chunk that cannot be loaded (failed verification, disk error) is recomputed instead of
    # failing the request; vLLM's default is "fail" (vllm/config/kv_transfer.py kv_load_failure_policy)
    "kv_load_failure_policy": "recompute",
}


BLOCK_SIZES = {"CUDA attention backends": 16, "vLLM's CPU backend": 128}
"""Default KV block sizes (tokens) a chunk should be a whole number of: vLLM ``CacheConfig.DEFAULT_BLOCK_SIZE``
= 16 (``vllm/config/cache.py``) and 128 on the CPU platform (``vllm/platforms/cpu.py``
``check_and_update_config``)."""


def chunk_notes(chunk_tokens: int) -> list[str]:
    """Warnings for a chunk size that is not a whole number of the common vLLM block sizes."""
    misfits = [f"{size} ({where})" for where, size in BLOCK_SIZES.items() if chunk_tokens % size]
    if not misfits:
        return []
    return [(f"--chunk-tokens {chunk_tokens} is not a multiple of the default block size "
            f"{' or '.join(misfits)}: the connector refuses it at start-up (a chunk is a whole number of the "
             "server's blocks) unless the server's --block-size divides it; use --chunk-tokens 128 or pass vLLM "
             "--block-size, and check with kvtier check --block-size N.")]


DEFAULT_CHUNK_TOKENS = 128
"""``chunk_tokens`` of a recipe for a model without Mamba/linear-attention state (the connector's
``auto`` resolves to this on every attention-only model: the least multiple of 16 or 128 that is
at least 128, kvtier.integrations.vllm.engine_config.AUTO_MIN_CHUNK_TOKENS)."""


def recipe_chunk_tokens(given: int | None, state: bool) -> tuple[int | str, str | None]:
    """``chunk_tokens`` for the kvtier recipe and a note (None when there is nothing to say).

    A model with ``state`` layers (Mamba, gated DeltaNet: a KV cache group of kind ``state``) has
    a state block size vLLM picks at startup from the state's bytes, the GPU and the dtype (384 or 640
    tokens on Qwen3-Next, docs/vllm.md); the connector refuses a chunk_tokens that is not a multiple
    of it (:func:`kvtier.integrations.vllm.engine_config.resolve_chunk_tokens`), so the recipe says
    ``auto`` (the least multiple of every group's block size that is at least 128) unless the
    operator gave one, and then a note says the engine may refuse it.
    """
    if not state:
        return (given if given is not None else DEFAULT_CHUNK_TOKENS), None
    if given is None:
        return "auto", None
    return given, (f"--chunk-tokens {given}: this model keeps Mamba/linear-attention state, whose block size vLLM "
                   "picks at startup (384 or 640 tokens on Qwen3-Next); the engine refuses a chunk_tokens that is not "
                   "a multiple of it: leave --chunk-tokens out for chunk_tokens auto.")


@dataclass(frozen=True)
class Recipe:
    """One offload tier in three dialects.  ``cpu_gib``/``disk_gib`` are totals across TP."""

    cpu_gib: int
    disk_gib: int
    tp: int
    kvtier: str
    vllm_native: str
    lmcache: str
    redis_maxmemory_gib: int | None = None
    redis: str | None = None
    object_store: str | None = None
    """The bucket's setup and the object-store tier's modeled cost per chunk (None without ``s3_bucket``)."""
    object_store_chunk_ms: float | None = None
    """Modeled time to load one chunk from the object-store tier, ms (latency + bytes / bandwidth)."""

    def to_json(self) -> dict[str, object]:
        return {"cpu_gib": self.cpu_gib, "disk_gib": self.disk_gib, "tp": self.tp, "kvtier": self.kvtier,
                "vllm_native": self.vllm_native, "lmcache": self.lmcache,
                "redis_maxmemory_gib": self.redis_maxmemory_gib, "redis": self.redis,
                "object_store": self.object_store, "object_store_chunk_ms": self.object_store_chunk_ms}


SHUTDOWN_TIMEOUT_S = 30
"""``--shutdown-timeout`` of the kvtier line, seconds: without it vLLM 0.32 aborts on SIGTERM and
force-kills its engine core at once (``shutdown_timeout`` 0, vllm/engine/arg_utils.py), so the
connector's graceful-stop flush never runs; vLLM then gives the engine core this long in all to
drain and tear down (vllm/v1/utils.py ``shutdown``), which covers kvtier's default
``shutdown_flush_s`` (30 s) on an idle server (docs/vllm.md "Shutdown and restart", docs/deploy.md)."""

WORKER_SHUTDOWN_TIMEOUT_S = 35
"""``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` of a kvtier line with a disk tier: vLLM 0.32 waits this long
for its workers to exit before SIGTERM (default 5 s, vllm/v1/executor/multiproc_executor.py), and the
flush of kvtier's default ``shutdown_flush_s`` (30 s) runs in that exit (kvtier audit rule
``kvtier-worker-shutdown-timeout-short``: at least shutdown_flush_s + 5 s)."""

REDIS_TLS_DIR = "/etc/redis/tls"
"""Where the Redis server line of a ``rediss://`` recipe reads its certificate, key and CA (PEM)."""
KVTIER_TLS_CA_FILE = "/etc/kvtier/tls/ca.crt"
"""``redis_tls_ca_file`` of a ``rediss://`` recipe: the CA that signed the server's certificate."""

REDIS_OVERHEAD = 0.05
"""Share added to the tier size for Redis: 64-byte value headers plus per-key bookkeeping (tens of
bytes) are far below 1% for chunks of hundreds of KiB; the rest is allocator slack."""


def round_total(gib: float, tp: int) -> int:
    """``gib`` rounded up to a multiple of ``tp`` whole GiB (0 stays 0), down where up would pass the
    connector's bound on a ``*_gib`` key (:data:`kvtier.core.configload.MAX_GIB`: ``--offload-gib`` 1048576
    at TP 3 printed ``cpu_gib`` 1048578, which the connector refuses)."""
    if gib <= 0:
        return 0
    up = math.ceil(gib / tp) * tp
    return up if up <= MAX_GIB else math.floor(MAX_GIB / tp) * tp


def build_recipe(model: str, tp: int, cpu_gib: float, disk_gib: float = 0.0,
                 disk_path: str = "/mnt/nvme/kvtier", chunk_tokens: int | str = DEFAULT_CHUNK_TOKENS,
                 redis_url: str | None = None, s3: ObjectStore | None = None,
                 others: dict[str, dict[str, Any]] | None = None, gpu_memory_utilization: float | None = None,
                 staging: bool = False, hybrid: bool = False, disk_codec: tuple[str, float] | None = None,
                 nvme_usable_gib: float | None = None, kv_cache_dtype: str | None = None) -> Recipe:
    """Three configurations for a tier of ``cpu_gib`` DRAM plus ``disk_gib`` disk (GiB, totals),
    the kvtier one with a shared tier on ``redis_url``, the object-store tier ``s3`` and the keys of
    any other registered tier (``others``: tier -> its keys, given with ``kvtier size``'s flags for
    it, :func:`tier_recipes`) when given (see the module docstring).

    ``gpu_memory_utilization``: the fraction the HBM KV budget was computed with, written on every
    line (vLLM 0.34 defaults to 1.0 with its extensible KV cache, leaving kvtier's device buffers no
    room: audit rule ``kvtier-extensible-kv-cache-headroom``).  ``staging``: the cpu share is only a
    staging tier in front of the disk tier, no larger than the engine's KV cache
    (:func:`kvtier.simulate.hierarchy.plan_tiers`); vLLM's native offload has no disk tier, so it
    gets no serve line then, only a comment (audit rule ``cpu-tier-not-above-engine-cache``).  ``hybrid``:
    the model mixes attention kinds, which LMCacheConnectorV1 cannot serve (LMCache/LMCache#3106, audit
    rule ``lmcache-inprocess-on-hybrid``): the LMCache recipe is a comment saying so.  ``disk_codec``
    ``(codec, R)``: kvtier's disk tier compresses with that codec (``codecs: {disk: [codec]}``), so its
    ``disk_gib`` is ``disk_gib`` / R; LMCache's disk (it runs no kvtier codec) holds ``disk_gib`` of
    uncompressed chunks, at most ``nvme_usable_gib`` (the NVMe the disk tier may take; None: no cap)
    rounded down to whole GiB per rank: R× the NVMe in uncompressed bytes would not fit on it; kvtier's
    ``disk_gib`` is rounded up to whole GiB per rank, but not past that room either.
    ``kv_cache_dtype``: vLLM's ``--kv-cache-dtype`` the sizes assume (``fp8``), written on every line;
    None: the engine's default (``auto``, the model's dtype)."""
    cpu, disk = round_total(cpu_gib, tp), round_total(disk_gib, tp)
    payload = chunks = disk  # what LMCache's disk holds: it runs no kvtier codec
    room = math.floor(nvme_usable_gib / tp) * tp if nvme_usable_gib is not None else None
    if room is not None:
        payload = min(payload, room)
    if disk and disk_codec is not None:  # kvtier's disk stores the payload in 1/R (codecs: {disk: [CODEC]})
        disk = round_total(disk_gib / disk_codec[1], tp)
    if room:  # rounding up must not take the disk past the NVMe (kvtier audit: kvtier-disk-volume-unfit)
        disk = min(disk, room)
    base = (f"vllm serve {shlex.quote(model)}" + (f" --tensor-parallel-size {tp}" if tp > 1 else "")
            + (f" --gpu-memory-utilization {gpu_memory_utilization:g}" if gpu_memory_utilization is not None else "")
            + (f" --kv-cache-dtype {kv_cache_dtype}" if kv_cache_dtype else ""))
    extra: dict[str, object] = {"chunk_tokens": chunk_tokens, "cpu_gib": cpu}
    if disk:
        extra.update(disk_path=disk_path, disk_gib=disk)
        if disk_codec is not None:
            extra["codecs"] = {DISK: [disk_codec[0]]}
    for values in (others or {}).values():
        extra.update(values)
    redis_gib, redis = None, None
    if redis_url:
        extra.update(redis_url=redis_url, redis_password_env="REDIS_PASSWORD",
                     shared_secret_file="/etc/kvtier/secret")
        # the chunks of the whole tier as Redis holds them: uncompressed (codecs name the disk tier only)
        redis_gib = math.ceil((cpu + chunks) * (1 + REDIS_OVERHEAD))
        listen, tls_note = _redis_listen(redis_url)
        if tls_note:
            extra["redis_tls_ca_file"] = KVTIER_TLS_CA_FILE
        redis = (f"redis-server{listen} --maxmemory {redis_gib}gb --maxmemory-policy allkeys-lru --save '' "
                 "--appendonly no --requirepass \"$REDIS_PASSWORD\"\n# one server for every replica; put the same "
                 f"secret (openssl rand -hex 32) in /etc/kvtier/secret on each engine{tls_note}")
    store_text, chunk_ms = None, None
    if s3 is not None:
        store_text, chunk_ms = _object_store(s3, extra)
    transfer = dict(KVTIER_CONNECTOR, kv_connector_extra_config=extra)
    worker = f"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS={WORKER_SHUTDOWN_TIMEOUT_S} " if disk else ""
    kvtier = (f"{worker}{base} --shutdown-timeout {SHUTDOWN_TIMEOUT_S} \\\n  --kv-transfer-config "
              f"{shlex.quote(json.dumps(transfer, separators=(',', ':')))}")
    native = f"{base} \\\n  --kv-offloading-backend native --kv-offloading-size {cpu}"
    if disk and staging:
        native = (f"# vLLM native offload has no disk tier, and the {cpu} GiB DRAM share is only a staging tier no "
                  "larger than the engine's KV cache (it would hold nothing the engine does not): serve this tier "
                  "with kvtier or LMCache")
    elif disk:
        native += f"\n# native offload holds only the {cpu} GiB DRAM share; the {disk} GiB disk share needs kvtier or LMCache"
    lines = ["LMCACHE_LOCAL_CPU=True", f"LMCACHE_MAX_LOCAL_CPU_SIZE={cpu // tp}", f"LMCACHE_CHUNK_SIZE={chunk_tokens if isinstance(chunk_tokens, int) else 256}"]
    if disk and payload:
        lines += ["LMCACHE_LOCAL_DISK=" + shlex.quote(f"file://{disk_path.rstrip('/')}/"), f"LMCACHE_MAX_LOCAL_DISK_SIZE={payload // tp}",
                  "LMCACHE_ENABLE_ASYNC_LOADING=False"]
    lmc_transfer = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, separators=(",", ":"))
    per_rank = f"# LMCACHE_MAX_LOCAL_CPU_SIZE is per rank: {cpu // tp} GiB × TP {tp} = {cpu} GiB total"
    lmcache = "\n".join([per_rank, *(f"export {line}" for line in lines),
                         f"{base} \\\n  --kv-transfer-config {shlex.quote(lmc_transfer)}"])
    if hybrid:
        lmcache = ("# LMCacheConnectorV1 fails on a model that mixes attention kinds (no SupportsHMA, LMCache/LMCache#3106): "
                   "serve this tier with kvtier or vLLM native offload")
    return Recipe(cpu, disk, tp, kvtier, native, lmcache, redis_gib, redis, store_text, chunk_ms)


@dataclass(frozen=True)
class ObjectStore:
    """The object-store tier of a recipe.

    Attributes:
        bucket: ``s3_bucket`` (created beforehand).
        endpoint_url: ``s3_endpoint_url`` of an S3-compatible server, None for AWS S3.
        capacity_gib: ``s3_capacity_gib``, None for no cap (then ``s3_ttl_s`` of :data:`OBJECT_TTL_S`).
        chunk_bytes: bytes of one chunk (all ranks), for the modeled load time; None: not modeled.
    """

    bucket: str
    endpoint_url: str | None = None
    capacity_gib: float | None = None
    chunk_bytes: int | None = None


OBJECT_TTL_S = 7 * 86400
"""``s3_ttl_s`` of a recipe without a cap: a week (docs/s3.md "Expiry and capacity")."""


def _object_store(s3: ObjectStore, extra: dict[str, object]) -> tuple[str, float | None]:
    """Add the object-store keys to ``extra``; the bucket's setup text and the modeled chunk load, ms."""
    from kvtier.core.tiers.registry import settings_keys, spec

    tier = settings_keys()["s3_bucket"]
    extra["s3_bucket"] = s3.bucket
    if s3.endpoint_url:
        extra["s3_endpoint_url"] = s3.endpoint_url
        if s3.endpoint_url.startswith("http://"):
            extra["s3_allow_http"] = True
    if s3.capacity_gib is not None:
        extra["s3_capacity_gib"] = s3.capacity_gib
    else:
        extra["s3_ttl_s"] = OBJECT_TTL_S
    extra["shared_secret_file"] = "/etc/kvtier/secret"
    lines = [(f"# bucket {s3.bucket} must exist (kvtier never creates one); give the engines AWS_ACCESS_KEY_ID and "
              "AWS_SECRET_ACCESS_KEY from a secret store, or mount an AWS credentials file and set s3_credentials_file"),
             (f"# lifecycle rules: expire objects after {OBJECT_TTL_S // 86400} days and abort incomplete multipart "
              "uploads after 1 day (docs/s3.md)"),
             "# put the same secret (openssl rand -hex 32) in /etc/kvtier/secret on each engine"]
    model = spec(tier).model
    chunk_ms = None
    if model is not None and s3.chunk_bytes:
        chunk_ms = round(model.latency_ms + s3.chunk_bytes / (model.gb_per_s * 1e9) * 1e3, 1)
        lines.append(f"# modeled: one chunk ({s3.chunk_bytes / 2**20:,.1f} MiB, all ranks) loads in about "
                     f"{chunk_ms:,.0f} ms at {model.gb_per_s:g} GB/s with {model.latency_ms:g} ms first byte "
                     f"({model.source}); a load's chunks are read in parallel, so a request pays the latency "
                     "about once: measure yours with kvtier bench-store")
    return "\n".join(lines), chunk_ms


def _redis_listen(redis_url: str) -> tuple[str, str]:
    """The redis-server flags that make it listen where ``redis_url`` points (its port; TLS only for
    ``rediss://``), and for TLS a note on the certificate; ``("", "")`` for redis:// on 6379."""
    from urllib.parse import urlsplit

    parts = urlsplit(redis_url)
    try:
        port = parts.port or 6379
    except ValueError:
        port = 6379  # kvtier's config refuses the URL itself; the line keeps Redis' default
    if parts.scheme != "rediss":
        return ("" if port == 6379 else f" --port {port}"), ""
    listen = (f" --port 0 --tls-port {port} --tls-cert-file {REDIS_TLS_DIR}/tls.crt --tls-key-file "
              f"{REDIS_TLS_DIR}/tls.key --tls-ca-cert-file {REDIS_TLS_DIR}/ca.crt --tls-auth-clients no")
    note = (f"\n# TLS: {REDIS_TLS_DIR}/tls.crt must name {parts.hostname} (the URL's host) in its subjectAltName; "
            f"copy the CA that signed it to {KVTIER_TLS_CA_FILE} on each engine")
    return listen, note


def tier_problem(tier: str, values: dict[str, Any]) -> tuple[str, str] | None:
    """``(key, sentence)`` when the keys ``values`` of ``tier`` (from ``kvtier size``'s flags for it)
    would not make a recipe the connector accepts (its settings model's own check), else ``None``;
    the sentence names configuration keys (the CLI writes them as its flags)."""
    from urllib.parse import urlsplit

    from pydantic import ValidationError

    from kvtier.core.tiers.redis.settings import TIER as REDIS
    from kvtier.core.tiers.registry import settings_model
    from kvtier.core.tiers.s3.settings import TIER as S3

    model = settings_model(tier)
    if model is not None:
        try:  # the recipe adds s3_allow_http itself for an http:// endpoint
            model(**values, **({"s3_allow_http": True} if tier == S3 else {}))
        except ValidationError as exc:
            error = exc.errors()[0]
            key = str(error["loc"][0]) if error["loc"] else next(iter(values))
            return key, str(error["msg"]).removeprefix("Value error, ").replace(
                " (or http:// with s3_allow_http)", " or http://")
    if tier == REDIS and "@" in urlsplit(str(values["redis_url"])).netloc:
        return "redis_url", ("redis_url must not carry a user or password (the recipe reads the password from "
                             "REDIS_PASSWORD); give host, port and database only")
    return None


def tier_recipes(tiers: dict[str, dict[str, Any]], chunk_bytes: int) -> tuple[str | None, ObjectStore | None,
                                                                               dict[str, dict[str, Any]], list[str]]:
    """``build_recipe``'s ``redis_url``, ``s3`` and ``others`` from each tier's keys (``kvtier size``'s
    flags for it), and notes on tiers from outside kvtier (their module must be in ``tier_modules``)."""
    from kvtier.core.tiers.redis.settings import TIER as REDIS
    from kvtier.core.tiers.registry import BUILTIN
    from kvtier.core.tiers.s3.settings import TIER as S3

    others = {t: v for t, v in tiers.items() if t not in (REDIS, S3)}
    s3 = tiers.get(S3)
    store = None if s3 is None else ObjectStore(s3["s3_bucket"], s3.get("s3_endpoint_url"),
                                                s3.get("s3_capacity_gib"), chunk_bytes or None)
    builtin = {record.name for record in BUILTIN}
    notes = [f"the {t} tier is not shipped with kvtier: add the module that registers it to the recipe's "
             "tier_modules, and install it on every engine (docs/store.md, 'Adding a tier')."
             for t in others if t not in builtin]
    return tiers.get(REDIS, {}).get("redis_url"), store, others, notes
