"""kvtier's KV events through a real vLLM 0.32 ``Scheduler`` and its real ZMQ publisher, without
workers: the scheduler schedules real requests (vLLM's own block hasher), kvtier's scheduler side
plans their saves, and each step's ``ModelRunnerOutput`` carries the rank report a worker would
send, written by the test from a tier map it keeps (the truth).  A real ZMQ subscriber decodes the
stream with vLLM's ``KVEventBatch``; the (hash, medium) set it implies must equal the truth after
saves, after spills and evictions, after a reset, and after a restart (a second scheduler on the
same disk directory, announcing the first one's disk chunks from its journal)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvtier.integrations.vllm.protocol import KVTierWorkerMeta, RankReport
from tests.integrations.kv_events_sub import EventSubscriber, free_port

BLOCK = 128  # = chunk_tokens (auto): one engine block per chunk
NUM_BLOCKS = 512
ROOT = b"\x07" * 16
MEDIUM = {"cpu": "CPU", "disk": "STORAGE"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.launch.testmodel import write_model

    return write_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", weights="none")


def scheduler(model: Path, disk: Path, port: int, replay_port: int | None = None, log_stats: bool = False,
              role: str = "kv_both") -> Scheduler:
    # async_saves off: this scheduler has no worker, so no rank would report a deferred save's end
    # and vLLM would hold the finished requests' blocks (reset_prefix_cache refuses); deferred saves
    # are tested with real workers in test_vllm_engine.py and test_vllm_saves.py
    extra = {"cpu_gib": 1, "disk_path": str(disk), "disk_gib": 1, "async_saves": False}
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), max_model_len=2048, dtype="bfloat16"),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=2048,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="KVTierConnector",
                                            kv_connector_module_path="kvtier.integrations.vllm", kv_role=role,
                                            kv_load_failure_policy="recompute", kv_connector_extra_config=extra),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                        endpoint=f"tcp://*:{port}", topic="kv",
                                        replay_endpoint=f"tcp://*:{replay_port}" if replay_port else None))
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=vllm_config.model_config.dtype)
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],  # no worker: no tensors
                                    kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    return Scheduler(vllm_config, kv_cache_config, StructuredOutputManager(vllm_config), block_size=BLOCK,
                     log_stats=log_stats)


class Engine:
    """One scheduler stepped by hand; ``tiers`` is what the (absent) worker's store holds."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.tiers: dict[bytes, str] = {}
        self.hashes: dict[bytes, int | bytes] = {}  # page key -> its block's hash as events carry it
        self.pending: list[tuple[bytes, str | None]] = []
        self.full = True  # the first report is a full snapshot
        self.epoch = 0  # the last reset order applied
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.n = 0
        self.counters: dict[str, float] = {}  # the scheduler's kvtier counters its stats carried, summed

    def subscribed(self, events: EventSubscriber) -> bool:
        """Whether ``events`` receives this scheduler's batches (an empty batch, published until one arrives)."""
        return events.handshake(lambda: self.sched.kv_event_publisher.publish(KVEventBatch(ts=0.0, events=[])))

    def add(self, num_tokens: int) -> None:
        self.n += 1
        tokens = [(self.n * 977 + i) % 30000 for i in range(num_tokens)]
        self.sched.add_request(Request(f"r{self.n}", tokens, SamplingParams(max_tokens=2, ignore_eos=True), None,
                                       block_hasher=self.hasher))

    def change(self, key: bytes, tier: str | None) -> None:
        if tier is None:
            self.tiers.pop(key, None)
        else:
            self.tiers[key] = tier
        self.pending.append((key, tier))

    def step(self) -> None:
        out = self.sched.schedule()
        order = getattr(out.kv_connector_metadata, "reset", None)
        if order is not None:  # what a worker does with a reset order: clear, then a full snapshot
            self.epoch, self.full, self.pending = order.epoch, True, []
            self.tiers.clear()
        requests = {r.request_id: r for r in self.sched.running}
        for save in getattr(out.kv_connector_metadata, "saves", ()):
            for page in save.pages:
                self.hashes[page.key] = maybe_convert_block_hash(requests[save.req_id].block_hashes[page.chunk])
                self.change(page.key, "cpu")
        report = RankReport(ROOT, list(self.tiers.items()) if self.full else self.pending, full=self.full,
                            epoch=self.epoch)
        self.full, self.pending = False, []
        ids = list(out.num_scheduled_tokens)
        outputs = self.sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[1] for _ in ids],
            kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMeta({0: report}))))
        for eco in outputs.values():  # what vLLM's front-end turns into kvtier_*_total (log_stats only)
            stats = eco.scheduler_stats.kv_connector_stats if eco.scheduler_stats is not None else None
            for name, value in ((stats or {}).get("counters") or {}).items():
                self.counters[name] = self.counters.get(name, 0) + value

    def run_until_idle(self, max_steps: int = 50) -> None:
        """Step as vLLM's ``EngineCore.step`` does: while the scheduler has requests or the connector
        asks for steps (``has_pending_push_work``), and no longer."""
        for _ in range(max_steps):
            if not self.sched.has_requests():
                return
            self.step()
        raise AssertionError(f"still stepping after {max_steps} steps")

    def truth(self) -> set[tuple[int | bytes, str]]:
        return {(self.hashes[k], MEDIUM[t]) for k, t in self.tiers.items() if k in self.hashes}


