"""Stateful property test: the store against a plain dict model.

Invariants: whatever ``get`` returns is byte-identical to what was put under those keys (never
wrong bytes), a load returns exactly the prefix the lookup before it counted, byte for byte,
capacity is never exceeded, lookups never exceed what the model holds, and ``check_integrity``
holds after every step.
"""

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from .helpers import chain_of, make_store, payload


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-prop-"))
        self.store = make_store(self.dir, cpu_chunks=6, disk_chunks=10)
        self.written: dict[bytes, bytes] = {}  # everything ever put (bytes never change under a key)
        self.open_loads: list = []

    @rule(prompt=st.integers(0, 6), n=st.integers(1, 5))
    def put(self, prompt, n):
        chain = chain_of(prompt, n)
        self.store.put(chain, [payload(k) for k in chain])
        for k in chain:
            self.written[k] = payload(k)

    @rule(prompt=st.integers(0, 6), n=st.integers(1, 5))
    def get(self, prompt, n):
        chain = chain_of(prompt, n)
        out = self.store.get(chain)
        assert out == [self.written[k] for k in chain[:len(out)]]

    @rule(prompt=st.integers(0, 6), n=st.integers(1, 5))
    def lookup_then_load(self, prompt, n):
        chain = chain_of(prompt, n)
        self.store.flush()  # no disk write in flight: nothing may move between lookup and load
        found = self.store.lookup(chain)
        assert all(k in self.written for k in chain[:found])
        handle = self.store.prepare_load(chain)
        # a load returns exactly the looked-up prefix, byte for byte
        assert handle.keys == chain[:found]
        assert [b.tobytes() for b in handle.buffers] == [self.written[k] for k in chain[:found]]
        self.open_loads.append(handle)

    @precondition(lambda self: self.open_loads)
    @rule(success=st.booleans())
    def finish_load(self, success):
        handle = self.open_loads.pop(0)
        assert [b.tobytes() for b in handle.buffers] == [self.written[k] for k in handle.keys]
        self.store.complete_load(handle, success)

    @rule()
    def flush(self):
        self.store.flush()

    @invariant()
    def within_capacity(self):
        for usage in (self.store.cpu.usage(), self.store.tier("disk").usage()):
            assert usage.used_bytes <= usage.capacity_bytes
            assert usage.used_bytes + usage.free_bytes == usage.capacity_bytes
        self.store.check_integrity(expect_idle=False)

    def teardown(self):
        for handle in self.open_loads:
            self.store.complete_load(handle, False)
        self.store.flush()
        self.store.check_integrity()
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestStoreMachine = StoreMachine.TestCase
