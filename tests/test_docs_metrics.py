"""The metrics the operator pages send a vLLM operator to are in vLLM's ``/metrics``.

Inside vLLM, kvtier's series are the ones :mod:`kvtier.integrations.vllm.stats_table` declares to
vLLM's connector-metrics hooks (its counters and gauges, the ghost-distance histogram and the
per-tenant gauge); the store's own registry (``kvtier_tier_*``, ``kvtier_config_info``, …) exists only
where a store is embedded directly.  A page that names a series from that registry where an operator
reads ``/metrics`` sends them looking for a name that is not there (receipts.md named
``kvtier_tier_call_seconds`` for a shared tier's latency).  Checked: every ``kvtier_*`` name on
doctor.md and receipts.md (both read a live server), and every name in the first column of
vllm.md's "Which metrics prove it is helping" table."""

from __future__ import annotations

import re
from pathlib import Path

from kvtier.integrations.vllm import stats_table

DOCS = Path(__file__).resolve().parents[1] / "docs"
TIERS = ("cpu", "disk", "node", "redis", "s3")


def exported() -> set[str]:
    """The ``kvtier_*`` series names vLLM's ``/metrics`` carries (counters without ``_total``)."""
    names = {spec[0] for spec in stats_table.counters().values()} | {spec[0] for spec in stats_table.gauges().values()}
    names |= {stats_table.GHOST_DISTANCE, stats_table.TENANT_GAUGE}
    return {re.sub(r"_total$", "", name) for name in names}


def in_metrics(name: str, names: set[str]) -> bool:
    """Whether a name as a page writes it (``kvtier_<tier>_x_total``, ``kvtier_*_x``, ``_bucket``) is exported."""
    base = re.sub(r"_(total|bucket|count|sum)$", "", name)
    if "<tier>" in base or "*" in base:
        pattern = re.escape(base).replace(re.escape("<tier>"), "(" + "|".join(TIERS) + ")").replace(r"\*", "[a-z0-9_]+")
        return any(re.fullmatch(pattern, n) for n in names)
    return base in names


def metric_names(text: str) -> set[str]:
    return set(re.findall(r"`(kvtier_[a-z0-9_<>*]*[a-z0-9>*])", text)) - {"kvtier_pin_s"}  # a request parameter


def operator_pages() -> dict[str, set[str]]:
    vllm = (DOCS / "vllm.md").read_text()
    table = vllm[vllm.index("## Which metrics prove it is helping"):vllm.index("## How it works")]
    first_cells = "\n".join(line.split("|")[1] for line in table.splitlines() if line.startswith("| `"))
    return {"doctor.md": metric_names((DOCS / "doctor.md").read_text()),
            "receipts.md": metric_names((DOCS / "receipts.md").read_text()),
            "vllm.md metrics table": metric_names(first_cells)}


def test_every_metric_the_operator_pages_name_is_in_vllms_metrics():
    names = exported()
    pages = operator_pages()
    assert sum(len(found) for found in pages.values()) > 40  # the pattern still finds the names
    missing = {page: sorted(n for n in found if not in_metrics(n, names)) for page, found in pages.items()}
    assert not any(missing.values()), missing


def test_the_matching_tells_a_missing_name():
    names = exported()
    assert in_metrics("kvtier_<tier>_read_seconds_total", names) and in_metrics("kvtier_loaded_tokens_total", names)
    assert not in_metrics("kvtier_tier_call_seconds", names) and not in_metrics("kvtier_config_info", names)