def _save_one_prompt(engine: Engine) -> None:
    """The first report (the mirror is ready), then one prompt of 4 full chunks, stepped until saved."""
    engine.step()
    engine.add(4 * BLOCK + 10)
    for _ in range(3):
        engine.step()


def test_the_stream_a_router_reads_matches_the_tiers_through_spills_evictions_reset_and_restart(
        model: Path, tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir()  # the disk tier's directory (its workers would create it)
    port = free_port()
    events = EventSubscriber(port)
    engine = Engine(scheduler(model, tmp_path / "disk", port))
    try:
        assert engine.subscribed(events)
        engine.step()  # the first report: the mirror is ready
        for _ in range(3):
            engine.add(4 * BLOCK + 10)
        for _ in range(4):
            engine.step()
        assert len(engine.tiers) == 12, "3 prompts of 4 full chunks each are saved"
        assert events.wait(lambda held: held == engine.truth()), (len(events.held()), len(engine.truth()))

        keys = list(engine.tiers)
        for key in keys[:4]:  # spilled and dropped from cpu
            engine.change(key, "disk")
        for key in keys[4:6]:  # evicted from every tier
            engine.change(key, None)
        engine.step()
        assert events.wait(lambda held: held == engine.truth()), (events.held() ^ engine.truth())
        assert {m for _, m in events.held()} == {"CPU", "STORAGE"}

        assert engine.sched.reset_prefix_cache(reset_connector=True)
        engine.step()  # the step after a reset publishes its removals (and carries the order)
        assert events.wait(lambda held: not held), events.held()

        # saved again after the reset, then stopped: the journal keeps the block hashes
        engine.add(3 * BLOCK + 1)
        for _ in range(3):
            engine.step()
        for key in list(engine.tiers):
            engine.change(key, "disk")
        engine.step()
        assert events.wait(lambda held: held == engine.truth() != set())
        on_disk = dict(engine.tiers)
        engine.sched.shutdown()
    finally:
        events.close()
    assert list((tmp_path / "disk").glob(".kvtier-kv-events-*.msgpack"))

    # the restarted scheduler: its worker's first snapshot is the disk index; no request has run.
    # The router joins late, after the announcements: it asks vLLM's replay endpoint for them.
    port, replay_port = free_port(), free_port()
    restarted = Engine(scheduler(model, tmp_path / "disk", port, replay_port))
    events: EventSubscriber | None = None
    try:
        restarted.tiers = dict(on_disk)
        restarted.hashes = dict(engine.hashes)  # the truth's hashes, for the comparison only
        restarted.step()
        restarted.step()
        # vLLM's publisher thread has sent them (ZmqEventPublisher marks each batch done once sent)
        restarted.sched.kv_event_publisher._event_queue.join()  # type: ignore[attr-defined]
        events = EventSubscriber(port, replay_port)  # joins after: ZMQ never delivers them live
        assert restarted.subscribed(events)
        assert events.wait(lambda held: held == restarted.truth() and len(held) == 3), events.held()
        assert events.replayed > 0
    finally:
        restarted.sched.shutdown()
        if events is not None:
            events.close()


def test_the_event_counters_count_every_event_published_before_the_engine_goes_idle(
        model: Path, tmp_path: Path) -> None:
    """``kvtier_kv_events_stored_total`` / ``_removed_total`` equal the chunks the stream announced
    once an engine is idle.  vLLM asks for the connector's stats before its events in the same
    ``update_from_output``, so a step's events are counted by the next step's stats; seen on a live
    ``api_server``: after a burst of saves the counter read 115 while the stream had announced 124
    chunks, and after a reset the 74 removals were missing from ``_removed_total`` until the next
    request, however long the server stayed idle."""
    (tmp_path / "disk").mkdir()
    port = free_port()
    events = EventSubscriber(port)
    engine = Engine(scheduler(model, tmp_path / "disk", port, log_stats=True))
    try:
        assert engine.subscribed(events)
        engine.step()  # the first report: the mirror is ready
        for _ in range(3):
            engine.add(4 * BLOCK + 10)
        engine.run_until_idle()
        assert len(engine.tiers) == 12, "3 prompts of 4 full chunks each are saved"
        assert events.wait(lambda held: held == engine.truth()), (len(events.held()), len(engine.truth()))
        assert engine.counters.get("kv_events_stored") == 12, engine.counters

        assert engine.sched.reset_prefix_cache(reset_connector=True)
        engine.run_until_idle()  # the idle engine steps for the reset's removals, and no longer
        assert events.wait(lambda held: not held), events.held()
        assert engine.counters.get("kv_events_removed") == 12, engine.counters
        assert engine.counters.get("kv_events_stored") == 12, engine.counters
    finally:
        engine.sched.shutdown()
        events.close()


def test_a_router_reading_one_engine_across_a_restart_keeps_no_chunk_at_the_stopped_cpu_tier(
        model: Path, tmp_path: Path) -> None:
    """One subscriber on the engine's endpoint before and after a graceful restart (what a router
    connected to a pod's socket reads): chunks announced ``CPU`` at the stop were flushed to disk and
    are announced ``STORAGE`` after it; the stream must also withdraw their ``CPU`` entries, which no
    longer exist.  Seen on a live api_server: after a SIGTERM restart the router's view held the same
    19 block hashes at both ``CPU`` and ``STORAGE``."""
    (tmp_path / "disk").mkdir()
    port = free_port()
    events = EventSubscriber(port)
    try:
        engine = Engine(scheduler(model, tmp_path / "disk", port))
        try:
            assert engine.subscribed(events)
            _save_one_prompt(engine)
            keys = list(engine.tiers)
            assert len(keys) == 4
            for key in keys[:2]:  # spilled to disk and dropped from cpu
                engine.change(key, "disk")
            engine.step()
            assert events.wait(lambda held: held == engine.truth()), (events.held() ^ engine.truth())
            assert {m for _, m in events.held()} == {"CPU", "STORAGE"}
        finally:
            engine.sched.shutdown()  # graceful: the journal is written; the workers flush cpu to disk
        on_disk = dict.fromkeys(engine.tiers, "disk")

        restarted = Engine(scheduler(model, tmp_path / "disk", port))  # the same endpoint
        try:
            restarted.tiers = dict(on_disk)
            restarted.hashes = dict(engine.hashes)  # the truth's hashes, for the comparison only
            before = events.batches  # the subscriber reconnects by itself: publish until it hears this one
            assert events.handshake(lambda: restarted.sched.kv_event_publisher.publish(KVEventBatch(ts=0.0, events=[])),
                                    after=before)
            restarted.step()
            restarted.step()
            truth = restarted.truth()
            assert len(truth) == 4 and {m for _, m in truth} == {"STORAGE"}
            assert events.wait(lambda held: held == truth), (events.held() ^ truth)
        finally:
            restarted.sched.shutdown()
    finally:
        events.close()


def test_a_restart_of_two_engines_on_one_disk_directory_announces_both_engines_chunks(
        model: Path, tmp_path: Path) -> None:
    """Two engines on one ``disk_path`` and namespace (``--data-parallel-size 2`` in one api_server)
    share one journal: after both stop, a restarted engine must announce the chunks both had
    saved, all of them on the shared disk and loadable by it.  Seen on a live api_server with
    ``--data-parallel-size 2``: after a SIGTERM restart each rank announced 19 of the 37 disk chunks
    (the last engine to stop wrote its own map over the other's), and the other 18 were served
    from disk without a router having been told."""
    (tmp_path / "disk").mkdir()
    first, second = (Engine(scheduler(model, tmp_path / "disk", free_port())) for _ in range(2))
    second.n = 100  # other prompts than the first engine's
    try:
        for engine in (first, second):
            _save_one_prompt(engine)
            assert len(engine.tiers) == 4
    finally:
        first.sched.shutdown()
        second.sched.shutdown()  # the last to stop
    port = free_port()
    events = EventSubscriber(port)
    restarted = Engine(scheduler(model, tmp_path / "disk", port))
    try:
        assert restarted.subscribed(events)
        restarted.tiers = dict.fromkeys([*first.tiers, *second.tiers], "disk")  # flushed, one directory
        restarted.hashes = {**first.hashes, **second.hashes}  # the truth's hashes, for the comparison only
        restarted.step()
        restarted.step()
        truth = restarted.truth()
        assert len(truth) == 8 and {m for _, m in truth} == {"STORAGE"}
        assert events.wait(lambda held: held == truth), (len(events.held()), events.held() ^ truth)
    finally:
        restarted.sched.shutdown()
        events.close()


def test_a_producer_announces_no_chunk_of_its_tiers(model: Path, tmp_path: Path) -> None:
    """A ``kv_producer`` saves but never loads, so a router told that it holds a chunk at ``CPU``
    or ``STORAGE`` ("a load would read them from X") would send it prefills it recomputes in full;
    its stream carries vLLM's own ``GPU`` events only.  Seen on a producer/consumer pair on one
    ``disk_path``: the producer's stream announced every chunk it saved at ``CPU``."""
    (tmp_path / "disk").mkdir()
    port = free_port()
    events = EventSubscriber(port)
    engine = Engine(scheduler(model, tmp_path / "disk", port, role="kv_producer"))
    try:
        assert engine.subscribed(events)
        _save_one_prompt(engine)
        assert len(engine.tiers) == 4, "the producer saves its prompt's 4 full chunks"
        for key in list(engine.tiers)[:2]:
            engine.change(key, "disk")
        engine.step()
        assert events.wait(lambda _held: len(events.held(("GPU",))) >= 4), events.held(("GPU",))
        assert events.held() == set()
    finally:
        engine.sched.shutdown()
        events.close()


def test_a_reset_of_an_engine_idle_past_the_settle_window_steps_for_its_removals(
        model: Path, tmp_path: Path) -> None:
    """vLLM's engine loop steps an idle engine only while ``Scheduler.has_requests()``; a reset
    must make it true again, even when the engine has been idle longer than the settle window,
    so that the order reaches the workers and the ``BlockRemoved`` of every announced chunk the
    router.  Seen on a live api_server (redis replicas, ``reset_scope: all``): a reset 11 s after
    the last request left the router holding 8 ``CPU`` blocks, and the cpu tier full, until the
    next request came."""
    (tmp_path / "disk").mkdir()
    port = free_port()
    events = EventSubscriber(port)
    engine = Engine(scheduler(model, tmp_path / "disk", port))
    try:
        settle = engine.sched.connector.scheduler_side.settle  # type: ignore[union-attr]
        settle.settle_s = 0.2  # the window (10 s live), short for the test
        assert engine.subscribed(events)
        engine.step()  # the first report: the mirror is ready
        engine.add(4 * BLOCK + 10)
        engine.run_until_idle()
        assert events.wait(lambda held: held == engine.truth() != set())
        engine.step()  # an idle step opens the window, which then runs out
        time.sleep(0.3)
        assert not engine.sched.has_requests(), "idle past the window: vLLM's loop waits for input"

        assert engine.sched.reset_prefix_cache(reset_connector=True)
        assert engine.sched.has_requests(), "the reset asks vLLM's loop for a step"
        engine.run_until_idle()
        assert not engine.tiers, "the workers received the reset order"
        assert events.wait(lambda held: not held), events.held()
    finally:
        engine.sched.shutdown()
        events.close()
