"""Stateful property test: the store's index and mover against a capacity model.

The machine drives the index (:mod:`kvtier.core.index`) and the mover (:mod:`kvtier.core.mover`)
of a real store (a cpu tier of 6 pages over a write-back disk tier of real chunk files) the way the
:class:`~kvtier.core.store.TieredStore` facade does: plan, move bytes, complete.  Beside it runs a
model of both tiers with the ``lru`` policy: each tier's chunks in eviction order, its capacity,
pins of the loads still open and TTL pins.  The model decides, as the rules of the store say,
which chunk each needed page evicts (the least recently used one not pinned), which victims are
written down (those the disk lacks), which chunk the disk evicts to make room, and where each
chunk of a load comes from.  After every step:

- the cpu tier and the disk tier hold exactly the model's chunks, in the model's eviction order
  (so every eviction, spill and promotion was the one the rules call for, and no other);
- ``lookup`` counts exactly the model's prefix, and every loaded byte is the byte that was saved;
- ``check_integrity`` holds (policy == contents both ways, pins, usage ≤ capacity).

Writes run on the mover's writer thread (``io_threads`` 1: in the order they were planned); each
step waits for them (``flush``) so the disk's order does not depend on timing.

Each example's store lives in a directory of its own under pytest's temporary directory, left in
place like every ``tmp_path``: removing a disk tier's 256 shard directories costs about 0.7 s on
the CI machine kind (ext4 mounted with ``discard``), about 45 s over the examples.
"""

import tempfile
from collections import Counter, OrderedDict
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.core.handles import LoadHandle, WriteJob

from .helpers import CHUNK_BYTES, chain_of, make_store, payload

TTL_S = 3600.0  # never expires within a test
EXAMPLES_DIR: list[Path] = []  # the directory the examples' stores go under (set by the fixture below)


