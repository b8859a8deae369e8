"""Shared fixtures for the kvtier test suite.

Redis: one standalone server and one 3-master Cluster per test session, real ``redis-server``
processes on 127.0.0.1 (tests/redis_servers.py), stopped when the session ends.  Tests that fault
a server (kill, pause, restart) start their own with ``redis_factory``.

S3: one ``rclone serve s3`` per session (tests/s3_servers.py; each test makes its own bucket with
``s3_server.make_bucket()``); tests that fault the server start their own with ``s3_factory``.

Engines under pytest-xdist (``make test``'s second phase runs two at a time): each worker's
engines bind their one OpenMP compute thread to a core of their own (``VLLM_CPU_OMP_THREADS_BIND``
= the worker's index over this process's cores, set below) instead of vLLM's automatic choice,
which is the same first core for every engine: two engines beside each other then computed on one
core and left the other idle.  One thread each, so numerics are those of every other engine.

Engines without torch.compile (``TORCH_COMPILE_DISABLE=1``, set below for this process and
every process the tests start): vLLM's CPU engines run eager (the tests pass ``--enforce-eager``),
but a few helpers carry their own ``@torch.compile``: the logprob rank count
(vllm/v1/sample/ops/logprobs.py ``batched_count_greater_than``, run by every request that asks for
logprobs) and the tensor-parallel embedding mask (vllm/model_executor/layers/vocab_parallel_embedding.py
``get_masked_input_and_mask``).  Each worker process that ran one traced it with dynamo, loaded
inductor's kernel and probed the CPU's vector ISA with six ``python -c`` dlopen children (measured
2026-12-07: 205 such children in the second phase; test_vllm_processes.py's tensor-parallel test
33.5-34.5 CPU-s with them, 27.6-30.1 without).  Both compute integers (a count of logits above the
token's, a masked index), equal eager or compiled; every engine a test compares runs the same way.
Set ``TORCH_COMPILE_DISABLE=0`` in the environment to run the tests with them compiled.

Skips: a skip whose reason is not in :data:`EXPECTED_SKIPS` FAILS the test, so a check that stops
running on the CI machine (no network namespace, no O_DIRECT directory, no tmpfs mount, a missing
package) cannot pass CI silently.  On a development machine that lacks some of those, set
``KVTIER_ALLOW_SKIPS=1`` to let every skip through.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # see the module docstring: engines without torch.compile

from tests.node_servers import NodeServer
from tests.redis_servers import RedisClusterServers, RedisServer
from tests.s3_servers import S3Server


def _bind_this_workers_engines() -> None:
    """Under xdist, pin this worker's engines to core ``index mod cores`` (see the module docstring)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(worker[2:]) % len(cores)])


_bind_this_workers_engines()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start private redis-servers for one test (stopped afterwards, whatever the test did to them)."""
    started: list[RedisServer] = []

    def start(**kwargs: object) -> RedisServer:
        server = RedisServer(tmp_path / f"srv{len(started)}", **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3"))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def s3_factory(tmp_path: Path) -> Iterator[Callable[[], S3Server]]:
    """Start private ``rclone serve s3`` servers for one test (stopped afterwards, whatever the test did)."""
    started: list[S3Server] = []

    def start() -> S3Server:
        server = S3Server(tmp_path / f"s3-{len(started)}")
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def key_prefix() -> str:
    """A key prefix no other test uses, so tests sharing a server never see each other's chunks."""
    return f"test-{uuid.uuid4().hex[:12]}:"


