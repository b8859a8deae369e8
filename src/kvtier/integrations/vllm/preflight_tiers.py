"""The preflight's findings about the configured tiers themselves, read from a valid
:class:`~kvtier.core.config.KVTierConfig` (the transfer config around it is
:mod:`kvtier.integrations.vllm.preflight`'s): each tier's own check and advice (its registry
record's hooks), a tier listed but not configured or configured but not listed, credentials put in
the serve line, a cpu tier smaller than one chunk, a disk tier on tmpfs.  Each problem is one
sentence naming the key and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.receiptsinks import receipt_sink_problems
from kvtier.core.tiers import factory, registry
from kvtier.core.tiers.disk.check import mount_of, static_disk_path_problem
from kvtier.core.tiers.node.settings import TIER as NODE_TIER
from kvtier.core.tiers.node.settings import node_settings
from kvtier.integrations.vllm.engine_config import AUTO_MIN_CHUNK_TOKENS

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """One finding of the pre-flight.

    Attributes:
        severity: ``"error"`` (vLLM or kvtier refuses to start) or ``"warning"`` (starts, but not
            as an operator wants).
        key: the JSON key it is about, dotted (``kv_connector_extra_config.cpu_gib``).
        message: one sentence naming what is wrong and the fix.
        only_if: for a warning that is a refusal on some servers, what the server must have for
            vLLM to start (``kvtier check``'s verdict names it); ``None`` otherwise.
    """

    severity: Severity
    key: str
    message: str
    only_if: str | None = None


def tier_problems(key: str, config: KVTierConfig) -> list[Problem]:
    """Each configured tier's own preflight (:func:`kvtier.core.tiers.factory.check`), read as its
    start-up reads it: e.g. the disk tier's directory (kept when it passes, as the tier would create
    it), the redis tier's password and shared secret."""
    found = [Problem("error", f"{key}.{name}", message)
             for tier in config.tiers for name, message in factory.check(tier, config)]
    # the receipt log's directory and the OTLP exporter's SDK (kvtier.core.receiptsinks)
    return found + [Problem("error", f"{key}.{name}", message) for name, message in receipt_sink_problems(config)]


def config_advice_problems(key: str, config: KVTierConfig) -> list[Problem]:
    """Each configured tier's advice (:func:`kvtier.core.tiers.factory.advice`): warnings about what a
    configuration it starts with leaves exposed, read from the configuration alone."""
    out: list[Problem] = []
    for tier in config.tiers:
        try:
            found = factory.advice(tier, config)
        except ConfigError:
            continue  # an unknown tier or a module that does not import: reported by the config's own checks
        out.extend(Problem("warning", f"{key}.{name}", message) for name, message in found)
    return out


CREDENTIAL_MARKS = ("access_key", "secret_key", "secret_access", "session_token", "password", "passwd", "api_key",
                    "aws_secret", "credential")
"""Fragments of a key name that hold a credential (``aws_secret_access_key``, ``s3_access_key_id``,
``redis_password``); a known kvtier key (``redis_password_file``, ``s3_credentials_file``) is not one."""

CREDENTIALS_FIX = ("credentials never go in the serve line (ps, shell history and manifests show it): give the "
                   "S3 keys in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the server's environment or in the file "
                   "named by s3_credentials_file, a Redis password in redis_password_env or redis_password_file")


def looks_like_credential(name: str) -> bool:
    """Whether configuration key ``name`` (not a known kvtier key) would hold a credential."""
    lowered = name.lower()
    return any(mark in lowered for mark in CREDENTIAL_MARKS)


def unconfigured_tier_problems(key: str, extra: dict[str, Any], config: KVTierConfig) -> list[Problem]:
    """A warning per tier ``tiers`` names explicitly whose settings are not given (it is skipped)."""
    if "tiers" not in extra:
        return []
    out = []
    for tier in config.tiers:
        try:
            if factory.configured(tier, config):
                continue
        except ConfigError:
            continue  # an unknown tier or a module that does not import: reported by the config's own checks
        keys = ", ".join(registry.spec(tier).keys)
        out.append(Problem("warning", f"{key}.tiers",
                           f"tiers lists {tier!r} but its settings do not ask for it{f' ({keys})' if keys else ''}, "
                           f"so the {tier} tier is skipped; set them or remove {tier!r} from tiers"))
    return out


