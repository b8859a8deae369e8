"""``kvtier doctor --from-files`` reads every valid exposition of one recording the same (through
the real CLI): Prometheus text with HELP/TYPE lines (vLLM's /metrics), the same samples without
them, and OpenMetrics text written by prometheus_client's own OpenMetrics exposition."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

DATA = Path(__file__).parent / "data" / "kvtier-cpu"
SRC = str(Path(__file__).resolve().parents[2] / "src")


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "doctor", *args], capture_output=True, text=True,
                          check=False, timeout=120, env=env)


class _Recorded:
    """A collector that gives back the families of a recorded page (prometheus_client's parser)."""

    def __init__(self, text: str) -> None:
        # a counter's _created is its own gauge family to the text parser; OpenMetrics writes it
        # inside the counter, so the gauges are left out (a name may be one family only)
        self.families = [f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")]

    def collect(self):  # type: ignore[no-untyped-def]
        return self.families


def openmetrics(text: str) -> str:
    """``text`` (Prometheus text) as prometheus_client writes it in OpenMetrics (names kept UTF-8: vLLM's ``:``)."""
    registry = CollectorRegistry()
    registry.register(_Recorded(text))
    out = generate_latest(registry, escaping="allow-utf-8", version="2.0.0").decode()
    assert out.rstrip().endswith("# EOF") and list(openmetrics_families(out))  # valid OpenMetrics
    return out


def report(before: Path, after: Path) -> dict:
    proc = doctor("--from-files", str(before), str(after), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout)
    figures.pop("url")
    return figures


def test_samples_without_help_and_type_lines_and_openmetrics_read_as_vllms_own_page(tmp_path):
    """The fresh-user tester's recordings (``grep -v '^#'``; an OpenMetrics page) were refused with
    "no vllm:prefix_cache_queries samples"; each now gives the very figures of vLLM's typed page."""
    typed = report(DATA / "before.txt", DATA / "after.txt")
    assert typed["external_hit_rate"] > 0.5 and typed["tiers"]  # the recording reused tokens: a real figure to compare
    for name, convert in (("untyped", lambda t: "".join(line + "\n" for line in t.splitlines()
                                                        if not line.startswith("#"))),
                          ("openmetrics", openmetrics)):
        for which in ("before", "after"):
            (tmp_path / f"{name}-{which}.txt").write_text(convert((DATA / f"{which}.txt").read_text()))
        assert report(tmp_path / f"{name}-before.txt", tmp_path / f"{name}-after.txt") == typed, name


def test_the_users_minimal_openmetrics_counter_is_read(tmp_path):
    """``# TYPE vllm:prefix_cache_queries counter`` with a ``_total`` sample, ending ``# EOF``."""
    for which, queries, hits in (("before", 5.0, 0.0), ("after", 1005.0, 400.0)):
        (tmp_path / which).write_text(
            "# TYPE vllm:prefix_cache_queries counter\n"
            f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            f'vllm:prefix_cache_hits_total{{engine="0"}} {hits}\n'
            "# EOF\n")
    proc = doctor("--from-files", str(tmp_path / "before"), str(tmp_path / "after"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"prefix-cache hit rate\s+40\.0%\s+\(400 / 1,000 tokens", proc.stdout), proc.stdout


def test_a_recording_without_the_counter_names_the_file_and_how_to_record_one(tmp_path):
    """--from-files has no --url to point at: the sentence names the file and what it lacks."""
    (tmp_path / "b.txt").write_text("# TYPE up gauge\nup 1.0\n")
    proc = doctor("--from-files", str(tmp_path / "b.txt"), str(DATA / "after.txt"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"error: {tmp_path / 'b.txt'} has no vllm:prefix_cache_queries samples (vLLM's "
                                   "counter vllm:prefix_cache_queries_total), so it is not a vLLM /metrics page; "
                                   "record it from a vLLM server with curl -s http://HOST:PORT/metrics > FILE.")
    assert "--url" not in proc.stderr