PHASE_2_SECONDS = {
    "tests/integrations/test_vllm_serve.py::test_sigterm_flushes_write_back_and_the_restart_reproduces_the_"
    "engines_own_prefix_cache_bit_for_bit": 115,
    "tests/bench/test_live_compare.py::test_compare_baseline_kvtier_and_a_broken_arm": 112,
    "tests/integrations/test_vllm_processes.py::test_graceful_stop_keeps_the_hot_set_and_other_identities_miss": 77,
    "tests/bench/test_live_replicas.py::test_two_replicas_reuse_each_others_prefixes_only_through_redis": 66,
    "tests/bench/test_live_replicas.py::test_two_replicas_reuse_each_others_prefixes_through_the_node_pool_the_bench_"
    "starts": 62,
    "tests/integrations/test_vllm_node_tier.py::test_two_engines_share_one_node_pool_exactly_and_survive_its_owner_"
    "and_an_engine_dying": 59,
    "tests/integrations/test_vllm_demo.py::test_restart_after_sigterm_is_served_from_disk": 58,
    "tests/integrations/test_vllm_processes.py::test_running_consumer_adopts_what_a_producer_writes_later": 55,
    "tests/integrations/test_vllm_two_hosts.py::test_producer_on_host_a_hands_kv_to_consumer_on_host_b": 53,
    "tests/bench/test_native_cpu.py::test_native_cpu_tier_serves_exact_kv": 36,
    "tests/bench/test_live_receipts.py::test_bench_run_reads_the_runs_receipts_and_they_agree_with_the_metrics": 36,
    "tests/integrations/test_vllm_hybrid_kvtier.py::test_sliding_window_model_served_from_cpu_disk_and_another_"
    "engine_through_the_shared_tier": 33,
    "tests/integrations/test_vllm_s3_tier.py::test_a_restart_served_from_an_encrypted_tier_is_exact[disk]": 31,
    "tests/integrations/test_vllm_receipts.py::test_receipts_walk_one_prompt_through_every_state_and_sum_to_the_"
    "metrics": 30,
    "tests/doctor/test_doctor_causes_live.py::test_doctor_names_evictions_and_the_size_on_a_too_small_cpu_tier": 29,
    "tests/integrations/test_vllm_hybrid_kvtier.py::test_hybrid_models_start_with_the_default_config_and_serve_"
    "exact_kv[tiny-swa]": 29,
    "tests/integrations/test_vllm_hybrid_kvtier.py::test_hybrid_models_start_with_the_default_config_and_serve_"
    "exact_kv[tiny-next]": 27,
    "tests/integrations/test_vllm_hybrid_kvtier.py::test_hybrid_models_start_with_the_default_config_and_serve_"
    "exact_kv[tiny-conv]": 28,
    "tests/integrations/test_vllm_hybrid_kvtier.py::test_state_model_served_from_cpu_and_disk_and_a_failed_load_is_"
    "recomputed": 27,
    "tests/integrations/test_vllm_processes.py::test_tensor_parallel_ranks_each_hold_their_share": 27,
    "tests/bench/test_bench_failures.py::test_compare_where_every_arm_is_rejected_exits_2_with_the_reason": 26,
    "tests/integrations/test_vllm_s3_tier.py::test_a_restart_served_from_an_encrypted_tier_is_exact[s3]": 24,
    "tests/integrations/test_vllm_hybrid_models.py::test_state_model": 22,
    "tests/integrations/test_vllm_hybrid_models.py::test_sliding_window_model": 16,
    "tests/integrations/test_hit_story.py::test_one_disk_hit_runs_at_most_todays_files_and_moves": 12,
    "tests/integrations/test_vllm_preflight.py::test_vllm_server_with_chunk_tokens_no_cpu_block_size_divides_stops_"
    "before_the_model_loads": 11,
    "tests/integrations/test_vllm_preflight.py::test_vllm_server_with_a_bad_kvtier_config_stops_before_the_model_"
    "loads": 10,
}
"""Seconds each test of ``make test``'s second phase (``engine and shares_cpu``) takes, about: on the CI
machine kind, two pytest-xdist workers (CI run K, 2026-12-06); those it did not list, and those changed
since, from runs one at a time scaled to it.  The phase's tests run longest first: pytest-xdist hands
each worker a few tests ahead, so a long test left for the end keeps one worker busy while the other
has nothing left (the longest-first rule of list scheduling; with run K's order, longest files first
and the rest as collected, a simulation of xdist's scheduler ended the phase 9 s later on average,
every duration drawn within -20 %/+25 % of these: 523 s against 514, half their sum being 499).
A group of tests one worker runs (``xdist_group``: one server for the module) takes the place of its
first test.  Tests not listed keep their collection order after these; a test renamed without its entry here
only loses its place (tests/test_static.py checks that each entry names a test)."""


