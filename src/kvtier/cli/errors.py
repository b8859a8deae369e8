"""How a command ends on a user mistake: one sentence on stderr, exit code 2, no traceback.

The exception classes themselves live in :mod:`kvtier.core.errors` (the bottom of the package
graph), so library packages never import the CLI.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` to stderr and exit with ``code``."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def check_output_path(path: Path | None, option: str) -> None:
    """Refuse (exit 2, one sentence) an output file that cannot be written, before any work."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        fail(f"{option} {path} is a directory; give a file name in it")
    if not parent.is_dir():
        what = "is a file, not a directory" if parent.exists() else "does not exist"
        fail(f"{option} {path}: directory {parent} {what}; create it or pass a path in an existing directory")
    refuse_kernel_filesystem(path, option)
    if not os.access(path if path.exists() else parent, os.W_OK):
        fail(f"{option} {path} is not writable; pass a path in a writable directory")


def check_input_files(inputs: Iterable[tuple[str, Path | None]]) -> None:
    """Refuse (exit 2, one sentence) an input option naming a FIFO, socket, device or directory,
    found with stat before anything opens it: reading a FIFO with no writer waits forever
    (:mod:`kvtier.tools.inputfile`).  A missing path is left to the reader, which names it."""
    from kvtier.tools.inputfile import not_a_regular_file

    for option, path in inputs:
        if path is not None and (kind := not_a_regular_file(path)) is not None:
            fail(f"{option} {path} {kind}; give a regular file")


def refuse_kernel_filesystem(path: Path, option: str) -> None:
    """Refuse (exit 2, one sentence) an output path on a kernel pseudo filesystem such as /proc or
    /sys, whose directories root may write to but which holds no files: the write would fail only
    after the work.  The test is ``kvtier check``'s for disk_path
    (:func:`kvtier.core.tiers.disk.check.pseudo_filesystem`), on the nearest existing ancestor.  An
    existing stream (a device or FIFO: ``/dev/stdout``, ``/dev/null``, ``/proc/self/fd/1``) is
    written as the user asked, not refused."""
    from kvtier.core.tiers.disk.check import pseudo_filesystem

    try:
        mode = path.stat().st_mode
    except OSError:
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    pseudo = pseudo_filesystem(existing)
    if pseudo is not None:
        fstype, mount_point = pseudo
        fail(f"{option} {path} is on the {fstype} filesystem mounted at {mount_point}, a kernel interface that "
             "cannot hold files; pass a path on a local disk")


def make_output_dir(path: Path, option: str) -> None:
    """Create the report directory ``path`` (and its parents) before any work, or refuse (exit 2,
    one sentence naming the problem and the fix): an existing file, a place that cannot hold one."""
    if path.exists() and not path.is_dir():
        fail(f"{option} {path} is an existing file, not a directory; pass a new or existing directory")
    refuse_kernel_filesystem(path, option)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"{option} {path} cannot be created ({exc.strerror}); pass a directory path you can write to")
    if not os.access(path, os.W_OK | os.X_OK):
        fail(f"{option} {path} is not writable; pass a directory you can write to")


def flag_names(message: str, keys: Iterable[str]) -> str:
    """``message`` with each configuration key of ``keys`` written as the flag the user typed
    (``s3_endpoint_url`` -> ``--s3-endpoint-url``): the user gave flags, not keys.  The
    configuration's framing (``kvtier config field 'k': ...; fix the value of 'k'``) is dropped:
    the sentence then names the flag once."""
    for key in sorted(keys, key=len, reverse=True):
        message = re.sub(rf"(?<![\w-]){re.escape(key)}(?!\w)", "--" + key.replace("_", "-"), message)
    message = re.sub(r"(--[\w-]+): true\b", r"\1", message).removeprefix("kvtier config field ")
    framed = re.match(r"'(--[\w-]+)': (.*?)(?:; fix the value of '\1')?$", message, re.DOTALL)
    if framed is not None:
        flag, rest = framed.groups()
        message = rest if rest.startswith(flag) else f"{flag}: {rest}"
    return message
