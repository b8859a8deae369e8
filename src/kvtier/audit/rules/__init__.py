"""All audit rules.  Importing this package registers every rule module, in the order below
(version gates first, then flag pitfalls, values vLLM or LMCache refuse, flags and values vLLM's parser refuses, hybrid/HMA, LMCache, upstream bugs, tuning, kvtier, its shared tier, its deployment, its node pool, tiers that serve nothing)."""

import importlib

from kvtier.audit.rules.base import RULES, Rule, rule

MODULES = ("gates", "releases", "pitfalls", "values", "flags", "hybrid", "lmcache", "bugs", "tuning", "kvtier_connector", "shared_tier",
           "deploy", "node_pool", "tiers")
for _name in MODULES:
    importlib.import_module(f"kvtier.audit.rules.{_name}")

__all__ = ["MODULES", "RULES", "Rule", "rule"]
