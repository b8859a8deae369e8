"""Run every rule over every configured server; order findings by severity, then rule order."""

from __future__ import annotations

from kvtier.audit.model import SEVERITIES, Finding, ServeConfig
from kvtier.audit.rules import RULES


def audit(configs: list[ServeConfig]) -> list[Finding]:
    """Findings of all rules over ``configs`` (errors first; stable within a severity)."""
    found = [f for config in configs for r in RULES if (f := r.apply(config)) is not None]
    return sorted(found, key=lambda f: SEVERITIES.index(f.severity))


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)
