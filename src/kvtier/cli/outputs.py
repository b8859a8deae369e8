"""The one rule for every file a command writes (``--json``, ``--plot``, ``--out``), checked before any work.

- An existing regular file is refused unless ``--force`` (the wording of ``kvtier trace synth``).
- An output that is the same file as one of the command's inputs (``os.path.samefile``), or as
  another of its outputs, is refused even with ``--force``: writing it would destroy the input
  (``simulate --trace t.jsonl --json t.jsonl`` replaced the trace with its own results).
- A report directory is refused when it already holds a file the command writes there (or, for a
  command whose file names vary, any file) unless ``--force``.
- An existing stream (``/dev/stdout``, ``/dev/null``, a FIFO) is written as the user asked.

Each refusal is one sentence on stderr and exit 2 (:func:`kvtier.cli.errors.fail`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvtier.cli.errors import check_output_path, fail, make_output_dir

FORCE_HELP = "Replace existing output files (never an input file: that is refused even with --force)."
"""The ``--force`` help of every command that writes files."""

REFUSED = "an existing file is refused without --force"
"""The clause every output option's help ends with."""

Named = tuple[str, Path | None]
"""An option and its path (``None``: not given)."""


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same inode (a hard or symbolic link included), or,
    while neither exists yet, the same resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return os.path.realpath(a) == os.path.realpath(b)


def _refuse_inputs(option: str, path: Path, inputs: Iterable[Named]) -> None:
    for other, given in inputs:
        if given is not None and _same_file(path, given):
            fail(f"{option} {path} is the same file as {other} {given}, which writing it would destroy; pass another "
                 f"file for {option}")


def _refuse_twice(option: str, path: Path, earlier: Iterable[Named]) -> None:
    for other, given in earlier:
        if given is not None and _same_file(path, given):
            fail(f"{option} {path} is the same file as {other} {given}; give each output a file of its own")


def check_new_files(outputs: Sequence[Named], force: bool, inputs: Iterable[Named] = (), when: str = "") -> None:
    """Refuse (exit 2, one sentence) any of ``outputs`` that cannot be written
    (:func:`~kvtier.cli.errors.check_output_path`), that is the same file as one of ``inputs`` or
    as an earlier output (even with ``force``), or that already exists as a regular file (unless
    ``force``).  ``when`` ends the refusal's sentence (``trace record``: " once a request is recorded")."""
    inputs = list(inputs)
    for k, (option, path) in enumerate(outputs):
        if path is None:
            continue
        check_output_path(path, option)
        _refuse_inputs(option, path, inputs)
        _refuse_twice(option, path, outputs[:k])
        if not force and path.is_file():
            fail(f"{option} {path} already exists; pass another file name, or --force to replace it{when}")


def make_report_dir(path: Path, option: str, force: bool, names: Iterable[str] | None = None,
                    inputs: Iterable[Named] = ()) -> None:
    """Create the report directory ``path`` before any work (:func:`~kvtier.cli.errors.make_output_dir`),
    refusing (exit 2, one sentence) one that already holds a file of ``names`` (``None``: any
    entry) unless ``force``, and one where a file of ``names`` is one of ``inputs`` (even with ``force``)."""
    inputs = list(inputs)
    if path.is_dir():
        wanted = list(names) if names is not None else None
        for name in wanted or []:
            _refuse_inputs(option, path / name, inputs)
        held = sorted(p.name for p in path.iterdir() if wanted is None or p.name in wanted)
        if held and not force:
            last = held[-1] if len(held) <= 4 else f"{len(held) - 3} more"
            shown = " and ".join(filter(None, (", ".join(held[:min(3, len(held) - 1)]), last)))
            fail(f"{option} {path} already holds {shown}; pass a new or empty directory, or --force to replace "
                 "its files")
    make_output_dir(path, option)
