"""The tenant record crosses the tier interface as an argument (issue 33 item 4): a write takes
the tenant, a read returns each verified record in the dict its caller passes, whatever thread
writes, reads or verifies, through every wrapper; no thread-local in src/kvtier carries request or
tenant state."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvtier.core import envelope, tenant
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers import DiskTier, GetResult, PutResult
from kvtier.core.tiers.breaker import CircuitBreaker
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.wrappers import FaultyTier, TierWrapper

CHUNK = 8192
NS = b"t" * 16
SRC = Path(__file__).resolve().parents[2] / "src" / "kvtier"


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def data(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


def test_a_tenant_written_on_one_thread_is_read_back_on_another_through_every_wrapper(tmp_path):
    disk = DiskTier(tmp_path, NS, capacity_bytes=64 * CHUNK, io_threads=4)
    guarded = GuardedTier(TierWrapper(FaultyTier(disk)), deadline_s=5.0, transfer_deadline_s=5.0, io_threads=2,
                          queue_depth=4, breaker=CircuitBreaker(3, 60.0))
    who = {0: tenant.TenantId.of("B", None), 1: tenant.TenantId.of("A", "sql"), 2: None}
    try:
        with ThreadPoolExecutor(1) as writer:  # written on a thread that is neither the reader nor the wrapper's
            got = writer.submit(guarded.put_many, [key(i) for i in who], [data(i) for i in who], list(who.values()))
            assert got.result() == [PutResult.STORED] * 3
        outs = [bytearray(CHUNK) for _ in who]
        records: tenant.TenantRecords = {}
        results = guarded.get_many([key(i) for i in who], [memoryview(o) for o in outs], records)
        assert results == [GetResult.HIT] * 3 and [bytes(o) for o in outs] == [data(i) for i in who]
        assert set(records) == {key(0), key(1)}  # the unknown tenant has no record to return
        for i in (0, 1):
            writer_tenant = who[i]
            assert writer_tenant is not None
            assert records[key(i)] == envelope.RecordedTenant(NS, tenant.record(NS, writer_tenant))
        # a record carried on (a promoted chunk written down again) keeps its bytes
        assert disk.put(key(3), data(3), records[key(1)]) is PutResult.STORED
        again: tenant.TenantRecords = {}
        assert disk.get_many([key(3)], [memoryview(bytearray(CHUNK))], again) == [GetResult.HIT]
        assert again[key(3)] == records[key(1)]
        # a read without a dict collects nothing and still reads
        assert disk.get_into(key(0), memoryview(bytearray(CHUNK))) is GetResult.HIT
    finally:
        guarded.close()


def test_no_thread_local_holds_request_or_tenant_state():
    """The one thread-local left is the disk I/O's scratch buffers, which say so where they are declared."""
    found = [(path.relative_to(SRC).as_posix(), n, line) for path in sorted(SRC.rglob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"threading\.local|\blocal\(\)", line)]
    assert [(p, line.strip()) for p, _n, line in found] == [
        ("core/tiers/disk/chunkio.py", "class IOBuffers(threading.local):")]
    path, n, _line = found[0]
    doc = (SRC / path).read_text(encoding="utf-8").splitlines()[n:n + 4]
    assert "no request or tenant state" in " ".join(doc)
