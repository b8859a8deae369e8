"""kvtier's vLLM integration: :class:`KVTierConnector`, a vLLM v1 KV connector.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_gib": 4, "disk_path": "/nvme/kvtier", "disk_gib": 100}}'

The connector class is imported lazily (PEP 562 ``__getattr__``) so that helpers of this package,
such as :mod:`kvtier.integrations.vllm.testmodel`, do not import vLLM and torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.integrations.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
