"""The arms ``kvtier bench compare`` can run: one vLLM server configuration each.

* ``baseline``: no KV connector; the engine's own prefix cache only.
* ``kvtier``: kvtier's ``KVTierConnector`` (module ``kvtier.integrations.vllm``) with its default
  configuration, or the ``kv_connector_extra_config`` the caller gives.
* ``kvtier-redis``: the ``kvtier`` arm plus kvtier's shared ``redis`` tier (``redis_url``: the
  server ``bench compare --redis`` names or starts); with ``--replicas N`` its N servers share it.
* ``kvtier-s3``: the ``kvtier`` arm plus kvtier's shared ``s3`` tier on a private ``rclone serve
  s3`` the comparison starts (:mod:`kvtier.bench.shared_s3`); with ``--replicas N`` its N servers
  share one bucket and key prefix.
* ``kvtier-node``: the ``kvtier`` arm plus kvtier's ``node`` tier on a pool owner (``kvtier node
  serve``) the comparison starts for every run (:mod:`kvtier.bench.shared_node`); with
  ``--replicas N`` its N servers share the one pool, as the engines of one host would.
* ``native``: vLLM's own ``OffloadingConnector`` with its CPU tier (``CPUOffloadingSpec``,
  vllm/v1/kv_offload/cpu/spec.py), sized like kvtier's cpu tier.  On a CPU-only vLLM it is loaded
  through :mod:`kvtier.bench.native_cpu`, a benchmark-only module that swaps the CUDA copy
  pieces for host copies (reports say so); on CUDA vLLM's class runs as it is.
* ``example``: vLLM's bundled ``ExampleConnector`` (vllm/distributed/kv_transfer/kv_connector/v1/
  example_connector.py), which saves every request's KV as safetensors files under
  ``shared_storage_path`` and loads them back on a prefix match.
* any other connector: ``--arm NAME=KV_TRANSFER_CONFIG_JSON`` (:func:`parse_custom_arm`).

Every arm gets the same model, engine cache size, core pinning and workload; only
``kv_transfer_config`` differs.  kvtier's ``disk_path`` is a host's own: with several replicas
each server gets a directory of its own (:func:`kvtier.bench.replicas.replica_specs`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARM_NAMES = ("baseline", "kvtier", "kvtier-redis", "kvtier-s3", "kvtier-node", "native", "example")
SHARED_TIER_KEYS = {"kvtier-redis": "redis_url", "kvtier-s3": "s3_bucket", "kvtier-node": "node_socket"}
"""The arms that add a shared tier, and the configuration key that asks for it (the tier's name is
read from its registry record, :func:`shared_tier_of`)."""
BASELINE = "baseline"
NATIVE_SHIM_LABEL = "vLLM OffloadingConnector via kvtier's CPU shim (benchmark-only host copies)"


@dataclass(frozen=True)
class ArmSpec:
    """One arm: its name, the ``--kv-transfer-config`` it adds (``None`` = none) and a description."""

    name: str
    kv_transfer_config: dict[str, Any] | None
    description: str

    @property
    def disk_path(self) -> str | None:
        """The directory the arm's connector writes to, if its config names one (kvtier's
        ``disk_path``, ExampleConnector's ``shared_storage_path``)."""
        extra = (self.kv_transfer_config or {}).get("kv_connector_extra_config") or {}
        path = extra.get("disk_path") or extra.get("shared_storage_path")
        return str(path) if path else None


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def native_arm(cpu_gib: float, block_tokens: int | None = None) -> ArmSpec:
    """vLLM's ``OffloadingConnector`` with a CPU tier of ``cpu_gib`` GiB (``cpu_bytes_to_use``)
    and, if given, ``block_tokens`` tokens per offloaded block (its ``block_size`` key; default:
    the engine's block size)."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": int(cpu_gib * (1 << 30))}
    if block_tokens:
        extra["block_size"] = block_tokens
    config: dict[str, Any] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": extra}
    if _cuda_available():
        return ArmSpec("native", config, f"vLLM OffloadingConnector (CPU tier {cpu_gib:g} GiB)")
    config["kv_connector_module_path"] = "kvtier.bench.native_cpu"
    return ArmSpec("native", config, f"{NATIVE_SHIM_LABEL}, CPU tier {cpu_gib:g} GiB")


def _describe(kvtier_config: dict[str, Any]) -> str:
    """``key=value, ...`` for an arm's label (printed, and written into the reports): a redis_url's
    password and the shared_secret are never shown."""
    from kvtier.core.config import redact_url

    def shown(key: str, value: Any) -> Any:
        if key == "shared_secret":
            return "***"
        if key == "redis_url" and isinstance(value, str):
            return redact_url(value)
        return value

    return ", ".join(f"{k}={shown(k, v)}" for k, v in kvtier_config.items())


def shared_tier_of(arm_name: str) -> str | None:
    """The registered tier a ``kvtier-<shared>`` arm adds (the record whose ``keys`` hold the arm's
    key in :data:`SHARED_TIER_KEYS`), ``None`` for the other arms."""
    from kvtier.core.tiers.registry import specs

    key = SHARED_TIER_KEYS.get(arm_name)
    return next((s.name for s in specs() if key is not None and key in s.keys), None)


def shared_tier_conflict(arm_name: str, kvtier_config: dict[str, Any] | None) -> str | None:
    """Why ``kvtier_config`` (``--kvtier-config``) cannot run the ``arm_name`` arm, in one sentence,
    or ``None``: its ``tiers`` list leaves out the shared tier the arm exists to add (the tier would
    be skipped silently and the arm would measure local tiers only)."""
    tier = shared_tier_of(arm_name)
    tiers = (kvtier_config or {}).get("tiers")
    if tier is None or tiers is None or tier in tiers:
        return None
    return (f"the {arm_name} arm adds the {tier} tier, but --kvtier-config sets tiers to {list(tiers)}, which "
            f"leaves it out; add {tier!r} to tiers or drop the tiers key")


def make_arm(name: str, work_dir: Path, kvtier_config: dict[str, Any] | None = None,
             redis_url: str | None = None, s3_config: dict[str, Any] | None = None,
             node_config: dict[str, Any] | None = None) -> ArmSpec:
    """The arm called ``name``; files an arm writes (ExampleConnector's storage) go under ``work_dir``;
    ``redis_url`` is the shared server of the ``kvtier-redis`` arm, ``s3_config`` the s3 tier's
    keys of the ``kvtier-s3`` arm (:meth:`kvtier.bench.shared_s3.S3Target.extra_config`: endpoint,
    bucket, credentials file; they replace any from ``kvtier_config``), ``node_config`` the node
    tier's keys of the ``kvtier-node`` arm (:meth:`kvtier.bench.shared_node.NodePool.extra_config`).

    Raises:
        ValueError: ``name`` is not one of :data:`ARM_NAMES`, ``kvtier-redis`` without ``redis_url``,
            ``kvtier-s3`` without ``s3_config`` or ``kvtier-node`` without ``node_config``.
    """
    if name == "kvtier-node":
        if not node_config or not node_config.get("node_socket"):
            raise ValueError("the kvtier-node arm needs the pool bench compare starts for it "
                             "(kvtier.bench.shared_node.NodePool)")
        base = make_arm("kvtier", work_dir, {**(kvtier_config or {}), **node_config})
        what = _describe({k: v for k, v in (kvtier_config or {}).items() if k not in node_config})
        return ArmSpec(name, base.kv_transfer_config,
                       f"KVTierConnector ({what + ', ' if what else ''}shared node tier: a "
                       f"{node_config.get('node_gib', 0):g} GiB pool at {node_config['node_socket']})")
    if name == "kvtier-s3":
        if not s3_config or not s3_config.get("s3_bucket"):
            raise ValueError("the kvtier-s3 arm needs the S3 server bench compare starts for it "
                             "(kvtier.bench.shared_s3.LocalS3)")
        base = make_arm("kvtier", work_dir, {**(kvtier_config or {}), **s3_config})
        # the arm's server replaces the config's: only the one in use is named (no credential is a key)
        what = _describe({k: v for k, v in (kvtier_config or {}).items() if k not in s3_config})
        where = f"{s3_config.get('s3_endpoint_url', 'AWS S3')}, bucket {s3_config['s3_bucket']}"
        return ArmSpec(name, base.kv_transfer_config,
                       f"KVTierConnector ({what + ', ' if what else ''}shared s3 tier on rclone serve s3 at {where})")
    if name == "kvtier-redis":
        if not redis_url:
            raise ValueError("the kvtier-redis arm needs --redis: 'auto' (a private redis-server on 127.0.0.1) "
                             "or the redis:// URL of a running server")
        from kvtier.core.config import redact_url

        base = make_arm("kvtier", work_dir, {**(kvtier_config or {}), "redis_url": redis_url})
        # the arm's redis_url replaces one from --kvtier-config: only the one in use is named
        what = _describe({k: v for k, v in (kvtier_config or {}).items() if k != "redis_url"})
        return ArmSpec(name, base.kv_transfer_config,
                       f"KVTierConnector ({what + ', ' if what else ''}shared redis tier at {redact_url(redis_url)})")
    if name == "baseline":
        return ArmSpec(name, None, "no connector: the engine's own prefix cache")
    if name == "kvtier":
        config: dict[str, Any] = {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                                  "kv_connector_module_path": "kvtier.integrations.vllm",
                                  "kv_load_failure_policy": "recompute"}
        if kvtier_config:
            config["kv_connector_extra_config"] = dict(kvtier_config)
        what = "default config" if not kvtier_config else _describe(kvtier_config)
        return ArmSpec(name, config, f"KVTierConnector ({what})")
    if name == "native":  # the same CPU tier as the kvtier arm (its default when not set)
        from kvtier.core.config import KVTierConfig

        return native_arm(float((kvtier_config or {}).get("cpu_gib", KVTierConfig().cpu_gib)))
    if name == "example":
        storage = work_dir / "example-connector-storage"
        return ArmSpec(name, {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"shared_storage_path": str(storage)}},
                       f"vLLM ExampleConnector (safetensors files under {storage})")
    raise ValueError(f"unknown arm {name!r}; choose from {', '.join(ARM_NAMES)}")


def parse_custom_arm(text: str) -> ArmSpec:
    """An arm from ``NAME=KV_TRANSFER_CONFIG_JSON`` (the ``--arm`` option).

    Raises:
        ValueError: no ``=``, a name that is not ``[A-Za-z0-9_-]+`` or is ``baseline``, JSON that
            is not an object with a ``kv_connector`` string.
    """
    name, sep, body = text.partition("=")
    name = name.strip()
    if not sep or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"--arm {text[:60]!r} must be NAME=KV_TRANSFER_CONFIG_JSON with NAME of letters, digits, "
                         "'-' or '_'")
    if name == BASELINE:
        raise ValueError("--arm cannot be named baseline (that arm has no connector); pick another name")
    try:
        config = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--arm {name}: the config is not valid JSON ({exc.msg} at character {exc.pos}); "
                         "quote it in single quotes") from None
    if not isinstance(config, dict) or not isinstance(config.get("kv_connector"), str):
        raise ValueError(  # noqa: TRY004 - bad user input, reported as such
            f"--arm {name}: the config must be a JSON object with a \"kv_connector\" name, as vLLM's "
                         "--kv-transfer-config")
    config.setdefault("kv_role", "kv_both")
    return ArmSpec(name, config, f"{config['kv_connector']} (--arm)")
