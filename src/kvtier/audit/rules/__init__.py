"""All audit rules.  Importing this package registers every rule module, in a stable order."""

from kvtier.audit.rules import bugs, gates, hybrid, kvtier_connector, lmcache, pitfalls, tuning  # noqa: F401
from kvtier.audit.rules.base import GUIDE, HOWTO, RULES, Rule, rule

__all__ = ["GUIDE", "HOWTO", "RULES", "Rule", "rule"]
