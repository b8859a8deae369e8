"""The shipped deployment files: the Kubernetes manifest passes ``kvtier audit`` and the Grafana
dashboard only queries metrics that vLLM or kvtier really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import vllm

from kvtier.audit.engine import audit
from kvtier.audit.loader import load_configs
from kvtier.audit.versions import parse_version

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "kubernetes" / "kvtier-shared-tier.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtier-vllm-dashboard.json"


def test_manifest_is_clean_for_kvtier_audit_and_the_redis_tier_is_protected():
    text = MANIFEST.read_text()
    configs = load_configs(text, str(MANIFEST), parse_version("0.32.0"))
    assert configs, "the audit found no vLLM serve line in the manifest"
    findings = audit(configs)
    assert [f for f in findings if f.severity in ("error", "warning")] == []
    # the same manifest with plain redis:// and no secret is warned about
    weak = text.replace("rediss://", "redis://").replace('"shared_secret_file":"/etc/kvtier/shared/secret"', '"cpu_gib":32')
    weak_rules = {f.rule for f in audit(load_configs(weak, "weak", parse_version("0.32.0")))}
    assert "kvtier-shared-tier-unprotected" in weak_rules


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:vllm:|kvtier_)[A-Za-z0-9_:]+)\{", expr))


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    names = {n for panel in dashboard["panels"] for t in panel["targets"] for n in _metric_names(t["expr"])}
    assert len(names) >= 10
    vllm_src = "\n".join(p.read_text(errors="ignore") for p in (Path(vllm.__file__).parent / "v1" / "metrics").glob("*.py"))
    from kvtier.integrations.vllm.stats import counters, gauges

    # kvtier's names follow the registered tiers (kvtier.core.tiers.registry): read from its tables
    kvtier_names = {prom for prom, _help, _label in (*counters().values(), *gauges().values())}
    for name in names:
        base = re.sub(r"_(total|bucket)$", "", name)
        exported = f'"{base}"' in vllm_src if name.startswith("vllm:") else base in kvtier_names
        assert exported, f"{name} is not exported by {'vLLM' if name.startswith('vllm:') else 'kvtier'}"