def tier_order_problems(key: str, extra: dict[str, Any], config: KVTierConfig, reads: bool = True) -> list[Problem]:
    """Warnings where ``tiers`` and what is served differ: a shared tier listed above a local one (the
    store keeps the local tiers' order and asks the shared ones only for what the local tiers lack,
    core/changes.py splits them), and a second shared tier (the scheduler's lookups and the workers'
    reads go to the first shared tier only: scheduler/remote.py, ``Index`` ``shared[0]``; the others
    only receive writes), unless the engine never ``reads`` (``kv_role`` ``kv_producer``: writing to
    every shared tier is then what it is for).  With ``tiers`` not given, the default order: only
    the second warning."""
    try:
        listed = [t for t in config.tiers if factory.configured(t, config)]
        shared = {t for t in listed if registry.spec(t).shared}
    except ConfigError:
        return []  # an unknown tier or a module that does not import: reported by the config's own checks
    out = []
    in_order = [t for t in listed if t in shared]
    read, unread = (in_order[0], in_order[1:]) if in_order else ("", [])
    if unread and reads:
        given = "lists" if "tiers" in extra else "has (by default)"
        one = len(unread) == 1
        out.append(Problem("warning", f"{key}.tiers",
                           f"tiers {given} {len(unread) + 1} shared tiers, but kvtier looks up and reads only the "
                           f"first, {read!r}: {' and '.join(map(repr, unread))} only {'receives' if one else 'receive'} "
                           f"writes, and a chunk that {read!r} no longer holds is a miss even where "
                           f"{'it holds' if one else 'they hold'} it; keep one shared tier in tiers (docs/store.md)"))
    above = next((t for i, t in enumerate(listed) if t in shared and any(u not in shared for u in listed[i:])), None)
    if above is None or "tiers" not in extra:
        return out
    below = next(u for u in listed[listed.index(above):] if u not in shared)
    used = [t for t in listed if t not in shared] + [t for t in listed if t in shared]
    return out + [Problem("warning", f"{key}.tiers",
                          f"tiers lists the shared tier {above!r} above the local tier {below!r}, but kvtier always "
                          f"serves from local tiers first and asks a shared tier only for what they lack, so the "
                          f"order used is {used}; list the local tiers first")]


def unused_tier_problems(key: str, extra: dict[str, Any], config: KVTierConfig) -> list[Problem]:
    """A warning per tier whose settings are given but which ``tiers`` leaves out (it is not used)."""
    settings = {s.name: [k for k in s.keys if extra.get(k) not in (None, "")] for s in registry.specs()}
    return [Problem("warning", f"{key}.tiers",
                    f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} set but tiers "
                    f"{list(config.tiers)} leaves out {tier!r}, so the {tier} tier is not used; add {tier!r} to "
                    f"tiers or remove {' and '.join(given)}")
            for tier, given in settings.items() if given and "tiers" in extra and tier not in config.tiers]


def idle_codec_problems(key: str, config: KVTierConfig) -> list[Problem]:
    """A warning per tier ``codecs`` gives a chain for that this config does not run (its settings unset,
    or ``tiers`` leaves it out): nothing is written there, so the chain (an encryption, say) does nothing."""
    out = []
    for tier in config.codecs:
        try:
            runs = tier in config.tiers and factory.configured(tier, config)
        except ConfigError:
            continue  # an unknown tier: reported by the config's own checks
        if not runs:
            keys = registry.spec(tier).keys[0] if registry.spec(tier).keys else "its settings"
            out.append(Problem("warning", f"{key}.codecs",
                               f"codecs gives a chain for tier {tier!r}, which this config does not run "
                               f"({'tiers leaves it out' if tier not in config.tiers else f'no {keys}'}), so "
                               f"nothing is written there and the chain does nothing; configure the {tier} tier "
                               f"or remove codecs.{tier}"))
    return out


