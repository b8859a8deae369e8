"""A tier's tool flags come from its plug-in's settings model (issue 33 item 6): the toy dict tier
from outside kvtier (tests/dict_tier.py), registered as ``tier_modules`` registers it, gets
``--dict-storage`` and ``--dict-capacity-mib`` in ``kvtier bench-store``, ``kvtier size`` and
``kvtier purge`` with no edit in kvtier.cli, and bench-store measures it and size puts it in the
recipe.  The commands are built after the registration, as ``kvtier`` builds them at start-up."""

from __future__ import annotations

import json
import re
import sys
import uuid

import pytest
import typer
from typer.testing import CliRunner

from kvtier.core.tiers import registry

PLUGIN = "tests.dict_tier_plugin"
LLAMA = "meta-llama/Llama-3.1-8B"


@pytest.fixture
def app():
    """A kvtier CLI built with the dict tier registered (its module imported, as tier_modules does)."""
    import importlib

    from kvtier.cli import bench_store, size, stored

    sys.modules.pop(PLUGIN, None)
    importlib.import_module(PLUGIN)
    cli = typer.Typer()
    cli.callback()(lambda: None)
    for module in (bench_store, size, stored):
        module.register(cli)
    yield cli
    registry.unregister("dict")
    sys.modules.pop(PLUGIN, None)


def run(app, *args: str):
    return CliRunner(env={"COLUMNS": "250"}).invoke(app, list(args))


def test_the_built_in_cli_has_no_flag_of_the_toy_tier():
    """The contrast: kvtier's own CLI, built without the dict tier, has none of its flags."""
    from kvtier.cli.main import app as kvtier_app

    for command in ("bench-store", "size", "purge"):
        assert "--dict-storage" not in run(kvtier_app, command, "--help").output


def test_bench_store_measures_the_toy_tier_from_its_settings_flags(app, tmp_path):
    from tests.dict_tier import _AREAS

    help_text = run(app, "bench-store", "--help").output
    assert all(flag in help_text for flag in ("--dict-storage", "--dict-capacity-mib", "--dict-only",
                                              "--redis-url", "--s3-in-flight"))
    area = f"bench-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "bs.json"
    result = run(app, "bench-store", "--sizes", "0.25,0.5", "--total-mib", "1", "--repeats", "2",
                 "--dict-storage", area, "--dict-capacity-mib", "4", "--dict-only", "--json", str(out))
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    assert {(r["tier"], r["op"], r["chunk_mib"]) for r in rows} == {
        ("dict", op, c) for op in ("put", "get") for c in (0.25, 0.5)}
    assert all(r["gib_per_s"] > 0 and r["reference_gib_per_s"] > 0 for r in rows)
    assert "reference: dict = numpy.copyto of the same bytes" in result.output
    assert not any(keys for keys in _AREAS.pop(area).values())  # each round's chunks deleted
    # a round that does not fit the tier is one sentence, not a row
    small = run(app, "bench-store", "--sizes", "0.5", "--total-mib", "2", "--repeats", "1",
                "--dict-storage", area, "--dict-capacity-mib", "1", "--dict-only")
    assert small.exit_code == 2, small.output
    assert re.fullmatch(r"error: the dict tier stored [0-3] of the 4 chunks of 0\.5 MiB of a round \(2 MiB; a round "
                        r"holds at least two chunks\); give it room for 2 MiB or lower --total-mib\.\n", small.output), \
        small.output
    _AREAS.pop(area, None)


@pytest.mark.parametrize("args, message", [
    (("--dict-capacity-mib", "8"), ("error: --dict-capacity-mib needs --dict-storage NAME to measure the dict tier; "
                                    "add it, or drop it to measure the other tiers only\n")),
    (("--dict-only",), "error: --dict-only needs --dict-storage (the area to measure)\n"),
    (("--dict-only", "--redis-only", "--redis-url", "redis://127.0.0.1:1/0", "--dict-storage", "a"),
     "error: --dict-only and --redis-only exclude each other; give one of them, or neither to measure every tier\n"),
    (("--dict-storage", "a", "--dict-capacity-mib", "-1", "--dict-only", "--sizes", "0.25", "--total-mib", "1"),
     "error: --dict-capacity-mib: Input should be greater than 0 (got -1.0).\n"),
])
def test_bench_store_refuses_the_toy_tiers_flags_as_a_built_in_tiers(app, args, message):
    result = run(app, "bench-store", *args)
    assert result.exit_code == 2 and result.output == message


def test_size_puts_the_toy_tier_in_the_recipe_from_its_settings_flags(app):
    from kvtier.core.config import KVTierConfig

    assert "--dict-storage" in run(app, "size", "--help").output
    result = run(app, "size", "--model", LLAMA, "--offload-gib", "64", "--dict-storage", "kv-area",
                 "--dict-capacity-mib", "512", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    extra = json.loads(report["recipe"]["kvtier"].split("--kv-transfer-config ", 1)[1].strip("'"))[
        "kv_connector_extra_config"]
    assert extra["dict_storage"] == "kv-area" and extra["dict_capacity_mib"] == 512
    assert any(n.startswith("the dict tier is not shipped with kvtier") for n in report["notes"])
    KVTierConfig.from_dict(extra)  # the recipe is a config the connector accepts (the tier registered)
    stray = run(app, "size", "--model", LLAMA, "--offload-gib", "64", "--dict-capacity-mib", "512")
    assert stray.exit_code == 2 and stray.output == (
        "error: --dict-capacity-mib needs --dict-storage NAME (the area the tier uses) to add the dict tier to the "
        "recipe; add it, or drop it to size without it\n")
    bad = run(app, "size", "--model", LLAMA, "--offload-gib", "64", "--dict-storage", "kv-area",
              "--dict-capacity-mib", "0")
    assert bad.exit_code == 2 and bad.output.startswith("error: --dict-capacity-mib: Input should be greater than 0")


def test_purge_takes_the_toy_tiers_target(app):
    assert "--dict-storage" in run(app, "purge", "--help").output


def test_kvtier_takes_a_tier_from_kvtier_tier_modules(tmp_path):
    """The real ``kvtier`` registers the tiers of KVTIER_TIER_MODULES (the environment form of tier_modules)
    before it builds its commands, so an operator's tier has its flags with no edit anywhere; a module that
    cannot be imported is one sentence, exit 2."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).parents[2]

    def kvtier(modules: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin", "COLUMNS": "250", "KVTIER_TIER_MODULES": json.dumps([modules]),
               **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}
        return subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args], capture_output=True, text=True,
                              check=False, timeout=120, cwd=root, env=env)

    for command in ("bench-store", "size", "purge"):
        shown = kvtier(PLUGIN, command, "--help")
        assert shown.returncode == 0 and "--dict-storage" in shown.stdout, shown.stderr
    out = tmp_path / "bs.json"
    measured = kvtier(PLUGIN, "bench-store", "--sizes", "0.25", "--total-mib", "0.5", "--repeats", "1",
                      "--dict-storage", "env-area", "--dict-only", "--json", str(out))
    assert measured.returncode == 0, measured.stderr
    assert {r["tier"] for r in json.loads(out.read_text())["results"]} == {"dict"}
    bad = kvtier("nosuch_tiers_module", "--help")
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr == (
        "error: KVTIER_TIER_MODULES: tier_modules names 'nosuch_tiers_module', which cannot be imported (No module "
        "named 'nosuch_tiers_module'); install the package that provides it or remove it from tier_modules.\n")
