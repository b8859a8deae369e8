"""Start-up cost of the disk tier's key-id check (issue 36, docs/security.md "Failures"): with a key
ring configured, ``DiskTier()`` reads each chunk file's header block and key id so that files
sealed under a master key the ring lacks are never indexed; without one, start-up is a listing.

Writes ``--files`` encrypted chunk files of ``--chunk-kib`` KiB into a fresh directory, then times
``DiskTier()`` over them (best of ``--repeats``) without a ring, with the ring that sealed them, and
with another ring (nothing indexed, every file counted).  The files are page-cached (just
written): a cold start adds one random read per file.

Usage::

    python scripts/disk_startup_keyids.py [--files 20000] [--chunk-kib 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path

from kvtier.core import encryption
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.disk.tier import DiskTier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20000)
    parser.add_argument("--chunk-kib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the wrong ring's one warning line per start
    ring = encryption.KeyRing(encryption.MasterKey.of(b"sealing-master-key-".ljust(40, b"0")))
    other = encryption.KeyRing(encryption.MasterKey.of(b"another-master-key-".ljust(40, b"1")))
    namespace = bytes(16)
    root = Path(tempfile.mkdtemp(prefix="kvtier-keyid-startup-"))
    try:
        writer = DiskTier(root, namespace, 1 << 42, codec_args={"chain": ("aes-256-gcm",), "keyring": ring})
        data = bytes(args.chunk_kib << 10)
        for i in range(args.files):
            writer.put(ChunkKey(i.to_bytes(16, "little")), data)
        writer.close()
        print(f"{args.files} files of {args.chunk_kib} KiB (page-cached), best of {args.repeats}")
        print("| key ring | DiskTier() ms | indexed |\n|---|---|---|")
        for label, ring_used in (("none", None), ("the sealing one", ring), ("another", other)):
            codec_args: dict = {"chain": ("identity",) if ring_used is None else ("aes-256-gcm",), "keyring": ring_used}
            best, indexed = float("inf"), 0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                tier = DiskTier(root, namespace, 1 << 42, codec_args=codec_args)  # type: ignore[arg-type]
                best = min(best, time.perf_counter() - t0)
                indexed = len(tier.keys())
                tier.close()
            print(f"| {label} | {best * 1000:.0f} | {indexed} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
