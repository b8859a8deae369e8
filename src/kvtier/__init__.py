"""kvtier: a tiered KV cache for LLM serving.

Packages:
  - ``kvtier.core``: engine-independent heart (keys, tiers, policies, store, config, metrics).
    Nothing under it imports vLLM or torch.
  - ``kvtier.integrations.vllm``: the ``KVTierConnector`` for ``--kv-transfer-config``.
  - operator tools: ``kvtier.bench``, ``kvtier.simulate``, ``kvtier.size``, ``kvtier.audit``,
    ``kvtier.doctor``, wired into one Typer app in ``kvtier.cli``.
"""

__version__ = "0.1.0"
