"""The kvtier-jsonl trace's chunk keys are hex (docs/simulate.md: ``"chunk_keys": [hex, ...]``, as
``format_kvtier_record`` writes ``bytes.hex()``): anything else is refused in one sentence naming the
line, through the real CLI (fresh-user tester: ``["zz", "yy"]`` simulated with exit 0)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core.errors import TraceError
from kvtier.simulate.trace import format_kvtier_record, read_trace

GOOD = {"time_s": 0, "num_tokens": 256, "chunk_tokens": 128, "chunk_keys": ["aa01", "bb02"]}


def simulate(path):
    return CliRunner().invoke(app, ["simulate", "--trace", str(path), "--format", "kvtier-jsonl", "--cpu-gib", "1",
                                    "--kv-bytes-per-token", "1024", "--engine-gib", "0.001"])


@pytest.mark.parametrize("bad", ["zz", "abc", "0x1f", "ab cd", "g0"])
def test_a_chunk_key_that_is_not_hex_is_refused_naming_the_line(tmp_path, bad):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "time_s": 1, "chunk_keys": ["aa01", bad]}) + "\n")
    result = simulate(path)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert f"t.jsonl line 2: chunk key {bad!r} is not hex" in result.output


def test_keys_as_the_writer_writes_them_are_read_and_case_does_not_make_two_keys(tmp_path):
    key = bytes(range(16))
    written = format_kvtier_record(0.0, 256, 128, [key, key[::-1]])
    upper = json.dumps({**json.loads(written), "time_s": 1, "chunk_keys": [key.hex().upper(), key[::-1].hex()]})
    path = tmp_path / "t.jsonl"
    path.write_text(written + "\n" + upper + "\n")
    trace = read_trace(path, "kvtier-jsonl")
    assert trace.chunk_keys == [[0, 1], [0, 1]]
    assert simulate(path).exit_code == 0
    with pytest.raises(TraceError, match="line 1: chunk key 'zz' is not hex"):
        path.write_text(json.dumps({**GOOD, "chunk_keys": ["zz", "yy"]}) + "\n")
        read_trace(path, "kvtier-jsonl")
