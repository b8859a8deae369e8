"""Policies registered by name, imported lazily so optional policies cost nothing until used.

Names: ``lru`` (prompt-order LRU), ``lru-tail`` (tail-first LRU, vLLM's block-pool order),
``prefix-lru`` (least recently used leaf first, as radix-tree caches do), ``s3fifo`` (S3-FIFO,
Yang et al., SOSP'23), ``prefix-freq`` (leaves first, frequency-ranked, adaptive quarantine of
never-reused chunks), ``adaptive`` (kvtier's own: leaves first, and the ordering — LRU,
quarantine, or bimodal insertion — that sampled shadow replays say hits most on recent traffic)
and ``default`` (kvtier's default policy, ``adaptive``).
More policies register themselves here by adding to ``_REGISTRY`` a ``"module:Class"`` path.
"""

from __future__ import annotations

import importlib

from kvtier.core.policies.base import EvictionPolicy

_REGISTRY: dict[str, str] = {
    "lru": "kvtier.core.policies.lru:LRUPolicy",
    "lru-tail": "kvtier.core.policies.lru:TailFirstLRUPolicy",
    "prefix-lru": "kvtier.core.policies.prefix_lru:PrefixAwareLRUPolicy",
    "prefix-freq": "kvtier.core.policies.prefix_freq:PrefixFrequencyPolicy",
    "adaptive": "kvtier.core.policies.adaptive:AdaptivePolicy",
    "adaptive-unguarded": "kvtier.core.policies.unguarded:UnguardedAdaptivePolicy",
    "s3fifo": "kvtier.core.policies.s3fifo:S3FIFOPolicy",
}

DEFAULT_POLICY = "adaptive"
"""The policy ``default`` resolves to (chosen from simulator results, see docs/simulate.md)."""


def available_policies() -> list[str]:
    """Names accepted by :func:`make_policy` (including ``default``)."""
    return sorted(_REGISTRY) + ["default"]


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy object by name.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    resolved = DEFAULT_POLICY if name == "default" else name
    path = _REGISTRY.get(resolved)
    if path is None:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(available_policies())}")
    module_name, cls_name = path.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    policy: EvictionPolicy = cls()
    return policy
