"""``kvtier size``'s recipes under ``kvtier audit``: the audit's own rules, run on every line size prints.

Size and audit share the hierarchy model (:mod:`kvtier.simulate.hierarchy`), but a recipe is also judged
by the audit's version gates; rather than restate those rules here, size runs the audit on each recipe
for every vLLM release kvtier supports (:data:`kvtier.integrations.vllm.compat.CHECKED_RELEASES`) and
prints what it would warn about as a note, so a recipe is never silently one the audit flags.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.audit.model import Finding
    from kvtier.size.recipe import Recipe


def recipe_findings(text: str, gpu: str | None, version: str) -> list[Finding]:
    """The warnings and errors ``kvtier audit - --gpu GPU --vllm-version VERSION`` gives on ``text``
    (one recipe: comment lines, ``export`` lines and one ``vllm serve`` line)."""
    from kvtier.audit.engine import audit
    from kvtier.audit.loader import load_configs
    from kvtier.audit.versions import parse_version

    configs = load_configs(text, "recipe", parse_version(version))
    for config in configs:
        config.gpu = gpu
    return [f for f in audit(configs) if f.severity in ("warning", "error")]


def audit_notes(recipe: Recipe, gpu: str | None, said: Collection[str] = ()) -> list[str]:
    """One note per rule the audit would raise on a recipe of ``recipe`` (kvtier, vLLM native, LMCache),
    naming the recipe, the releases, whether the audit warns on it or refuses it (an error), and the
    audit's message; [] when all are clean.  Rules in ``said`` are left out (a note of size's own
    states them already)."""
    from kvtier.integrations.vllm.compat import CHECKED_RELEASES

    seen: dict[tuple[str, str], list[str]] = {}
    messages: dict[tuple[str, str], str] = {}
    errors: set[tuple[str, str]] = set()  # rules the audit raises as errors (the engine would not start)
    for title, text in (("kvtier", recipe.kvtier), ("vLLM native", recipe.vllm_native), ("LMCache", recipe.lmcache)):
        if "vllm serve" not in text:
            continue
        for release in CHECKED_RELEASES:
            for finding in recipe_findings(text, gpu, release.version):
                if finding.rule in said:
                    continue
                key = (title, finding.rule)
                seen.setdefault(key, []).append(release.version)
                messages[key] = f"{finding.message} Fix: {finding.fix}"
                if finding.severity == "error":
                    errors.add(key)
    return [f"kvtier audit --vllm-version {'/'.join(versions)} "
            f"{'refuses' if (title, rule) in errors else 'warns on'} the {title} config ({rule}): {messages[title, rule]}"
            for (title, rule), versions in seen.items()]