@pytest.fixture(autouse=True)
def _examples_dir(tmp_path_factory: pytest.TempPathFactory):
    EXAMPLES_DIR[:] = [tmp_path_factory.mktemp("examples")]
    yield
    EXAMPLES_DIR.clear()


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="example-", dir=EXAMPLES_DIR[0]))
        self.store = make_store(self.dir, cpu_chunks=6, disk_chunks=10, policy="lru", spill_watermark=0.0,
                                io_threads=1, save_queue_depth=64, pin_max_share=0.5)
        self.index, self.mover = self.store.index, self.store.mover
        (self.disk,) = self.index.local
        self.pages = self.index.pages
        self.disk_chunks = self.disk.tier.usage().capacity_bytes // self.disk.tier.stored_bytes(CHUNK_BYTES)
        self.written: dict[bytes, bytes] = {}  # everything ever saved (bytes never change under a key)
        self.cpu: OrderedDict[bytes, None] = OrderedDict()  # the model: resident chunks, least recent first
        self.on_disk: OrderedDict[bytes, None] = OrderedDict()
        self.pins: Counter[bytes] = Counter()  # open loads' pins of cpu pages
        self.ttl: set[bytes] = set()
        self.open_loads: list[LoadHandle] = []

    # ---- the model's rules -------------------------------------------------------------------
    def _free_page(self, reserved: int, pins: Counter[bytes], spills: list[bytes]) -> bool:
        """One cpu page for a save or a promotion: free, or the least recent chunk not pinned leaves
        (written down if the disk lacks it); False when every chunk is pinned."""
        if len(self.cpu) + reserved < self.pages:
            return True
        victim = next((k for k in self.cpu if not pins[k] and k not in self.ttl), None)
        if victim is None:
            return False
        del self.cpu[victim]
        if victim not in self.on_disk:
            spills.append(victim)
        return True

    def _write_down(self, spills: list[bytes]) -> None:
        for key in spills:
            while len(self.on_disk) + 1 > self.disk_chunks:  # the disk's least recent chunk makes room
                self.on_disk.popitem(last=False)
            self.on_disk[key] = None

    def _prefix(self, chain: list[bytes]) -> int:
        return next((i for i, k in enumerate(chain) if k not in self.cpu and k not in self.on_disk), len(chain))

    def _run(self, writes: list[WriteJob]) -> None:
        self.mover.submit(writes)
        assert self.store.flush(10)

    # ---- rules ---------------------------------------------------------------------------
    @rule(prompt=st.integers(0, 6), n=st.integers(1, 5))
    def save(self, prompt, n):
        chain = chain_of(prompt, n)
        plan = self.index.plan_store(chain, 0, self.store.sink.bind(None))
        handle = plan.handle
        expected, spills = [], []
        for key in chain:
            if key in self.cpu or key in self.on_disk or key in spills:  # a spilled victim is staged: held
                continue
            if not self._free_page(len(expected), self.pins, spills):
                break
            expected.append(key)
        assert handle.keys == expected
        for key, buf in zip(handle.keys, handle.buffers):
            buf[:] = memoryview(payload(key))
        published = self.index.complete_store(handle, True, self.mover.free_slots())
        assert published is not None and published.handle is handle
        for key in expected:
            self.cpu[key] = None
            self.written[key] = payload(key)
        self._run(plan.writes + published.writes)
        self._write_down(spills)

    @rule(prompt=st.integers(0, 6), n=st.integers(1, 5))
    def load(self, prompt, n):
        chain = chain_of(prompt, n)
        found, _by_tier = self.index.lookup(chain)
        assert found == self._prefix(chain)
        plan = self.index.plan_load(chain, len(chain), top_only=False)
        handle = plan.handle
        pins, reserved, spills, promoted = self.pins.copy(), 0, [], []
        tiers = []
        for key in chain[:found]:
            if key in self.cpu:
                pins[key] += 1
                tiers.append("cpu")
                continue
            if key in spills:  # evicted by this load's own promotions: served from its staged copy
                tiers.append("cpu")
                continue
            if self._free_page(reserved, pins, spills):
                reserved += 1
                promoted.append(key)
            tiers.append("disk")
        assert handle.tiers == tiers
        self.mover.read(chain, handle, plan.reads)  # before the writes: the disk's order is the model's
        self._run(plan.writes)
        for key in promoted:  # published in chain order, pinned by the load
            self.cpu[key] = None
            pins[key] += 1
        self._write_down(spills)
        self.pins = pins
        assert handle.keys == chain[:found]
        assert [b.tobytes() for b in handle.buffers] == [self.written[k] for k in handle.keys]
        self.open_loads.append(handle)

    @precondition(lambda self: self.open_loads)
    @rule(success=st.booleans())
    def finish_load(self, success):
        handle = self.open_loads.pop(0)
        assert [b.tobytes() for b in handle.buffers] == [self.written[k] for k in handle.keys]
        self.pins.subtract(handle.pinned)
        self.pins = +self.pins
        assert self.index.release(handle, refresh=success)
        if success:  # used: the resident chunks move to the recent end, in chain order; so do the disk's
            for key in handle.keys:
                if key in self.cpu:
                    self.cpu.move_to_end(key)
            for key, tier in zip(handle.keys, handle.tiers):
                if tier == "disk" and key in self.on_disk:
                    self.on_disk.move_to_end(key)

    @rule(prompt=st.integers(0, 6), n=st.integers(1, 5))
    def ttl_pin(self, prompt, n):
        keys = chain_of(prompt, n)
        budget = int(0.5 * self.pages)
        want_pinned = want_refused = 0
        for key in keys:
            if key not in self.cpu:
                continue
            if key in self.ttl or len(self.ttl) < budget:
                self.ttl.add(key)
                want_pinned += 1
            else:
                want_refused += 1
        assert self.store.ttl_pin(keys, TTL_S) == (want_pinned, want_refused)

    # ---- after every step ----------------------------------------------------------------
    @invariant()
    def matches_the_model(self):
        assert list(self.index.policy.keys()) == list(self.cpu), "cpu tier differs from the model"
        assert set(self.index.cpu.keys()) == set(self.cpu)
        assert self.disk.policy is not None
        assert list(self.disk.policy.keys()) == list(self.on_disk), "disk tier differs from the model"
        assert set(self.disk.tier.keys()) == set(self.on_disk)
        assert +self.index.pins == self.pins
        assert not self.index.staged and not self.mover.busy()  # every spill written
        self.store.check_integrity(expect_idle=False)

    def teardown(self):
        for handle in self.open_loads:
            self.store.complete_load(handle, False)
        self.store.flush()
        self.store.check_integrity()
        self.store.close()


IndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestIndexMachine = IndexMachine.TestCase
