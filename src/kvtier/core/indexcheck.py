"""The index's invariants, asserted (:meth:`kvtier.core.store.TieredStore.check_integrity`; tests
and drills, never the serving path): :func:`check_index`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.core.index import Index


def check_index(index: Index, expect_idle: bool) -> None:
    """Assert every invariant: the cpu tier's page accounting; its policy tracks exactly the
    resident chunks (both ways); TTL pins, pins, staged copies and writes name held chunks;
    each lower tier's usage ≤ capacity and policy == contents; the tenant ledgers; and with
    ``expect_idle`` that nothing is pinned and no write is planned.

    Raises:
        AssertionError: naming the broken invariant.
    """
    with index.lock:
        index.cpu.check()
        usage = index.cpu.usage()
        assert usage.used_bytes + usage.free_bytes == usage.capacity_bytes
        assert usage.used_bytes <= usage.capacity_bytes, f"{index.name} holds more than its capacity"
        resident = set(index.cpu.keys())
        tracked = set(index.policy.keys())
        assert resident == tracked, \
            f"{index.name} policy tracks {len(tracked)} chunks but {len(resident)} are resident"
        assert set(index.ttl_pins) <= resident, f"{index.name} TTL-pins chunks that are not resident"
        assert set(index.pins) <= resident, f"{index.name} pins chunks that are not resident"
        assert set(index.writing) <= set(index.pins), "a write reads a page it does not pin"
        assert all(index.pins[k] >= n for k, n in index.writing.items()), "more writes than pins of a page"
        assert index.doomed <= set(index.pins), "a doomed chunk is not pinned (it should have been freed)"
        assert set(index.parent) <= resident and set(index.uses) <= resident, "bookkeeping of evicted chunks"
        assert all(c.pending > 0 or k in index.gate.deferred for k, c in index.staged.items()), "a stray staged copy"
        if index.quota is not None:
            index.quota.check(resident)
        for lt in index.lower:
            lt.check()
        if expect_idle:
            lower_pins = {lt.name: len(lt.pins) for lt in index.lower if lt.pins}
            assert not index.pins and not lower_pins, \
                f"pins left behind: {len(index.pins)} {index.name}, {lower_pins}"
            written = all(c.pending <= 0 for c in index.staged.values())  # done ones may wait for the gate
            assert not index.writing and written, "writes still in flight"
