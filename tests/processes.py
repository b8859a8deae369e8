"""Processes on this machine, for tests that check nothing they started is left running."""

from __future__ import annotations

from pathlib import Path


def pids_mentioning(text: str) -> list[int]:
    """Pids of the processes whose command line contains ``text`` (read from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids
