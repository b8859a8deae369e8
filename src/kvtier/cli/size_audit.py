"""``kvtier size``'s recipes under ``kvtier audit``: the audit's own rules, run on every line size prints.

Size and audit share the hierarchy model (:mod:`kvtier.simulate.hierarchy`), but a recipe is also judged
by the audit's version gates; rather than restate those rules here, size runs the audit on each recipe
for every vLLM release kvtier supports (:data:`kvtier.integrations.vllm.compat.CHECKED_RELEASES`) and
prints what it would warn about as a note, so a recipe is never silently one the audit flags.  An
error on the kvtier config (the connector or vLLM would not start) is no note: size refuses to print
the recipe (:func:`refusal`, docs/size.md § Errors).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.audit.model import Finding
    from kvtier.size.recipe import Recipe

KVTIER = "kvtier"
"""The title of the kvtier connector's config among a recipe's dialects."""

_SIZE_FIXES = {
    "kvtier-cpu-tier-below-one-chunk": "Give a larger --offload-gib (room for hundreds of chunks) or a shorter "
                                       "--chunk-tokens (default 128).",
    "kvtier-chunk-tokens-below-state-block": "Leave --chunk-tokens out: the recipe then says chunk_tokens auto, "
                                             "which the connector makes a multiple of every block size, the state "
                                             "block's included.",
}
"""What to change in ``kvtier size``'s own flags for an audit error on its kvtier config, by rule; a rule
not here is fixed as the audit says (its fix names the config's keys)."""


@dataclass
class AuditNote:
    """One rule the audit raises on one dialect of a recipe, on the releases ``versions``."""

    title: str  # the dialect: kvtier, vLLM native or LMCache
    rule: str
    error: bool  # the audit refuses the config (the engine would not start), not only warns
    message: str
    fix: str
    versions: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The note size prints: the releases, warns on / refuses, the dialect, the rule and its message."""
        return (f"kvtier audit --vllm-version {'/'.join(self.versions)} {'refuses' if self.error else 'warns on'} "
                f"the {self.title} config ({self.rule}): {self.message} Fix: {self.fix}")


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


def recipe_audit(recipe: Recipe, gpu: str | None, said: Collection[str] = ()) -> list[AuditNote]:
    """One :class:`AuditNote` per rule the audit would raise on a recipe of ``recipe`` (kvtier, vLLM
    native, LMCache) on any supported release; [] when all are clean.  Rules in ``said`` are left out
    (a note of size's own states them already)."""
    from kvtier.integrations.vllm.compat import CHECKED_RELEASES

    notes: dict[tuple[str, str], AuditNote] = {}
    for title, text in ((KVTIER, recipe.kvtier), ("vLLM native", recipe.vllm_native), ("LMCache", recipe.lmcache)):
        if "vllm serve" not in text:
            continue
        for release in CHECKED_RELEASES:
            for finding in recipe_findings(text, gpu, release.version):
                if finding.rule in said:
                    continue
                note = notes.setdefault((title, finding.rule), AuditNote(title, finding.rule, False, "", ""))
                note.versions.append(release.version)
                note.message, note.fix = finding.message, finding.fix
                note.error = note.error or finding.severity == "error"
    return list(notes.values())


def refusal(notes: list[AuditNote]) -> str | None:
    """The one sentence ``kvtier size`` exits 2 with when the audit refuses the kvtier config of its recipe
    (an error: the connector or vLLM would not start with it): the releases, the rule, the audit's
    message and what to change (in size's flags where :data:`_SIZE_FIXES` knows them, else the audit's
    fix); None when the kvtier config has no error."""
    refused = [n for n in notes if n.title == KVTIER and n.error]
    if not refused:
        return None
    first = refused[0]
    more = f" (and {len(refused) - 1} more: {', '.join(n.rule for n in refused[1:])})" if len(refused) > 1 else ""
    return (f"kvtier audit --vllm-version {'/'.join(first.versions)} refuses the kvtier config this would print "
            f"({first.rule}{more}), so no recipe is printed: {first.message} Fix: "
            f"{_SIZE_FIXES.get(first.rule, first.fix)}")
