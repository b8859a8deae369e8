"""How the disk tier's files are opened: whether ``O_DIRECT`` works here, and the ``disk_io: auto`` rule."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Literal

import numpy as np

from kvtier.core.tiers.disk.chunkio import ALIGN, O_DIRECT, _pwrite_all, aligned_buffer

log = logging.getLogger(__name__)
IOMode = Literal["auto", "buffered", "direct"]
"""The ``disk_io`` modes: ``buffered`` (the page cache), ``direct`` (``O_DIRECT``), ``auto`` (measured)."""
IO_MODES: tuple[IOMode, ...] = ("auto", "buffered", "direct")


def direct_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether files in ``directory`` can be opened, written and read with ``O_DIRECT``.

    A filesystem that refuses it (EINVAL at open, as tmpfs did before Linux 6.6, or at the first
    aligned I/O) gives ``False``; other errors propagate as ``OSError``.
    """
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f".kvtier-direct-probe-{os.getpid()}-{threading.get_ident()}")
    buf = aligned_buffer(ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == 22:  # EINVAL: the filesystem does not do O_DIRECT
            return False
        raise
    try:
        os.pwrite(fd, buf, 0)
        os.preadv(fd, [buf], 0)
        return True
    except OSError as exc:
        if exc.errno == 22:
            return False
        raise
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


PROBE_BYTES = 16 << 20
"""Bytes written and read back per mode and round by :func:`measure_direct`."""
PROBE_ROUNDS = 3
CLEARLY_SLOWER = 1.5
"""``disk_io: auto`` keeps O_DIRECT unless it took more than this many times buffered's time in every probe round."""
_measured: dict[int, tuple[bool, str]] = {}
_measured_lock = threading.Lock()


def measure_direct(directory: str | os.PathLike[str]) -> tuple[bool, str]:
    """Choose ``O_DIRECT`` for ``directory`` (the ``disk_io: auto`` rule).

    Rule: **direct whenever the filesystem supports it, unless the probe shows it clearly slower**,
    i.e. more than :data:`CLEARLY_SLOWER` × the buffered time in *every* one of
    :data:`PROBE_ROUNDS` rounds.  Each round writes :data:`PROBE_BYTES` in 4 MiB writes and
    reads them back in each mode, alternating (buffered: ``fdatasync`` after writing, and the
    file dropped from the page cache with ``posix_fadvise(DONTNEED)`` before reading, so both
    modes pay the device).  Direct is preferred because it keeps the host's page cache free of
    chunks the cpu tier already holds and sends the device large aligned requests; requiring
    every round to agree before giving that up keeps the choice stable on a noisy host, where a
    single round's times swing by 2-3× (a comparison of medians flip-flopped between starts).
    The result is remembered per filesystem (``st_dev``) for the life of the process.

    A timing probe that cannot write its bytes (a full filesystem) keeps direct, untimed.

    Returns:
        (use direct, one line saying why, with each round's times).

    Raises:
        OSError: the 4 KiB :func:`direct_supported` test itself failed (not EINVAL).
    """
    dev = os.stat(directory).st_dev
    with _measured_lock:
        if dev in _measured:
            return _measured[dev]
        if not direct_supported(directory):
            _measured[dev] = (False, "the filesystem refuses O_DIRECT")
            return _measured[dev]
        block = aligned_buffer(4 << 20)
        block[:] = np.random.default_rng(0).integers(0, 256, block.nbytes, dtype=np.uint8).tobytes()
        rounds: dict[str, list[float]] = {"buffered": [], "direct": []}
        try:
            for _round in range(PROBE_ROUNDS):  # alternating, so both modes see the same machine state
                for name, flags in (("buffered", 0), ("direct", O_DIRECT)):
                    rounds[name].append(_probe(directory, block, flags))
        except OSError as exc:  # e.g. ENOSPC: a tier that filled its filesystem, restarted; O_DIRECT itself works
            why = f"O_DIRECT supported; the {PROBE_BYTES >> 20} MiB timing probe could not write ({exc.strerror})"
            _measured[dev] = (True, f"{why}: direct, untimed")
            return _measured[dev]
        slower = all(d > CLEARLY_SLOWER * b for b, d in zip(rounds["buffered"], rounds["direct"]))
        times = ", ".join(f"{b * 1e3:.0f}/{d * 1e3:.0f}" for b, d in zip(rounds["buffered"], rounds["direct"]))
        verdict = (f"O_DIRECT slower than {CLEARLY_SLOWER:g}x buffered in every round: buffered" if slower
                   else f"O_DIRECT supported and not slower than {CLEARLY_SLOWER:g}x buffered in every round: direct")
        why = (f"{PROBE_BYTES >> 20} MiB written and read back per round, buffered/O_DIRECT ms {times}; {verdict}")
        _measured[dev] = (not slower, why)
        return _measured[dev]


def _probe(directory: str | os.PathLike[str], block: memoryview, flags: int) -> float:
    """Seconds to write :data:`PROBE_BYTES` of ``block`` copies, sync, and read them back."""
    path = os.path.join(directory, f".kvtier-io-probe-{os.getpid()}")
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        try:
            for off in range(0, PROBE_BYTES, block.nbytes):
                _pwrite_all(fd, block, off)
            os.fdatasync(fd)
            if not flags and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            for off in range(0, PROBE_BYTES, block.nbytes):
                os.preadv(fd, [block], off)
        finally:
            os.close(fd)
        return time.perf_counter() - t0
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def resolve_io(io: IOMode, directory: Path) -> tuple[str, str]:
    """(``"direct"`` or ``"buffered"``, why) for the configured mode ``io`` on ``directory``.

    A probe that cannot write at all (a full filesystem: a tier sized to the free space fills it
    by design, so a restart finds it full; an I/O error) never stops the engine: buffered I/O works
    wherever writing does, and the tier's own evictions make room again.
    """
    if io == "buffered":
        return "buffered", "configured"
    try:
        return _probe_io(io, directory)
    except OSError as exc:
        log.warning("kvtier disk tier: could not test O_DIRECT in %s (%s); using buffered I/O until the next start",
                    directory, exc.strerror)
        return "buffered", f"{io}: the O_DIRECT probe could not write ({exc.strerror})"


def _probe_io(io: IOMode, directory: Path) -> tuple[str, str]:
    if io == "direct":
        if direct_supported(directory):
            return "direct", "configured"
        log.warning("kvtier disk tier: the filesystem of %s refuses O_DIRECT; using buffered I/O", directory)
        return "buffered", "configured direct, but the filesystem refuses O_DIRECT"
    direct, why = measure_direct(directory)
    return ("direct" if direct else "buffered"), f"auto: {why}"
