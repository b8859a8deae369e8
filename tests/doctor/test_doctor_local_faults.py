"""kvtier doctor when the disk tier's writes fail (a full filesystem): the verdict is not healthy.

The fault series are made by the real pieces: a worker rank's store whose disk tier sits on a real
8 MiB tmpfs that is then filled, its step counters exported through the connector's
:class:`KVTierPromMetrics` (what vLLM's ``/metrics`` serves), added to the /metrics texts recorded
from a real vLLM server (tests/doctor/data/kvtier-cpu) in place of their own fault lines.
"""

from __future__ import annotations

import functools
import shutil
import types

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtier.doctor import diagnose, measure, parse_metrics
from kvtier.doctor.faults import FaultSeries, LocalFaults, fault_checks, faults_between
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats, store_counters, store_gauges
from tests.core.helpers import break_disk_shards, chain_of, make_store, payload
from tests.core.test_disk_tier import fill, small_filesystem  # noqa: F401 (a fixture)

from .test_doctor import AFTER, BEFORE, run

FAULT_FAMILIES = ("kvtier_dropped_saves", "kvtier_corrupt_chunks", "kvtier_disk_write_errors")


class Exporter:
    """One rank's store as /metrics shows it (its fault lines only)."""

    def __init__(self, store) -> None:
        self.store = store
        self.registry = CollectorRegistry()
        types_ = {cls: functools.partial(cls, registry=self.registry) for cls in (Counter, Gauge, Histogram)}
        self.prom = KVTierPromMetrics(types.SimpleNamespace(kv_transfer_config=None), types_,  # type: ignore[arg-type]
                                      ["model_name", "engine"], {0: ["tiny", "0"]})
        self._seen = None

    def scrape(self, recorded: str) -> str:
        snapshot = self.store.stats()
        counters = store_counters(snapshot, self._seen)
        self._seen = snapshot
        self.prom.observe(KVTierStats(data={"counters": counters, "gauges": store_gauges(snapshot)}).data, 0)
        ours = [line for line in generate_latest(self.registry).decode().splitlines()
                if any(name in line for name in FAULT_FAMILIES)]
        theirs = [line for line in recorded.splitlines() if not any(name in line for name in FAULT_FAMILIES)]
        return "\n".join(theirs + ours) + "\n"


def test_doctor_says_problem_when_every_disk_write_fails_on_a_full_filesystem(small_filesystem):  # noqa: F811
    store = make_store(small_filesystem, cpu_chunks=64, disk_chunks=32, write_mode="write-through")
    exporter = Exporter(store)
    try:
        before = exporter.scrape(BEFORE)
        filler = fill(small_filesystem, 0)  # the disk is full: every chunk write fails (ENOSPC)
        chain = chain_of(7, 6)
        store.put(chain, [payload(k) for k in chain])
        store.flush(10)
        failed = store.stats().tier("disk").write_errors
        assert failed == 6
        after = exporter.scrape(AFTER)
        meters, _alloc, diagnosis = run(before, after)
        assert meters.faults is not None and meters.faults.write_errors == {"disk": 6}
        assert diagnosis.verdict == "problem"
        problem = next(c.message for c in diagnosis.checks if c.level == "problem")
        assert problem.startswith("Local tier (disk): 6 chunk writes failed between the scrapes (6 saves dropped)")
        assert "full or unwritable" in problem
        filler.unlink()
        # nothing failed between these two scrapes: the fault lines are gone (the recorded run is healthy)
        again = exporter.scrape(AFTER)
        healthy = diagnose(measure(parse_metrics(after, "a"), parse_metrics(again, "b"), 10.0), run(before, after)[1],
                           {}, None, 1)
        assert not any("Local tier" in c.message or "Saves:" in c.message for c in healthy.checks)
    finally:
        store.close()


def test_corrupt_chunks_are_a_warning_and_dropped_saves_alone_name_the_queue():
    before = FaultSeries({"disk": 3.0}, dropped_saves=3.0, corrupt_chunks=0.0, present=True)
    after = FaultSeries({"disk": 3.0}, dropped_saves=10.0, corrupt_chunks=2.0, present=True)
    faults = faults_between(before, after)
    assert faults == LocalFaults({}, 7.0, 2.0)
    checks = fault_checks(faults)
    assert [level for level, _ in checks] == ["warning", "warning"]
    assert checks[0][1].startswith("Saves: 7 chunk saves dropped") and "Corrupt chunks: 2 chunks" in checks[1][1]
    assert faults_between(before, FaultSeries()) is None  # not kvtier: no line at all


def _doctor_on_broken_disk(tmp_path, breaks) -> tuple[object, list]:
    """Doctor between a scrape of a healthy write-through disk tier and one after ``breaks(store)``
    made its directory unwritable and 5 chunks were saved: its meters and checks."""
    store = make_store(tmp_path, cpu_chunks=64, disk_chunks=32, write_mode="write-through")
    exporter = Exporter(store)
    try:
        chain = chain_of(8, 3)
        store.put(chain, [payload(k) for k in chain])
        store.flush(10)
        before = exporter.scrape(BEFORE)
        chain = chain_of(9, 5)
        breaks(store, chain)
        store.put(chain, [payload(k) for k in chain])
        store.flush(10)
        meters, _alloc, diagnosis = run(before, exporter.scrape(AFTER))
        return meters, diagnosis.checks
    finally:
        store.close()


def test_unwritable_disk_directories_while_serving_are_a_problem_not_raise_cpu_gib(tmp_path):
    """Fault-injection finding: a disk tier whose directories cannot be written while serving; the
    dropped saves must be put down to the failed writes, never to the top tier's size."""
    meters, checks = _doctor_on_broken_disk(tmp_path, lambda store, chain: break_disk_shards(
        store.index.lower[0].tier, chain))  # a file stands where each chunk's shard directory was
    assert meters.faults is not None and meters.faults.write_errors == {"disk": 5} and meters.faults.dropped_saves == 5
    problem = [c.message for c in checks if c.level == "problem"]
    assert problem and problem[0].startswith("Local tier (disk): 5 chunk writes failed between the scrapes "
                                             "(5 saves dropped)")
    assert not any("raise cpu_gib" in c.message for c in checks)


def test_a_namespace_directory_replaced_by_a_file_while_serving_is_a_problem(tmp_path):
    """Fault-injection finding: ``disk_path/<namespace>`` replaced by a file while serving."""
    def replace_namespace(store, _chain) -> None:
        namespace = next(p for p in (tmp_path / "disk").iterdir() if p.is_dir())
        shutil.rmtree(namespace)
        namespace.write_text("not a directory")

    meters, checks = _doctor_on_broken_disk(tmp_path, replace_namespace)
    assert meters.faults is not None and meters.faults.dropped_saves == 5
    assert meters.faults.write_errors.get("disk", 0) > 0
    assert any(c.level == "problem" and c.message.startswith("Local tier (disk)") for c in checks)
    assert not any("raise cpu_gib" in c.message for c in checks)
