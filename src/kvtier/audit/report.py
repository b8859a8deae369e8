"""Audit output: rich text, JSON (``{"findings": [...]}``) and SARIF 2.1.0 for code scanning.

SARIF follows the OASIS SARIF 2.1.0 schema: one run, ``tool.driver.rules`` listing every rule
(id, short/full description, help text = fix, default level), and one result per finding with
``ruleId``, ``level`` (error / warning / note) and, when the line is known, a physical location.
"""

from __future__ import annotations

import json
from typing import Any

from kvtier.audit.model import Finding
from kvtier.audit.rules import RULES

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_LEVEL = {"error": "error", "warning": "warning", "info": "note"}


def to_json(findings: list[Finding]) -> str:
    return json.dumps({"findings": [f.to_json() for f in findings]}, indent=2, ensure_ascii=False)


def to_sarif(findings: list[Finding], artifact: str) -> str:
    """SARIF 2.1.0 log; ``artifact`` is the audited file's path as the repository knows it."""
    from kvtier import __version__

    rules = [{
        "id": r.id,
        "name": r.id,
        "shortDescription": {"text": r.title},
        "fullDescription": {"text": f"{r.title}. Source: {r.source}"},
        "help": {"text": r.fix},
        "defaultConfiguration": {"level": _LEVEL[r.severity]},
        "properties": {"source": r.source},
    } for r in RULES]
    index = {r.id: i for i, r in enumerate(RULES)}
    results: list[dict[str, Any]] = []
    for f in findings:
        location: dict[str, Any] = {"artifactLocation": {"uri": artifact}}
        if f.line is not None:
            location["region"] = {"startLine": f.line}
        results.append({
            "ruleId": f.rule,
            "ruleIndex": index[f.rule],
            "level": _LEVEL[f.severity],
            "message": {"text": f"{f.message} Fix: {f.fix}"},
            "locations": [{"physicalLocation": location}],
            "properties": {"source": f.source, "origin": f.origin},
        })
    log = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "kvtier audit", "version": __version__, "rules": rules}},
            "results": results,
        }],
    }
    return json.dumps(log, indent=2, ensure_ascii=False)


def print_text(findings: list[Finding], origins: list[str]) -> None:
    """Findings as a readable list (severity, rule, where; then message, fix, source), or an all-clear."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    if not findings:
        console.print(f"[green]No findings[/green] in {escape(', '.join(origins))} ({len(RULES)} rules checked).")
        return
    style = {"error": "bold red", "warning": "yellow", "info": "cyan"}
    for f in findings:
        where = f"{f.origin}:{f.line}" if f.line else f.origin
        console.print(f"[{style[f.severity]}]{f.severity:<7}[/] [bold]{f.rule}[/bold]  {escape(where)}")
        console.print(f"  {escape(f.message)}")
        console.print(f"  [green]fix:[/green] {escape(f.fix)}")
        console.print(f"  [dim]source: {escape(f.source)}[/dim]")
    counts = {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")}
    console.print(f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info.")


def rules_markdown() -> str:
    """The rule table of docs/audit-rules.md, generated from the rule data."""
    lines = [
        "# kvtier audit rules",
        "",
        "Generated from the rule data by `kvtier audit --rules-markdown`; do not edit by hand",
        "(`tests/audit/test_cli_audit.py` fails when this file and the rules disagree).",
        "",
        f"{len(RULES)} rules. Severity `error` makes `kvtier audit` exit non-zero.",
        "",
        "| rule | severity | what it catches | fix | source |",
        "|---|---|---|---|---|",
    ]
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")
    for r in RULES:
        lines.append(f"| `{r.id}` | {r.severity} | {cell(r.title)} | {cell(r.fix)} | {cell(r.source)} |")
    return "\n".join(lines) + "\n"
