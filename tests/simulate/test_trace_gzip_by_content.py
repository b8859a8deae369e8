"""A gzip-compressed trace is read whatever its name (user41's review): ``trace stats`` and
``simulate`` refused a gzip stream saved as ``.jsonl`` with 'check that it is JSONL text or gzip'."""

from __future__ import annotations

import gzip
from importlib import resources
from pathlib import Path

from typer.testing import CliRunner

from kvtier.cli.main import app

runner = CliRunner()


def test_a_gzip_trace_named_jsonl_reads_as_the_same_trace(tmp_path: Path):
    bundled = Path(str(resources.files("kvtier") / "data" / "mooncake_conversation_trace.jsonl.gz"))
    lines = gzip.decompress(bundled.read_bytes()).splitlines(keepends=True)[:200]
    plain, named_jsonl = tmp_path / "plain.jsonl", tmp_path / "compressed.jsonl"
    plain.write_bytes(b"".join(lines))
    named_jsonl.write_bytes(gzip.compress(b"".join(lines)))
    expected = runner.invoke(app, ["trace", "stats", "--trace", str(plain)], env={"COLUMNS": "200"})
    assert expected.exit_code == 0, expected.output
    got = runner.invoke(app, ["trace", "stats", "--trace", str(named_jsonl)], env={"COLUMNS": "200"})
    assert got.exit_code == 0, got.output
    assert got.output.replace(named_jsonl.name, plain.name) == expected.output
    sim = runner.invoke(app, ["simulate", "--trace", str(named_jsonl), "--kv-bytes-per-token", "131072",
                              "--engine-gib", "1", "--cpu-gib", "4"], env={"COLUMNS": "200"})
    assert sim.exit_code == 0, sim.output
    # bytes that are neither still get the one sentence, no traceback
    (tmp_path / "bad.jsonl").write_bytes(b"\x1f\x8bnot gzip at all")
    bad = runner.invoke(app, ["trace", "stats", "--trace", str(tmp_path / "bad.jsonl")])
    assert bad.exit_code == 2 and "cannot read trace file" in bad.output, bad.output
    assert "Traceback" not in bad.output
