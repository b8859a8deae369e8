"""``kvtier bench-store`` runs the real tiers and writes the documented JSON (no timing asserted)."""

import json

from typer.testing import CliRunner

from kvtier.cli.main import app


def test_bench_store_json_shape(tmp_path):
    out = tmp_path / "bs.json"
    result = CliRunner().invoke(app, ["bench-store", "--sizes", "0.25,1", "--total-mib", "4", "--repeats", "1",
                                      "--dir", str(tmp_path), "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    assert {(r["tier"], r["op"], r["chunk_mib"]) for r in rows} == {
        (t, o, c) for t in ("cpu", "disk") for o in ("put", "get") for c in (0.25, 1.0)}
    for r in rows:
        assert r["gib_per_s"] > 0 and r["reference_gib_per_s"] > 0
        assert abs(r["ratio"] - r["gib_per_s"] / r["reference_gib_per_s"]) < 1e-9


import pytest


@pytest.mark.parametrize("args,needle", [
    (["--sizes", "four"], "--sizes"),
    (["--sizes", "0.00003"], "--sizes"),
    (["--sizes", "inf"], "--sizes"),
    (["--sizes", "nan"], "--sizes"),
    (["--sizes", ""], "--sizes"),
    (["--sizes", "4", "--total-mib", "1e12"], "--total-mib"),
    (["--json", "/tmp"], "--json"),
    (["--dir", "/nonexistent-kvtier"], "--dir"),
])
def test_bench_store_bad_input_is_one_line_error(args, needle):
    result = CliRunner().invoke(app, ["bench-store", *args])
    assert result.exit_code == 2
    assert needle in result.output and "Traceback" not in result.output
