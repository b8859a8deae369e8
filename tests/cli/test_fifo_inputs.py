"""An input that is a FIFO with no writer is refused in one sentence, found with stat before any
open: ``kvtier check ff``, ``simulate --trace ff``, ``trace stats --trace ff`` and ``doctor
--from-files ff ff`` each hung forever in open() (a FIFO opens for reading only once a writer comes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

COMMANDS = {
    "check": (["check", "{ff}"], ("error: '{ff}' is a FIFO (named pipe), not a regular file; give the JSON itself, a "
              "file holding it, or - for standard input.")),
    "simulate": (["simulate", "--trace", "{ff}", "--kv-bytes-per-token", "2048", "--engine-gib", "0", "--cpu-gib", "1"],
                 "error: trace file {ff} is a FIFO (named pipe), not a regular file; pass a .jsonl(.gz) file"),
    "trace stats": (["trace", "stats", "--trace", "{ff}"],
                    "error: trace file {ff} is a FIFO (named pipe), not a regular file; pass a .jsonl(.gz) file"),
    "doctor": (["doctor", "--from-files", "{ff}", "{ff}"],
               "error: {ff} is a FIFO (named pipe), not a regular file; give a recorded /metrics page (a file)."),
    "bench run --baseline": (["bench", "run", "--baseline", "{ff}", "--url", "http://127.0.0.1:9"],
                             "error: --baseline {ff} is a FIFO (named pipe), not a regular file; give a regular file"),
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_fifo_without_a_writer_is_refused_not_waited_on(tmp_path, name) -> None:
    ff = tmp_path / "ff"
    os.mkfifo(ff)
    args, expected = COMMANDS[name]
    try:
        result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", *(a.format(ff=ff) for a in args)],
                                capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvtier {name} waited on a FIFO with no writer")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == expected.format(ff=ff)


def test_a_directory_trace_keeps_its_own_sentence(tmp_path) -> None:
    from kvtier.core.errors import TraceError
    from kvtier.simulate.trace import read_trace

    with pytest.raises(TraceError, match="is a directory; pass a .jsonl"):
        read_trace(tmp_path)
