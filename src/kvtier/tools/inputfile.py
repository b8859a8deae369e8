"""What kind of thing an input path names, found with ``stat`` and never by opening it.

Opening a FIFO (named pipe) for reading waits until some process opens it for writing: ``kvtier
check ff``, ``simulate --trace ff``, ``trace stats --trace ff`` and ``doctor --from-files ff ff``
hung forever on a FIFO with no writer.  The readers of input files therefore ask
:func:`not_a_regular_file` first and refuse anything but a regular file in one sentence.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def not_a_regular_file(path: str | Path) -> str | None:
    """``"is a FIFO (named pipe), ..., not a regular file"`` (or a socket, a device, a directory) when
    ``path`` names no regular file; ``None`` for a regular file (a symbolic link to one included) and
    for a path that ``stat`` cannot reach, whose reader then names the missing file as before."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a file")
    return f"is {kind}, not a regular file"