def node_pool_below_cpu_tier(node_gib: float, cpu_gib: float) -> str | None:
    """The sentence of a node pool smaller than one engine's own cpu tier (``kvtier check`` and ``kvtier
    audit``'s ``kvtier-node-pool-below-working-set`` say the same), or None when it is not."""
    if node_gib <= 0 or node_gib >= cpu_gib:
        return None
    return (f"node_gib {node_gib:g} GiB is less than this engine's own cpu tier (cpu_gib {cpu_gib:g} GiB), its hot "
            "working set: the pool shared by every engine on the host cannot hold even one engine's hot chunks, so "
            "a neighbour's prefix is evicted before another engine asks for it")


def node_pool_problems(key: str, config: KVTierConfig) -> list[Problem]:
    """:func:`node_pool_below_cpu_tier` of a config whose node tier runs, as a warning on ``node_gib``."""
    node = node_settings(config)
    if not node.node_socket or NODE_TIER not in config.tiers:
        return []
    said = node_pool_below_cpu_tier(node.node_gib, config.cpu_gib)
    return [Problem("warning", f"{key}.node_gib", f"{said}; lower cpu_gib to node_gib or start the pool larger "
                    "(kvtier node serve --node-gib, and node_gib here; docs/node.md § Sizing)")] if said else []


def disk_not_above_cpu(config: KVTierConfig) -> str | None:
    """The sentence of a write-through disk tier (the default ``write_mode``) no larger than the cpu
    tier, or None when the disk tier does not run, is larger, or is write-back (it takes what the cpu
    tier evicts).  The disk tier takes every chunk the cpu tier takes (docs/size.md § Inclusive tiers),
    so while the engine runs the stack holds about the cpu tier's chunks and the disk tier's GiB add
    almost no hits; it still keeps chunks across a restart.  ``kvtier check`` and ``kvtier audit``'s
    ``kvtier-disk-tier-not-above-cpu-tier`` say the same."""
    disk = next((spec.name for spec in registry.BUILTIN if "disk_path" in spec.keys), None)  # the tier disk_gib sizes
    if not (config.disk_path and config.disk_gib > 0 and disk in config.tiers) \
            or config.write_mode != "write-through" or config.disk_gib > config.cpu_gib:
        return None
    return (f"disk_gib {config.disk_gib:g} is not larger than cpu_gib {config.cpu_gib:g} with write_mode "
            "write-through (the default): the disk tier takes every chunk the cpu tier takes, so while the engine "
            f"runs the cache holds about {config.cpu_gib:g} GiB, not {config.cpu_gib + config.disk_gib:g}, and the "
            "disk tier adds almost no hits (it does keep chunks across a restart)")


DISK_NOT_ABOVE_CPU_FIX = ("make disk_gib several times cpu_gib, or set write_mode to write-back (docs/size.md § "
                          "Inclusive tiers)")
"""What :func:`disk_not_above_cpu`'s sentence is followed by."""


def disk_tier_not_above_cpu_tier(key: str, config: KVTierConfig) -> list[Problem]:
    """:func:`disk_not_above_cpu` as a warning on ``disk_gib``."""
    said = disk_not_above_cpu(config)
    return [Problem("warning", f"{key}.disk_gib", f"{said}; {DISK_NOT_ABOVE_CPU_FIX}")] if said else []


MIN_KV_BYTES_PER_TOKEN = 64
"""The least KV bytes one token can take in any model vLLM runs, bytes: one layer, K and V, one KV
head of 32 (the smallest head size of vLLM's CPU and ROCm attention backends,
vllm/v1/attention/backends/cpu_attn.py ``get_supported_head_sizes``), one byte each (fp8 cache)."""

