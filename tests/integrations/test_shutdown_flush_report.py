"""The graceful stop's flush line tells failed writes (a full disk) from chunks that missed the
time limit: a real store whose disk tier sits on a real 8 MiB tmpfs, filled before the flush."""

from __future__ import annotations

import logging

from kvtier.integrations.vllm.worker.shutdownflush import flush_line, flush_on_stop
from tests.core.helpers import CHUNK_BYTES, chain_of, make_store, payload
from tests.core.test_disk_tier import fill, small_filesystem  # noqa: F401 (a fixture)


def test_a_full_disk_is_named_as_failed_writes_not_as_the_time_limit(small_filesystem):  # noqa: F811
    store = make_store(small_filesystem, cpu_chunks=64, disk_chunks=32)  # write-back: dirty until flushed
    try:
        chain = chain_of(3, 5)
        store.put(chain, [payload(k) for k in chain])
        filler = fill(small_filesystem, 0)
        report = flush_on_stop(store, timeout_s=10)
        assert (report.written, report.failed, report.missed) == (0, 5, 0)
        assert report.error == "No space left on device"
        level, line = flush_line(report, "rank 0", CHUNK_BYTES, 10)
        assert level == logging.WARNING
        assert line.startswith("kvtier: rank 0 shutdown flush wrote 0 dirty chunks to disk in ")
        assert "; 5 (0.0 MiB) failed to write (No space left on device: the disk is full or unwritable" in line
        assert "missed shutdown_flush_s" not in line
        filler.unlink()
        report = flush_on_stop(store, timeout_s=0)  # room again, but no time: the limit is to blame
        assert (report.written, report.failed, report.missed) == (0, 0, 5)
        _level, line = flush_line(report, "rank 0", CHUNK_BYTES, 0)
        assert "5 (0.0 MiB) missed shutdown_flush_s=0 and are lost" in line and "failed to write" not in line
        assert flush_on_stop(store, timeout_s=10)[:3] == (5, 0, 0)
        assert flush_line(flush_on_stop(store, 10), "rank 0", CHUNK_BYTES, 10)[0] == logging.INFO
    finally:
        store.close()
