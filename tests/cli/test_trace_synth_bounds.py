"""``kvtier trace synth`` bounds its counts (fresh-operator tester: --requests 1000000000000 ran for ages)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--requests", "1000000000000", "--requests 1,000,000,000,000 is more than the 1,000,000 one trace holds"),
    ("--block-tokens", "1000000000000", "--block-tokens 1,000,000,000,000 is more than 16,777,216"),
])
def test_a_huge_count_is_refused_at_once(tmp_path, option, value, message) -> None:
    out = tmp_path / "t.jsonl"
    result = CliRunner().invoke(app, ["trace", "synth", "--regime", "cycle", "--out", str(out), option, value])
    assert result.exit_code == 2, result.output
    assert f"error: {message}" in result.output and not out.exists()


def test_the_largest_count_is_accepted(tmp_path) -> None:
    out = tmp_path / "t.jsonl"
    result = CliRunner().invoke(app, ["trace", "synth", "--regime", "cycle", "--out", str(out),
                                      "--requests", "3", "--block-tokens", str(1 << 24)])
    assert result.exit_code == 0, result.output


def test_trace_record_bounds_its_block_tokens_before_any_connection(tmp_path) -> None:
    """The same bound as synth's: checked before the server is asked (port 9: nothing listens)."""
    result = CliRunner().invoke(app, ["trace", "record", "--url", "http://127.0.0.1:9", "--out",
                                      str(tmp_path / "t.jsonl"), "--block-tokens", "1000000000000"])
    assert result.exit_code == 2, result.output
    assert "error: --block-tokens 1,000,000,000,000 is more than 16,777,216" in result.output


def test_an_existing_out_is_refused_without_force(tmp_path) -> None:
    """As `trace record`: an existing --out is kept unless --force (clifix3: synth overwrote it silently)."""
    out = tmp_path / "t.jsonl"
    out.write_text("my recorded trace\n")
    args = ["trace", "synth", "--regime", "cycle", "--out", str(out), "--requests", "3"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2, refused.output
    assert f"error: --out {out} already exists; pass another file name, or --force to replace it" in refused.output
    assert out.read_text() == "my recorded trace\n"
    replaced = CliRunner().invoke(app, [*args, "--force"])
    assert replaced.exit_code == 0, replaced.output
    assert out.read_text() != "my recorded trace\n"
