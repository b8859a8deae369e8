"""``kvtier doctor`` with both --url and --from-files refuses the pair (fresh-operator tester: the files
were used and the URL ignored, silently)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from kvtier.cli.main import app

DATA = Path(__file__).parents[1] / "doctor" / "data" / "kvtier-cpu"


def test_url_and_files_together_are_refused() -> None:
    before, after = str(DATA / "before.txt"), str(DATA / "after.txt")
    result = CliRunner().invoke(app, ["doctor", "--url", "http://127.0.0.1:9", "--from-files", before, after])
    assert result.exit_code == 2, result.output
    assert result.output == ("error: --url and --from-files are two sources of the metrics; give --url to scrape a "
                             "live server, or --from-files BEFORE AFTER to read recorded texts, not both.\n")
    assert CliRunner().invoke(app, ["doctor", "--from-files", before, after]).exit_code == 0


def test_scrape_options_with_files_are_refused() -> None:
    """--interval and --timeout time the live scrapes; with --from-files they were silently unused (clifix2)."""
    files = ["--from-files", str(DATA / "before.txt"), str(DATA / "after.txt")]
    for extra, said in ((["--interval", "60"], "--interval applies"), (["--timeout", "10"], "--timeout applies"),
                        (["--interval", "60", "--timeout", "3"], "--interval and --timeout apply")):
        result = CliRunner().invoke(app, ["doctor", *files, *extra])
        assert result.exit_code == 2, result.output
        assert result.output == (f"error: {said} to --url only (the live scrapes); --from-files reads recorded "
                                 f"texts, so drop {'them' if 'and' in said else 'it'}.\n")