SMALL_MODEL_KV_BYTES_PER_TOKEN = 12_288
"""KV bytes per token of a small model people serve, Qwen2.5-0.5B in bf16 (24 layers, K and V, 2
KV heads of 64, 2 bytes): below one of its chunks, ``check`` warns."""


FLOOR_ADVICE_CHUNKS = 100
"""Chunks the size a floor problem suggests holds at least ("room for hundreds of chunks")."""


def cpu_tier_floor_problems(key: str, config: KVTierConfig) -> list[Problem]:
    """``cpu_gib`` against one chunk: the connector refuses a cpu tier smaller than one chunk at
    start-up (:func:`kvtier.core.sizing.cpu_capacity_bytes`), but a chunk's bytes depend on the
    model, which ``check`` does not know.  An error below one chunk of the smallest layout any
    model can have (:data:`MIN_KV_BYTES_PER_TOKEN`: certainly refused), a warning below one chunk
    of a small real model (:data:`SMALL_MODEL_KV_BYTES_PER_TOKEN`).  ``auto`` chunks are counted
    at their least, 128 tokens.  The same floor holds for ``disk_gib`` (with ``disk_path``) and
    ``node_gib`` (with ``node_socket``): a tier smaller than one chunk holds nothing."""
    found = _floor_problems(key, config, "cpu_gib", config.cpu_gib, 4, (
        "so the connector would refuse it at start-up", ("; the connector refuses a cpu tier smaller than one chunk "
        "of the served model at start-up")))
    if config.disk_path and config.disk_gib > 0:
        found += _floor_problems(key, config, "disk_gib", config.disk_gib, 100, (
            "so the disk tier could hold nothing", ", so the disk tier holds no chunk of a real model"))
    node = node_settings(config)
    if node.node_socket and node.node_gib > 0:
        found += _floor_problems(key, config, "node_gib", node.node_gib, 64, (
            "so the node pool could hold nothing", ", so the node pool holds no chunk of a real model"))
    return found


def _floor_problems(key: str, config: KVTierConfig, name: str, gib: float, example: int,
                    consequences: tuple[str, str]) -> list[Problem]:
    tokens = AUTO_MIN_CHUNK_TOKENS if config.chunk_tokens == "auto" else config.chunk_tokens
    size_bytes = gib * GiB
    floors: tuple[tuple[Literal["error", "warning"], int, str], ...] = (
            ("error", MIN_KV_BYTES_PER_TOKEN, ("of the smallest model vLLM can run (one layer, one 32-wide KV head, "
             f"fp8: {MIN_KV_BYTES_PER_TOKEN} bytes a token), {consequences[0]}")),
            ("warning", SMALL_MODEL_KV_BYTES_PER_TOKEN, (f"of a model as small as Qwen2.5-0.5B "
             f"({SMALL_MODEL_KV_BYTES_PER_TOKEN} bytes a token in bf16){consequences[1]}")))
    for severity, per_token, which in floors:
        chunk_bytes = tokens * per_token
        if size_bytes < chunk_bytes:
            # the example holds FLOOR_ADVICE_CHUNKS chunks of this size: a fixed one could be the
            # very value refused (cpu_gib 4 against a 12 GiB chunk was told "e.g. 4")
            room = max(example, math.ceil(FLOOR_ADVICE_CHUNKS * chunk_bytes / GiB))
            shorter = "" if room == example else ", or a shorter chunk_tokens (auto, the default)"
            return [Problem(severity, f"{key}.{name}",
                            f"{name}={gib:g} ({int(size_bytes)} bytes) cannot hold one {tokens}-token "
                            f"chunk ({chunk_bytes} bytes) {which}; set {name} to room for hundreds of chunks, "
                            f"e.g. {room}{shorter}")]
    return []


