"""Rules as data: id, severity, title, fix, source, plus one small predicate.

A predicate takes a :class:`~kvtier.audit.model.ServeConfig` and returns the finding's message
(one sentence about this config) or None when the rule does not apply.  ``locate`` names the flag
or environment variable that the finding points at, so SARIF can mark its line.  Rules are
registered by the :func:`rule` decorator in the module that defines them; :data:`RULES` keeps the
order of definition and rejects duplicate ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.audit.model import Finding, ServeConfig, Severity

Predicate = Callable[[ServeConfig], "str | None"]


@dataclass(frozen=True)
class Rule:
    """One audit rule.  ``source`` cites where the rule comes from in a form a user can open: a vLLM or
    LMCache PR/issue number (``vllm-project/vllm#41847``), a release note, a CVE id, or a file path
    in vLLM's source or kvtier's docs (checked by tests/audit/test_rules.py)."""

    id: str
    severity: Severity
    title: str
    fix: str
    source: str
    check: Predicate
    locate: str | None = None

    def apply(self, config: ServeConfig) -> Finding | None:
        message = self.check(config)
        if message is None:
            return None
        line = config.line_of(self.locate) if self.locate else None
        return Finding(self.id, self.severity, message, self.fix, self.source, config.origin, line)


RULES: list[Rule] = []


def rule(id: str, severity: Severity, title: str, fix: str, source: str,
         locate: str | None = None) -> Callable[[Predicate], Predicate]:
    """Register the decorated predicate as rule ``id``."""

    def register(check: Predicate) -> Predicate:
        if any(r.id == id for r in RULES):
            raise ValueError(f"duplicate audit rule id {id}")
        RULES.append(Rule(id, severity, title, fix, source, check, locate))
        return check

    return register
