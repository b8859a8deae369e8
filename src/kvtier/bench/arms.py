"""The arms ``kvtier bench compare`` can run: one vLLM server configuration each.

* ``baseline``: no KV connector; the engine's own prefix cache only.
* ``kvtier``: kvtier's ``KVTierConnector`` (module ``kvtier.integrations.vllm``) with its default
  configuration, or the ``kv_connector_extra_config`` the caller gives.
* ``example``: vLLM's bundled ``ExampleConnector`` (vllm/distributed/kv_transfer/kv_connector/v1/
  example_connector.py), which saves every request's KV as safetensors files under
  ``shared_storage_path`` and loads them back on a prefix match; the only other storage
  connector that runs on a CPU-only vLLM.

Every arm gets the same model, engine cache size and workload; only ``kv_transfer_config`` differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARM_NAMES = ("baseline", "kvtier", "example")
BASELINE = "baseline"


@dataclass(frozen=True)
class ArmSpec:
    """One arm: its name, the ``--kv-transfer-config`` it adds (``None`` = none) and a description."""

    name: str
    kv_transfer_config: dict[str, Any] | None
    description: str


def make_arm(name: str, work_dir: Path, kvtier_config: dict[str, Any] | None = None) -> ArmSpec:
    """The arm called ``name``; files an arm writes (ExampleConnector's storage) go under ``work_dir``.

    Raises:
        ValueError: ``name`` is not one of :data:`ARM_NAMES`.
    """
    if name == "baseline":
        return ArmSpec(name, None, "no connector: the engine's own prefix cache")
    if name == "kvtier":
        config: dict[str, Any] = {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                                  "kv_connector_module_path": "kvtier.integrations.vllm"}
        if kvtier_config:
            config["kv_connector_extra_config"] = dict(kvtier_config)
        what = "default config" if not kvtier_config else ", ".join(f"{k}={v}" for k, v in kvtier_config.items())
        return ArmSpec(name, config, f"KVTierConnector ({what})")
    if name == "example":
        storage = work_dir / "example-connector-storage"
        return ArmSpec(name, {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"shared_storage_path": str(storage)}},
                       f"vLLM ExampleConnector (safetensors files under {storage})")
    raise ValueError(f"unknown arm {name!r}; choose from {', '.join(ARM_NAMES)}")