def static_tier_problems(key: str, config: KVTierConfig, host_checks: bool) -> list[Problem]:
    """The tiers' checks that need no host (:func:`cpu_tier_floor_problems`,
    :func:`disk_size_missing_problems`); without ``host_checks`` also a ``disk_path`` under a kernel
    tree (:func:`~kvtier.core.tiers.disk.check.static_disk_path_problem`; with them the host's
    filesystem check names it)."""
    found = cpu_tier_floor_problems(key, config) + disk_size_missing_problems(key, config)
    kernel = None if host_checks or not config.disk_path else static_disk_path_problem(config.disk_path)
    return found + ([Problem("error", f"{key}.disk_path", kernel)] if kernel else [])


def disk_size_missing_problems(key: str, config: KVTierConfig) -> list[Problem]:
    """``disk_path`` given without a ``disk_gib`` above 0: the engine would run with no disk tier,
    writing nothing and saying nothing (the reverse, ``disk_gib`` without ``disk_path``, is refused by
    :class:`~kvtier.core.config.KVTierConfig`); an error naming both keys, as the disk tier's size
    is the operator's to give (a default could fill the volume)."""
    if not config.disk_path or config.disk_gib > 0 or registry.asked_by("disk_path") not in config.tiers:
        return []
    return [Problem("error", f"{key}.disk_gib",
                    "disk_path is set but disk_gib is not (or is 0), so the engine would run with no disk tier; set "
                    "disk_gib to the disk tier's size in GiB (total across tensor-parallel ranks, e.g. 100) or "
                    "remove disk_path")]


NODE_SIZE_TOLERANCE = 0.05
"""Share by which a live pool's capacity may differ from ``node_gib`` unremarked: the owner keeps its
index and page table in the pool file, so a 1 GiB pool (256 KiB pages) holds 0.998 GiB of pages."""


def node_pool_size_problems(entries: list[tuple[str, dict[str, Any]]], deadline_s: float) -> list[Problem]:
    """A warning per KVTierConnector whose ``node_gib`` differs from the size of the live pool behind
    its ``node_socket`` (the owner's ``STATS`` reply, ``capacity_bytes``) by more than
    :data:`NODE_SIZE_TOLERANCE`: ``node_gib`` is what ``kvtier size``, ``check`` and ``audit`` believe
    (docs/node.md), the owner's ``--node-gib`` what the engines get.  No warning without
    ``node_gib``, or when the owner does not answer within ``deadline_s`` (the probe says so).

    Args:
        entries: ``(key prefix, connector dict)`` of each KVTierConnector (``preflight.kvtier_entries``).
    """
    from kvtier.core.tiers.node import protocol
    from kvtier.core.tiers.node.blobs import open_blobs
    from kvtier.core.tiers.node.client import NodeUnavailable

    out: list[Problem] = []
    for prefix, entry in entries:
        extra = entry.get("kv_connector_extra_config")
        try:
            config = KVTierConfig.from_dict(extra if isinstance(extra, dict) else {})
        except ConfigError:
            continue
        node = node_settings(config)
        store = open_blobs(config, deadline_s) if node.node_gib > 0 and NODE_TIER in config.tiers else None
        if store is None:
            continue
        try:
            reply = store.client.call(protocol.Stats())[0]
        except (NodeUnavailable, OSError):  # an owner that does not answer is the probe's to report
            continue
        finally:
            store.close()
        if not isinstance(reply, protocol.StatsReply):
            continue
        said = node.node_gib * GiB
        if abs(reply.capacity_bytes - said) > NODE_SIZE_TOLERANCE * max(said, reply.capacity_bytes):
            out.append(Problem("warning", f"{prefix}kv_connector_extra_config.node_gib",
                               f"node_gib={node.node_gib:g} but the pool at {node.node_socket} holds "
                               f"{reply.capacity_bytes / GiB:.3g} GiB (its owner's --node-gib); set node_gib to the "
                               "owner's --node-gib, which kvtier size, check and audit go by"))
    return out


def on_tmpfs(path: Path) -> bool:
    while not path.exists():
        path = path.parent
    mount = mount_of(path)
    return mount is not None and mount[0] in ("tmpfs", "ramfs")