PHASE_1_SECONDS = {
    "tests/simulate/test_mooncake_trace.py::test_default_never_below_lru_and_belady_on_top": 21.5,
    "tests/core/test_policies_adaptive.py::test_selector_does_not_chase_noise": 17.2,
    "tests/simulate/test_default_vs_lru.py::test_bundled_trace_window[engine+cpu+disk]": 16.7,
    "tests/test_static.py::test_the_whole_package_types_check": 16.6,
    "tests/simulate/test_default_vs_lru.py::test_bundled_trace_window[cpu+disk]": 15.5,
    "tests/audit/test_compose_and_scripts.py::test_values_vllm_and_lmcache_refuse_are_errors_whatever_their_form": 12.1,
    "tests/bench/test_bench_failures.py::test_a_trickling_metrics_page_ends_the_scrape[server0]": 11.3,
    "tests/bench/test_bench_failures.py::test_a_trickling_model_list_ends_the_start_up_probe[server0]": 11.2,
    "tests/size/test_cli_size.py::test_a_hub_that_trickles_config_json_is_a_clean_error_in_time": 11.0,
    "tests/simulate/test_default_vs_lru.py::test_bundled_trace_window[single]": 8.4,
}
"""The longest tests of ``make test``'s first phase (no engine, three pytest-xdist workers), seconds
on the CI machine kind (CI run K, 2026-12-06): they run first, longest first, for the reason
:data:`PHASE_2_SECONDS` gives.  In collection order most came in the last 400 of the phase's 3,160
tests (the type check 10th from the end), where one left a worker busy after the others ran out; a
simulation of xdist's scheduler (these durations, the other tests 0.27 s on average) ended the phase
10 s sooner with them first.  None of their modules has a fixture wider than a function, so taking
one test out of its module's run sets nothing up twice."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the tests of :data:`PHASE_2_SECONDS` and :data:`PHASE_1_SECONDS` to the front, longest first (a
    stable sort: every other test keeps its place, in collection order)."""
    def seconds(item: pytest.Item) -> float:
        nodeid = item.nodeid.split("@")[0]  # without the group pytest-xdist's --dist loadgroup appends
        return PHASE_2_SECONDS.get(nodeid, PHASE_1_SECONDS.get(nodeid, 0))

    items.sort(key=lambda item: -seconds(item))


EXPECTED_SKIPS = (
    # capability-driven parametrizations: the case does not apply to this tier or mode, on any machine
    r"split reads are a buffered-mode strategy",
    r"pages are process memory: nothing outside can tamper with them",
    r"is private to one process and namespace",
    r"has no backend that can stall",
    r"a shared tier's capacity is the server's",
    r"refused at start-up",  # test_vllm_groups: a retention that is not a multiple of the chunk
)
"""Reasons a test may skip on the CI machine kind (2 cores, no GPU, root); anything else is a failure."""


def _unexpected_skip(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The reason of a skip that is not expected on this machine kind (``None`` if the report is no such skip)."""
    if not report.skipped or hasattr(report, "wasxfail") or os.environ.get("KVTIER_ALLOW_SKIPS") == "1":
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    if any(re.search(pattern, reason) for pattern in EXPECTED_SKIPS):
        return None
    return reason


def _fail_unexpected_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = _unexpected_skip(report)
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = (f"unexpected skip on this machine kind: {reason}\n(allowed skips: tests/conftest.py "
                           "EXPECTED_SKIPS; KVTIER_ALLOW_SKIPS=1 lets every skip through on a development machine)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())


@pytest.fixture
def node_server(tmp_path: Path) -> Iterator[NodeServer]:
    """A node pool owner (``kvtier node serve``) for one test, stopped and its pool removed afterwards."""
    server = NodeServer(tmp_path)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def node_owner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeServer]:
    """One node pool owner for a whole session (the conformance suite: each tier it makes clears its
    namespace first); the tests that kill or restart an owner take :func:`node_server`."""
    server = NodeServer(tmp_path_factory.mktemp("node"))
    try:
        yield server.start()
    finally:
        server.stop()
